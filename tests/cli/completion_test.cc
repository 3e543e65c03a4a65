// `ctorchrun --print-completion SHELL`: scripts from the option table, loaded
// by the real shells.

#include "cli/completion.h"

#include <catch2/catch.hpp>
#include <fstream>

#include "cli/option_table.h"
#include "tests/launcher/launcher_support.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

// The script ctorchrun prints for `shell`, in a file of `dir`.
std::string script_file(TempDir& dir, const std::string& shell) {
  auto r = run_ctorchrun({"--print-completion", shell}, {}, std::chrono::seconds(30));
  REQUIRE(r.exit_code == 0);
  const std::string path = dir.file("ctorchrun." + shell);
  std::ofstream(path) << r.output;
  return path;
}

// What bash's completion of ctorchrun offers for `words`, the last being
// the word under the cursor (bash splits "--opt=value" at '=').
std::string bash_complete(const std::string& script, const std::vector<std::string>& words) {
  std::string list;
  for (const std::string& w : words) list += " '" + w + "'";
  Process p({"/bin/bash", "--norc", "-c",
             "source '" + script + "' || exit 9; COMP_WORDS=(ctorchrun" + list +
                 "); COMP_CWORD=" + std::to_string(words.size()) +
                 "; _ctorchrun; if ((${#COMPREPLY[@]})); then printf '%s\\n' "
                 "\"${COMPREPLY[@]}\" | sort; fi"},
            {}, true);
  std::string out = p.read_all(20s);
  CHECK(p.exit_code(20s) == 0);
  return out;
}

}  // namespace

TEST_CASE("completion: bash completes options, their values and then files", "[unit]") {
  TempDir dir;
  const std::string script = script_file(dir, "bash");
  CHECK(bash_complete(script, {"--nproc"}) == "--nproc-per-node\n--nproc_per_node\n");
  CHECK(bash_complete(script, {"--rdzv_backend", ""}) == "c10d\netcd-v3\nstatic\n");
  CHECK(bash_complete(script, {"--rdzv-backend", "=", "c"}) == "c10d\n");
  CHECK(bash_complete(script, {"--print-completion", ""}) == "bash\ntcsh\nzsh\n");
  CHECK(bash_complete(script, {"-m", "--stand"}) == "--standalone\n");
  // Every option string of the table is offered after "--".
  const std::string all = bash_complete(script, {"--"});
  for (const cli::OptionRow& r : cli::option_table()) {
    for (const std::string& n : r.long_names()) {
      INFO(n);
      CHECK(all.find(n + "\n") != std::string::npos);
    }
  }
  // A value that is no choice: nothing to offer, and no option either.
  CHECK(bash_complete(script, {"--nnodes", ""}).empty());
  // After the script its own arguments: files, never our options.
  std::ofstream(dir.file("train.py")) << "";
  const std::string after = bash_complete(script, {"--nnodes", "2", dir.file("train.py"), "--"});
  CHECK(after.find("--nnodes") == std::string::npos);
  CHECK(bash_complete(script, {"--log_dir", dir.file("tr")}).empty());  // directories only
  CHECK(bash_complete(script, {dir.file("tr")}) == dir.file("train.py") + "\n");
}

TEST_CASE("completion: zsh and tcsh load their scripts", "[unit]") {
  TempDir dir;
  const std::string zsh = script_file(dir, "zsh");
  {
    Process p({"/usr/bin/zsh", "-f", "-c",
               "autoload -U compinit && compinit -u -d '" + dir.file("zcompdump") +
                   "' && source '" + zsh + "' && print -r -- ${_comps[ctorchrun]}"},
              {}, true);
    CHECK(p.read_all(20s) == "_ctorchrun\n");
    CHECK(p.exit_code(20s) == 0);
  }
  const std::string tcsh = script_file(dir, "tcsh");
  Process p({"/usr/bin/tcsh", "-f", "-c", "source '" + tcsh + "'; complete ctorchrun"}, {}, true);
  const std::string spec = p.read_all(20s);
  CHECK(p.exit_code(20s) == 0);
  CHECK(spec.find("n/--rdzv_backend/(static c10d etcd-v3)/") != std::string::npos);
  CHECK(spec.find("nproc_per_node") != std::string::npos);
}

TEST_CASE("completion: the shells offered are the option's choices, and a bad one is exit 2",
          "[unit]") {
  CHECK(cli::option_row("print_completion").choices == cli::completion_shells());
  auto r = run_ctorchrun({"--print-completion", "fish"}, {}, std::chrono::seconds(30));
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--print-completion") != std::string::npos);
  r = run_ctorchrun({"--print_completion=bash"}, {}, std::chrono::seconds(30));
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("complete -o filenames -F _ctorchrun ctorchrun") != std::string::npos);
}
