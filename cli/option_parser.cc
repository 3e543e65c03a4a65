#include "cli/option_parser.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <set>

#include "cli/completion.h"
#include "cli/option_table.h"
#include "cli/rdzv_conf.h"
#include "common/config.h"
#include "common/error.h"

namespace ctorchrun::cli {

namespace {

// Durations on the command line: decimal seconds in [0, one year].
CLI::Validator seconds_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double d = 0;
        if (parse_seconds(s, 0, false, kMaxSeconds, &d)) return "";
        return "'" + s + "' is not decimal seconds in [0, 31536000]";
      },
      "SECONDS");
}

// --nproc_per_node: a count, or cpu, gpu (cuda) or auto.
CLI::Validator nproc_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s == "cpu" || s == "gpu" || s == "cuda" || s == "auto") return "";
        int n = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
        if (ec == std::errc() && end == s.data() + s.size() && n >= 1 && n <= (1 << 16)) return "";
        return "'" + s + "' is not a number of workers in [1, 65536], cpu, gpu or auto";
      },
      "N|cpu|gpu|auto");
}

// The rows' options, each bound to its value in `values`.
struct BoundApp {
  CLI::App app;
  std::map<const CLI::Option*, const OptionRow*> rows;              // for lookups
  std::vector<std::pair<CLI::Option*, const OptionRow*>> in_order;  // as the table lists them
  BoundApp(const std::string& description, const std::string& name) : app(description, name) {}
};

CLI::Option* add_row(CLI::App& app, const OptionRow& r, OptionValue& v) {
  CLI::Option* o = nullptr;
  switch (r.type) {
    case ValueType::kFlag:
      return app.add_flag(r.names, v.flag);
    case ValueType::kText:
      v.text = r.default_text;
      o = app.add_option(r.names, v.text);
      if (r.check_choices) o->check(CLI::IsMember(r.choices));
      if (r.nproc_check) o->check(nproc_validator());
      break;
    case ValueType::kInteger:
      v.integer = r.default_text.empty() ? 0 : std::stoi(r.default_text);
      o = app.add_option(r.names, v.integer)->check(CLI::Range(r.min, r.max));
      break;
    case ValueType::kSeconds:
      v.seconds = std::stod(r.default_text);
      o = app.add_option(r.names, v.seconds)->check(seconds_validator());
      break;
    case ValueType::kIntegerList:
      o = app.add_option(r.names, v.list)
              ->delimiter(',')
              ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
              ->check(CLI::Range(r.min, r.max));
      break;
  }
  return o->type_name("")->default_str(r.default_text);
}

// The footer of --help: what the rows cannot say on their own.
std::string footer() {
  std::string unsets;
  std::vector<std::string> names;
  for (const OptionRow& r : option_table()) {
    if (r.empty_unsets) names.push_back(r.long_names().back());
  }
  for (size_t i = 0; i < names.size(); ++i) {
    unsets += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  }
  return R"(
The training script and its arguments come last and are passed through untouched.
Before the script, as torchrun's argparse allows, a long option may be shortened to a
prefix of exactly one option string (--nproc_per=4, --max-restart=3, --no-py); a prefix
of several, even of one option's two spellings (--nproc), is an "ambiguous option"
error, and an option ctorchrun does not know is an error too. A first `--`
before the script is dropped and the next argument is the script, even if it starts
with '-'. An empty value (--log_dir= or --log_dir '') is an error, except that it
unsets )" +
         unsets + R"(.
The script runs as `$PYTHON -u script args...` (`-m module` with --module), where
$PYTHON is $CTORCHRUN_PYTHON, else $PYTHON_EXEC, else python3 from PATH.

Every option can also be set as PET_<NAME> in the environment (PET_NPROC_PER_NODE=4),
as with torchrun; the command line wins, an empty variable counts as unset. Other
variables read: LOGLEVEL (DEBUG, INFO, WARNING, ERROR), TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (the teed
lines' prefix, as --log_line_prefix_template), OMP_NUM_THREADS (set to 1 for
the workers when unset and nproc_per_node > 1).

