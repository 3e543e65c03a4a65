// ctorchrun --cpu_backend ctorch: unmodified gloo scripts run on the bundled
// runtime, with torch 1.13 and (torch2 copies) 2.6. The scripts never import
// ctorch; they print what each group asked for and what runs it.

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

const std::string kWorker = CTORCHRUN_SOURCE_DIR "/tests/torch_backend/cpu_backend_worker.py";

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

std::vector<std::string> job(const std::string& cpu_backend, const std::vector<std::string>& rest) {
  return concat({"--nproc_per_node=2", "--master_port=" + std::to_string(free_port()),
                 "--cpu_backend=" + cpu_backend},
                rest);
}

// What each group reported, "GROUP <name> asked=<backend> runs=<backend>"
// lines sorted (two ranks each).
std::vector<std::string> groups_of(const std::string& output) {
  std::vector<std::string> out;
  const std::regex line("GROUP [a-z_]+ asked=[^ ]+ runs=[a-z]+ ok");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    out.push_back(it->str());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> replaced(std::vector<std::string> lines, const std::string& from,
                                  const std::string& to) {
  for (std::string& l : lines) l = std::regex_replace(l, std::regex(from), to);
  return lines;
}

}  // namespace

TEST_CASE(
    "ctorchrun --cpu_backend ctorch: an unmodified script's gloo groups run on ctorch over shared "
    "memory, "
    "and get_backend() still says what the script asked for",
    "[torch]") {
  for (const std::string mode : {"gloo", "default", "pairs"}) {
    CAPTURE(mode);
    auto gloo = run_ctorchrun(job("gloo", {kWorker, mode}), {}, 180s);
    INFO(gloo.output);
    REQUIRE(gloo.exit_code == 0);
    auto ours = run_ctorchrun(job("ctorch", {kWorker, mode}), {}, 180s);
    INFO(ours.output);
    REQUIRE(ours.exit_code == 0);
    const auto on_gloo = groups_of(gloo.output), on_ctorch = groups_of(ours.output);
    REQUIRE(on_gloo.size() == 6);  // three groups, two ranks
    CHECK(count_of(gloo.output, "runs=gloo ok") == 6);
    CHECK(count_of(ours.output, "runs=ctorch ok") == 6);
    // What get_backend() says is what it says without ctorch.
    CHECK(replaced(on_ctorch, "runs=ctorch", "runs=gloo") == on_gloo);
    CHECK(count_of(ours.output, "asked=ctorch") == 0);
    // Each group's rank 0 says what runs it, and over which transport.
    CHECK(count_of(ours.output, "runs on ctorch (--cpu_backend ctorch), transport shm") == 3);
    CHECK(count_of(gloo.output, "runs on ctorch") == 0);
  }
}

TEST_CASE(
    "ctorchrun --cpu_backend ctorch: the demo's DDP script, unmodified, ends with gloo's "
    "parameters",
    "[torch]") {
  TempDir dir("cpu-backend-ddp");
  std::map<std::string, std::string> digest;
  for (const std::string backend : {"gloo", "ctorch"}) {
    auto r = run_ctorchrun(job(backend, {CTORCHRUN_SOURCE_DIR "/examples/ddp_train.py", "--workdir",
                                         dir.file(backend), "--epochs", "2", "--backend", "gloo"}),
                           {}, 240s);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const std::string result = read_file(dir.file(backend + "/result.json"));
    std::smatch m;
    REQUIRE(std::regex_search(result, m, std::regex("\"digest\": *\"([0-9a-f]{64})\"")));
    digest[backend] = m[1];
    CHECK(count_of(r.output, "runs on ctorch") == (backend == "ctorch" ? 1 : 0));
  }
  CHECK(digest["ctorch"] == digest["gloo"]);
}

TEST_CASE(
    "ctorchrun --cpu_backend ctorch: the user's sitecustomize and PYTHONPATH still run, and a "
    "torch "
    "without a ctorch build warns once and stays on gloo",
    "[torch]") {
  TempDir dir("cpu-backend-site");
  std::filesystem::create_directories(dir.file("user"));
  std::ofstream(dir.file("user/sitecustomize.py"))
      << "import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n";
  auto r =
      run_ctorchrun(job("ctorch", {kWorker, "gloo"}), {{"PYTHONPATH", dir.file("user")}}, 180s);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(count_of(r.output, "sitecustomize=ran") == 2);
  CHECK(count_of(r.output, "runs=ctorch ok") == 6);

  // A ctorch that cannot load for this torch (as where no build matches it).
  std::filesystem::create_directories(dir.file("user/ctorch"));
  std::ofstream(dir.file("user/ctorch/__init__.py"))
      << "raise ImportError('ctorch has no build for torch 9.9 (built for: 1.13, 2.6)')\n";
  r = run_ctorchrun(job("ctorch", {kWorker, "gloo"}), {{"PYTHONPATH", dir.file("user")}}, 180s);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(count_of(r.output, "runs=gloo ok") == 6);
  CHECK(count_of(r.output, "ctorch has no build for torch 9.9") == 1);  // once per job
  CHECK(count_of(r.output, "process groups stay on gloo") == 1);
  CHECK(count_of(r.output, "sitecustomize=ran") == 2);
}

TEST_CASE(
    "ctorchrun --cpu_backend: init_process_group(\"ctorch\") works without import ctorch where "
    "torch "
    "autoloads backends (2.5 and later)",
    "[torch]") {
  const int major = test_torch_version().first;
  auto r = run_ctorchrun(job("gloo", {kWorker, "ctorch"}), {}, 180s);
  INFO(r.output);
  if (major >= 2) {
    REQUIRE(r.exit_code == 0);
    CHECK(count_of(r.output, "GROUP world asked=ctorch runs=ctorch ok") == 2);
  } else {
    // torch 1.13 has no autoload: the backend is unknown without `import ctorch`.
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("ctorch") != std::string::npos);
  }
}
