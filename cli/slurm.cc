#include "cli/slurm.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace ctorchrun::cli {

namespace {

constexpr size_t kMaxRange = 65536;            // hosts in one range, as Slurm's MAX_RANGE
constexpr size_t kMaxHosts = size_t{1} << 20;  // hosts in one expression

[[noreturn]] void bad(const std::string& expression, const std::string& why) {
  throw ConfigError("hostlist '" + expression + "': " + why);
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char ch : s) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
  }
  return true;
}

uint64_t to_number(const std::string& expression, const std::string& s) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc() || end != s.data() + s.size()) bad(expression, "'" + s + "' is too large");
  return n;
}

// The numbers of one bracket's body ("01-04,07"), each as text with its padding.
std::vector<std::string> expand_bracket(const std::string& expression, const std::string& body) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = body.find(',', start);
    const std::string item =
        body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t dash = item.find('-');
    const std::string lo_text = item.substr(0, dash);
    const std::string hi_text = dash == std::string::npos ? lo_text : item.substr(dash + 1);
    if (!all_digits(lo_text) || !all_digits(hi_text)) {
      bad(expression, "invalid range '" + item + "' (expected N or LO-HI)");
    }
    const uint64_t lo = to_number(expression, lo_text);
    const uint64_t hi = to_number(expression, hi_text);
    if (lo > hi) bad(expression, "invalid range '" + item + "': " + lo_text + " > " + hi_text);
    if (hi - lo >= kMaxRange) bad(expression, "too many hosts in range '" + item + "'");
    const size_t width = lo_text.size() > 1 && lo_text[0] == '0' ? lo_text.size() : 0;
    for (uint64_t n = lo;; ++n) {
      std::string digits = std::to_string(n);
      if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
      out.push_back(std::move(digits));
      if (n == hi) break;
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// One top-level item ("r[1-2]-n[1-2]") appended to `out`.
void expand_item(const std::string& expression, const std::string& item,
                 std::vector<std::string>* out) {
  // Literal parts and bracket bodies, alternating: text0 [b0] text1 [b1] ...
  std::vector<std::string> texts(1);
  std::vector<std::vector<std::string>> brackets;
  size_t i = 0;
  while (i < item.size()) {
    const char ch = item[i];
    if (ch == ']') bad(expression, "unbalanced ']'");
    if (ch != '[') {
      texts.back().push_back(ch);
      ++i;
      continue;
    }
    const size_t close = item.find(']', i + 1);
    if (close == std::string::npos) bad(expression, "unbalanced '['");
    const std::string body = item.substr(i + 1, close - i - 1);
    if (body.find('[') != std::string::npos) bad(expression, "nested '['");
    brackets.push_back(expand_bracket(expression, body));
    texts.emplace_back();
    i = close + 1;
  }
  if (!brackets.empty() && !texts.back().empty()) {
    bad(expression, "'" + texts.back() + "' after the last ']' (Slurm refuses it too)");
  }
  // The product, leftmost bracket varying slowest.
  size_t total = 1;
  for (const auto& b : brackets) {
    total *= b.size();
    if (total + out->size() > kMaxHosts) bad(expression, "more than 1048576 hosts");
  }
  std::vector<size_t> at(brackets.size(), 0);
  for (size_t n = 0; n < total; ++n) {
    std::string host = texts[0];
    for (size_t b = 0; b < brackets.size(); ++b) host += brackets[b][at[b]] + texts[b + 1];
    out->push_back(std::move(host));
    for (size_t b = brackets.size(); b-- > 0;) {
      if (++at[b] < brackets[b].size()) break;
      at[b] = 0;
    }
  }
}

std::string get(const std::map<std::string, std::string>& env, const std::string& key) {
  auto it = env.find(key);
  return it == env.end() ? std::string() : it->second;
}

bool has(const std::map<std::string, std::string>& env, const std::string& key) {
  auto it = env.find(key);
  return it != env.end() && !it->second.empty();
}

// A step variable that must be a whole number in [lo, hi].
int number_of(const std::map<std::string, std::string>& env, const std::string& key, int lo,
              int hi) {
  const std::string v = get(env, key);
  int n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || n < lo || n > hi) {
    throw ConfigError(key + "='" + v + "' is not a number in [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "]");
  }
  return n;
}

// Slurm's tasks-per-node notation ("2(x3),1"): the largest count, 0 when
// unreadable.
int max_tasks_per_node(const std::string& v) {
  int most = 0;
  size_t start = 0;
  while (start <= v.size()) {
    size_t comma = v.find(',', start);
    if (comma == std::string::npos) comma = v.size();
    const std::string item = v.substr(start, comma - start);
    int n = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), n);
    if (ec != std::errc() || end == item.data()) return 0;
    most = std::max(most, n);
    start = comma + 1;
  }
  return most;
}