Workers get torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE, TORCH_NCCL_ASYNC_ERROR_HANDLING,
and NCCL_ASYNC_ERROR_HANDLING when the workers' torch is older than 2.2 or unknown
(--no_python). TORCHELASTIC_RESTART_COUNT counts every restart of
the workers, failures and elastic re-formations alike, so it can exceed
TORCHELASTIC_MAX_RESTARTS; ours tell them apart: CTORCHRUN_FAILED_RESTARTS (charged
to --max_restarts) and CTORCHRUN_ROUND (the elastic round); the count is their sum.

Read by the agent itself, as torch's agent reads them:
  TORCHELASTIC_ENABLE_FILE_TIMER=1  serve torch's file timer (expires()) on the pipe
                                    TORCHELASTIC_TIMER_FILE (a fresh one when unset)
  TORCHELASTIC_HEALTH_CHECK_PORT=P  answer GET /healthz (200 while the agent runs its job),
                                    /readyz (the workers run) and --status_port's endpoints
                                    on port P, on --status_host
  TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=S  a worker in D state S seconds fails the job,
                                    with no restart

Exit codes:
  0        all local workers succeeded
  1        workers failed and the restarts are exhausted (the summary names the rank)
  2        usage or configuration error
  3        rendezvous failed, timed out or was closed, or its store was lost mid-run
  4        store or network set-up failed (bind, connect)
  70       internal error (please report)
  75       stopped by the scheduler (under Slurm: scancel, preemption, a --signal
           warning); not a failure, a job script may requeue on it
  128+N    stopped by signal N (forwarded to the workers first; SIGTERM gives 143)
)";
}

// CLI11 prints "Usage: ctorchrun [OPTIONS]"; the script and its arguments
// belong there too.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] [--] SCRIPT [SCRIPT ARGS...]\n";
  }
};

// The application CLI11 parses with: a row's option per row, bound to its
// value in `values`, with the help texts and the footer.
std::unique_ptr<BoundApp> make_app(std::map<std::string, OptionValue>& values) {
  auto b = std::make_unique<BoundApp>(
      "ctorchrun: launch a distributed PyTorch (or C++) job, one agent per node; a drop-in "
      "for torchrun.\n\n"
      "  ctorchrun --nproc_per_node=4 train.py --epochs 10\n"
      "  ctorchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 "
      "--master_port=29500 train.py\n"
      "  ctorchrun --nproc_per_node=4 --max_restarts=3 train.py\n"
      "  ctorchrun --nproc_per_node=4 --no_python ./my_trainer --steps 1000",
      "ctorchrun");
  CLI::App& app = b->app;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto formatter = std::make_shared<UsageFormatter>();
  formatter->column_width(40);
  app.formatter(formatter);
  app.footer(footer() + "\n" + rdzv_conf_help());
  app.set_version_flag("--version", std::string("ctorchrun ") + CTORCHRUN_VERSION);
  for (const OptionRow& r : option_table()) {
    CLI::Option* o = add_row(app, r, values[r.key]);
    o->description(r.env.empty() ? r.help : r.help + " [env: " + r.env.front() + "]");
    b->rows[o] = &r;
    b->in_order.emplace_back(o, &r);
  }
  return b;
}

// argv split the way torchrun's argparse splits it, before CLI11 sees it.
// CLI11 2.1.2 reads "--opt=" as "--opt" and then takes the next argument as
// the value, and it refuses "--"; so the options are rewritten here, each
// value-taking one as a single "--long-name=VALUE".
struct SplitArgs {
  std::vector<std::string> options;            // for CLI11, in order
  std::set<const CLI::Option*> given;          // what the command line set (to an empty value too)
  std::map<std::string, std::string> spelled;  // CLI11's name of an option -> the user's
  std::vector<std::string> script;             // the script and its arguments, untouched
};

