#pragma once

// argv and the environment read through the option table (cli/option_table.h)
// the way torchrun's argparse reads them: both spellings, abbreviations of a
// long option before the script, PET_<NAME> fallbacks, a first "--" before
// the script dropped, the script and its arguments passed through untouched.
// What the values mean is cli/command_line.cc's business.

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorchrun::cli {

// Bad input on the command line or in a PET_ variable: one line, naming the
// option as the user spelled it. The launcher prints it and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One option's value, typed by its row (ValueType): only the member of its
// type is meaningful.
struct OptionValue {
  std::string text;
  int integer = 0;
  double seconds = 0;
  bool flag = false;
  std::vector<int> list;
  bool given = false;    // the command line or an environment variable gave it
  std::string spelled;   // the spelling on the command line ("" when not there)
  std::string env_name;  // the environment variable that gave it ("" when none did)
};

struct ParsedOptions {
  std::map<std::string, OptionValue> values;  // a value for every row, by key
  std::vector<std::string> script;            // the script and its arguments, untouched
  bool exit_now = false;     // --help, --version or --print-completion: print and exit 0
  std::string exit_message;  // what to print then

  // The value of row `key` (a key not in the table is an InternalError).
  const OptionValue& at(const std::string& key) const;
  OptionValue& at(const std::string& key);
  // Where the value came from, as the user wrote it: the spelling on the
  // command line, else the environment variable, else the row's first
  // environment name.
  std::string source(const std::string& key) const;
  // The spelling on the command line, else the row's first long name.
  std::string name(const std::string& key) const;
};

// Parses argv (argv[0] is the program) with `env` as the environment (an empty
// variable counts as unset). Throws UsageError for bad input.
ParsedOptions parse_options(int argc, const char* const* argv,
                            const std::map<std::string, std::string>& env);

// What --help prints: the usage line, every row, the variables read, the exit
// codes and the --rdzv_conf keys.
std::string help_text();

// What --help prints after the options: the script's interpreter, the
// variables read, the exit codes and the --rdzv_conf keys.
std::string help_footer();

}  // namespace ctorchrun::cli