// The batch step and the extern step are no task of an srun step.
bool special_step(const std::string& step_id) {
  return step_id == "batch" || step_id == "extern" || step_id == "interactive" ||
         step_id == "4294967294" || step_id == "4294967291" || step_id == "4294967290";
}

// A multi-node batch script that runs ctorchrun outside any step: only the
// batch host runs workers. The warning, or "" when that is not the case.
std::string outside_step_warning(const SlurmGiven& given,
                                 const std::map<std::string, std::string>& env) {
  const std::string nodes = get(env, "SLURM_JOB_NUM_NODES").empty()
                                ? get(env, "SLURM_NNODES")
                                : get(env, "SLURM_JOB_NUM_NODES");
  if (!has(env, "SLURM_JOB_ID") || nodes.empty() || nodes == "1" || given.standalone) return "";
  return "running in Slurm job " + get(env, "SLURM_JOB_ID") + " of " + nodes +
         " nodes but outside any job step: only this host (" + get(env, "SLURMD_NODENAME") +
         ") runs workers; start ctorchrun with `srun --ntasks-per-node=1 ctorchrun ...` "
         "to use every node";
}

// One agent per node: several tasks on a node would each start workers.
void check_one_task_per_node(const std::map<std::string, std::string>& env, int step_nodes) {
  const std::string job = get(env, "SLURM_JOB_ID"), step = get(env, "SLURM_STEP_ID");
  for (const char* key : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    if (!has(env, key)) continue;
    if (int most = max_tasks_per_node(get(env, key)); most > 1) {
      throw ConfigError("Slurm step " + job + "." + step + " runs " + std::to_string(most) +
                        " tasks on a node (" + key + "=" + get(env, key) +
                        "): ctorchrun is one agent per node that starts the workers itself; "
                        "use `srun --ntasks-per-node=1 ctorchrun --nproc_per_node=N ...`");
    }
    break;  // the step's own count, when given, is the one that matters
  }
  const char* tasks_key =
      has(env, "SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  if (has(env, tasks_key)) {
    const int tasks = number_of(env, tasks_key, 1, 1 << 30);
    if (tasks > step_nodes) {
      throw ConfigError("Slurm step " + job + "." + step + " runs " + std::to_string(tasks) +
                        " tasks on " + std::to_string(step_nodes) + " nodes (" + tasks_key +
                        "): ctorchrun is one agent per node that starts the workers itself; "
                        "use `srun --ntasks-per-node=1 ctorchrun --nproc_per_node=N ...`");
    }
  }
}

// Workers per node from the step: its GPUs, else CUDA_VISIBLE_DEVICES, else 1.
int step_nproc(const std::map<std::string, std::string>& env, std::string* source) {
  if (has(env, "SLURM_GPUS_ON_NODE") && get(env, "SLURM_GPUS_ON_NODE") != "0") {
    *source = "SLURM_GPUS_ON_NODE";
    return number_of(env, "SLURM_GPUS_ON_NODE", 1, 1 << 16);
  }
  if (has(env, "CUDA_VISIBLE_DEVICES")) {
    const std::string v = get(env, "CUDA_VISIBLE_DEVICES");
    *source = "CUDA_VISIBLE_DEVICES";
    return static_cast<int>(std::count(v.begin(), v.end(), ',')) + 1;
  }
  return 1;
}