// CLI11 names an option by its first name (--nproc-per-node); say it as the
// user wrote it (--nproc_per_node).
std::string as_spelled(std::string message, const std::map<std::string, std::string>& spelled) {
  for (const auto& [canonical, name] : spelled) {
    for (size_t at = message.find(canonical); at != std::string::npos;
         at = message.find(canonical, at)) {
      size_t end = at + canonical.size();
      if (end < message.size() && (std::isalnum(static_cast<unsigned char>(message[end])) ||
                                   message[end] == '-' || message[end] == '_')) {
        at = end;  // a longer name that starts the same way
        continue;
      }
      message.replace(at, canonical.size(), name);
      at += name.size();
    }
  }
  const std::string missing = ": 1 required  missing";  // type names are hidden in --help
  if (auto at = message.find(missing); at != std::string::npos) {
    message.replace(at, missing.size(), ": a value is required");
  }
  return message;
}

// As argparse decides: a separate argument is an option's value unless it
// looks like an option itself (a negative number does not).
bool looks_like_value(const std::string& a) {
  if (a.size() < 2 || a[0] != '-') return true;
  double d = 0;
  auto [end, ec] = std::from_chars(a.data(), a.data() + a.size(), d);
  return ec == std::errc() && end == a.data() + a.size();
}

// Every long option string ("--nproc-per-node", "--nproc_per_node", ...), in
// the order the options were added, each option's spellings in their order.
std::vector<std::string> long_option_strings(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& l : o->get_lnames()) out.push_back("--" + l);
  }
  return out;
}

// torchrun's argparse (allow_abbrev=True, CPython 3.11's _parse_optional and
// _get_option_tuples): a long option that is not an option string is taken
// as a prefix (of the part before '=') of the option strings. One match is
// that option; several are an error listing them, even when they are the two
// spellings of one option (argparse counts option strings, not options, so
// "--nproc" could be --nproc-per-node or --nproc_per_node); none leaves
// `name` unknown. `arg` is the whole argument, as argparse quotes it.
std::string resolve_abbreviation(const CLI::App& app, const std::string& arg,
                                 const std::string& name) {
  std::vector<std::string> matches;
  for (const std::string& s : long_option_strings(app)) {
    if (s.compare(0, name.size(), name) == 0) matches.push_back(s);
  }
  if (matches.size() == 1) return matches.front();
  if (matches.size() > 1) {
    std::string list;
    for (const std::string& m : matches) list += (list.empty() ? "" : ", ") + m;
    throw UsageError("ambiguous option: " + arg + " could match " + list);
  }
  return name;
}

// Options before the script; the first argument that is not one (or the one
// after a first "--") starts the script. A long option may be abbreviated
// (resolve_abbreviation); after the script nothing is. An empty value unsets
// the options in `empty_is_unset` and is an error for the others. The last
// occurrence of an option wins.
SplitArgs split_argv(const BoundApp& bound, int argc, const char* const* argv) {
  const CLI::App& app = bound.app;
  SplitArgs out;
  std::vector<std::pair<const CLI::Option*, std::string>> emitted;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.size() < 2 || a[0] != '-') break;
    const bool is_long = a[1] == '-';
    const auto eq = is_long ? a.find('=') : std::string::npos;
    std::string name = is_long ? a.substr(0, eq) : a.substr(0, 2);
    const CLI::Option* o = app.get_option_no_throw(name);
    std::string as_given = a;  // with an abbreviation written out in full
    if (o == nullptr && is_long) {
      name = resolve_abbreviation(app, a, name);
      o = app.get_option_no_throw(name);
      if (o != nullptr) as_given = name + (eq == std::string::npos ? "" : a.substr(eq));
    }
    if (o != nullptr) out.spelled[o->get_name()] = name;
    if (o == nullptr || o->get_expected_min() == 0) {
      // An unknown option (CLI11 names it) or a flag: CLI11 takes it as is.
      if (o != nullptr) out.given.insert(o);
      emitted.emplace_back(o, as_given);
      continue;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else if (!is_long && a.size() > 2) {
      value = a.substr(a[2] == '=' ? 3 : 2);  // -r3, -r=3 (as argparse reads them)
    } else if (i + 1 < argc && looks_like_value(argv[i + 1])) {
      value = argv[++i];
    } else {
      emitted.emplace_back(o, a);  // CLI11 reports the missing value
      continue;
    }
    out.given.insert(o);
    emitted.erase(
        std::remove_if(emitted.begin(), emitted.end(), [o](const auto& e) { return e.first == o; }),
        emitted.end());
    if (value.empty()) {
      if (bound.rows.at(o)->empty_unsets) continue;
      throw UsageError(name + ": the value is empty; give a value or leave the option out");
    }
    emitted.emplace_back(o, "--" + o->get_lnames().front() + "=" + value);
  }
  out.script.assign(argv + i, argv + argc);
  for (auto& e : emitted) out.options.push_back(e.second);
  return out;
}

// The environment fallbacks, read from `env` (CLI11's envname would read the
// real environment): the first non-empty variable of a row's list applies
// when the command line did not give the option.
void apply_environment(const BoundApp& bound, const SplitArgs& args,
                       const std::map<std::string, std::string>& env,
                       std::map<std::string, OptionValue>* values) {
  for (const auto& [option, r] : bound.in_order) {
    if (args.given.count(option)) continue;
    for (const std::string& name : r->env) {
      auto it = env.find(name);
      if (it == env.end() || it->second.empty()) continue;
      try {
        option->add_result(it->second);
        option->run_callback();
      } catch (const CLI::Error& e) {
        throw UsageError(name + "='" + it->second + "': " + e.what());
      }
      OptionValue& v = (*values)[r->key];
      v.given = true;
      v.env_name = name;
      break;
    }
  }
}

}  // namespace

const OptionValue& ParsedOptions::at(const std::string& key) const {
  auto it = values.find(key);
  if (it == values.end()) {
    throw InternalError("no command-line option '" + key + "' in cli/option_table");
  }
  return it->second;
}

OptionValue& ParsedOptions::at(const std::string& key) {
  return const_cast<OptionValue&>(static_cast<const ParsedOptions&>(*this).at(key));
}

std::string ParsedOptions::source(const std::string& key) const {
  const OptionValue& v = at(key);
  if (!v.spelled.empty()) return v.spelled;
  if (!v.env_name.empty()) return v.env_name;
  const OptionRow& r = option_row(key);
  return r.env.empty() ? r.long_names().front() : r.env.front();
}

std::string ParsedOptions::name(const std::string& key) const {
  const OptionValue& v = at(key);
  return v.spelled.empty() ? option_row(key).long_names().front() : v.spelled;
}

ParsedOptions parse_options(int argc, const char* const* argv,
                            const std::map<std::string, std::string>& env) {
  ParsedOptions out;
  auto bound = make_app(out.values);
  SplitArgs args;
  try {
    args = split_argv(*bound, argc, argv);
    std::vector<std::string> reversed(args.options.rbegin(), args.options.rend());
    bound->app.parse(reversed);  // CLI11 takes them reversed
  } catch (const CLI::CallForHelp&) {
    out.exit_now = true;
    out.exit_message = bound->app.help();
    return out;
  } catch (const CLI::CallForVersion&) {
    out.exit_now = true;
    out.exit_message = std::string("ctorchrun ") + CTORCHRUN_VERSION + "\n";
    return out;
  } catch (const CLI::ParseError& e) {
    throw UsageError(as_spelled(e.what(), args.spelled) + " (see ctorchrun --help)");
  }
  for (const auto& [o, r] : bound->in_order) {
    if (!args.given.count(o)) continue;
    OptionValue& v = out.values[r->key];
    v.given = true;
    auto spelled = args.spelled.find(o->get_name());
    v.spelled = spelled == args.spelled.end() ? r->long_names().front() : spelled->second;
  }
  if (out.values["print_completion"].given) {
    out.exit_now = true;
    out.exit_message = completion_script(out.values["print_completion"].text);
    return out;
  }
  apply_environment(*bound, args, env, &out.values);
  out.script = std::move(args.script);
  return out;
}

std::string help_text() {
  std::map<std::string, OptionValue> values;
  return make_app(values)->app.help();
}

std::string help_footer() { return footer() + "\n" + rdzv_conf_help(); }

}  // namespace ctorchrun::cli