// Each value the command line left open, from the step; t->summary names
// what came from where.
void fill_from_step(const SlurmGiven& given, const std::map<std::string, std::string>& env,
                    int step_nodes, SlurmTopology* t) {
  const std::string job = get(env, "SLURM_JOB_ID"), step = get(env, "SLURM_STEP_ID");
  std::string from;
  auto note = [&](const std::string& what, const std::string& source) {
    from += (from.empty() ? "" : " ") + what + " (" + source + ")";
  };
  if (!given.nnodes) {
    t->nnodes = step_nodes;
    note("nnodes=" + std::to_string(step_nodes), "SLURM_STEP_NUM_NODES");
  }
  const int node_id = number_of(env, "SLURM_NODEID", 0, step_nodes - 1);
  if (!given.node_rank) {
    t->node_rank = node_id;
    note("node_rank=" + std::to_string(node_id), "SLURM_NODEID");
  }
  t->first_host = node_id == 0;
  if (!given.nproc_per_node) {
    std::string source;
    t->nproc_per_node = step_nproc(env, &source);
    if (!source.empty()) note("nproc_per_node=" + std::to_string(*t->nproc_per_node), source);
  }
  if (!given.master_addr && !given.rdzv_endpoint) {
    const std::string list = get(env, "SLURM_STEP_NODELIST");
    const std::vector<std::string> hosts = expand_hostlist(list);
    if (hosts.empty()) throw ConfigError("SLURM_STEP_NODELIST='" + list + "' names no host");
    t->master_addr = hosts.front();
    note("master=" + hosts.front(), "first of SLURM_STEP_NODELIST=" + list);
  }
  if (!given.master_port && !given.rdzv_endpoint) {
    t->port = slurm_port(job, step);
    note("port=" + std::to_string(*t->port), "from SLURM_JOB_ID and SLURM_STEP_ID");
  }
  if (!given.rdzv_id) {
    t->rdzv_id = job + "." + step;
    note("rdzv_id=" + *t->rdzv_id, "SLURM_JOB_ID.SLURM_STEP_ID");
  }
  const std::string node = get(env, "SLURMD_NODENAME");
  t->summary = "Slurm job " + job + " step " + step + (node.empty() ? "" : " on " + node) + ": " +
               (from.empty() ? "every value given on the command line" : from);
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& expression) {
  std::vector<std::string> out;
  std::string item;
  int depth = 0;
  for (char ch : expression) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    const bool separator = ch == ',' || std::isspace(static_cast<unsigned char>(ch));
    if (separator && depth == 0) {
      if (!item.empty()) expand_item(expression, item, &out);
      item.clear();
      continue;
    }
    if (std::isspace(static_cast<unsigned char>(ch))) bad(expression, "white space inside '[]'");
    item.push_back(ch);
  }
  if (!item.empty()) expand_item(expression, item, &out);
  return out;
}

int slurm_port(const std::string& job_id, const std::string& step_id) {
  constexpr uint32_t kBase = 20000, kSpan = 12000;
  uint32_t h = 2166136261u;  // FNV-1a
  for (char ch : job_id) {
    h ^= static_cast<unsigned char>(ch);
    h *= 16777619u;
  }
  uint32_t step = 0;
  std::from_chars(step_id.data(), step_id.data() + step_id.size(), step);
  return static_cast<int>(kBase + (h % kSpan + step % kSpan) % kSpan);
}

SlurmTopology resolve_slurm(SlurmMode mode, const SlurmGiven& given,
                            const std::map<std::string, std::string>& env) {
  SlurmTopology t;
  if (mode == SlurmMode::kOff) return t;
  const bool in_step = has(env, "SLURM_STEP_ID") && has(env, "SLURM_PROCID") &&
                       !special_step(get(env, "SLURM_STEP_ID"));
  if (!in_step) {
    if (mode == SlurmMode::kOn) {
      throw ConfigError(
          "--slurm=on: not a task of a Slurm job step (SLURM_STEP_ID and SLURM_PROCID are not "
          "both set); run ctorchrun under srun");
    }
    t.warning = outside_step_warning(given, env);
    return t;
  }
  if (given.standalone) return t;
  const int step_nodes = number_of(env, "SLURM_STEP_NUM_NODES", 1, 1 << 20);
  check_one_task_per_node(env, step_nodes);
  t.active = true;
  fill_from_step(given, env, step_nodes, &t);
  return t;
}

bool slurm_signals_reach_workers(const std::string& slurm_conf) {
  std::istringstream in(slurm_conf);
  std::string line;
  bool reach = true;
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    auto trim = [](std::string t) {
      const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
      t.erase(t.begin(), std::find_if_not(t.begin(), t.end(), space));
      t.erase(std::find_if_not(t.rbegin(), t.rend(), space).base(), t.end());
      std::transform(t.begin(), t.end(), t.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      return t;
    };
    // slurm.conf keys are case-insensitive; the last setting wins.
    if (trim(line.substr(0, eq)) == "proctracktype") {
      reach = trim(line.substr(eq + 1)) != "proctrack/pgid";
    }
  }
  return reach;
}

std::string read_slurm_conf(const std::map<std::string, std::string>& env) {
  std::vector<std::string> paths = {"/run/slurm/conf/slurm.conf", "/etc/slurm/slurm.conf"};
  auto it = env.find("SLURM_CONF");
  if (it != env.end() && !it->second.empty()) paths.insert(paths.begin(), it->second);
  for (const auto& path : paths) {
    std::ifstream in(path);
    if (!in) continue;
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }
  return "";
}

}  // namespace ctorchrun::cli
