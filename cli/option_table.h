#pragma once

// ctorchrun's command line as one table: a row per option, from which the
// parser (cli/option_parser.h), --help, --print-completion, the abbreviation
// rules and the README's option list are all derived. Adding torchrun's next
// flag is one row here and its behaviour in cli/command_line.cc.

#include <string>
#include <string_view>
#include <vector>

namespace ctorchrun::cli {

enum class ValueType {
  kText,         // a string, checked by the interpretation (or by `choices`)
  kInteger,      // a whole number in [min, max]
  kSeconds,      // decimal seconds in [0, one year]
  kFlag,         // present or not (PET_<NAME>=1 sets it)
  kIntegerList,  // comma-separated whole numbers in [min, max]
};

// What a shell completes after the option.
enum class Completion { kNothing, kChoices, kFile, kDirectory };

struct OptionRow {
  std::string key;    // the value's name: "nproc_per_node"
  std::string names;  // every spelling, CLI11's form: "--nproc-per-node,--nproc_per_node"
  ValueType type = ValueType::kText;
  std::string default_text;  // the value when nothing gives one, as --help shows it
  std::string help;
  std::vector<std::string> env;      // fallbacks in order; the first is PET_<KEY> (none: no env)
  std::vector<std::string> choices;  // the values completed (and checked when check_choices)
  bool check_choices = false;        // anything else is a usage error naming the choices
  bool nproc_check = false;          // N, cpu, gpu, cuda or auto (--nproc_per_node)
  int min = 0, max = 0;              // kInteger and kIntegerList
  bool empty_unsets = false;         // "--opt=" unsets it; otherwise an empty value is an error
  std::string torchrun;              // the oldest torchrun with it: "1.13", "2.6", "main"; "" ours
  Completion completion = Completion::kNothing;

  // Builders, so that a row reads as one statement.
  OptionRow& with_env(std::string name);
  OptionRow& with_choices(std::vector<std::string> values, bool checked);
  OptionRow& with_range(int lo, int hi);
  OptionRow& counting_workers();  // sets nproc_check
  OptionRow& completing(Completion c);
  OptionRow& unset_by_empty();
  OptionRow& without_env();  // torchrun reads no PET_ variable for it
  OptionRow& since(std::string torchrun_version);

  // The long spellings, "--nproc-per-node" then "--nproc_per_node" (as
  // written in `names`), and the short one ("-m") if any.
  std::vector<std::string> long_names() const;
  std::string short_name() const;
  bool takes_value() const { return type != ValueType::kFlag; }
};

// Every option, in the order --help lists them (CLI11's own -h/--help and
// --version come first and are not rows).
const std::vector<OptionRow>& option_table();

// The row of `key`; a key that is not in the table is a bug (InternalError).
const OptionRow& option_row(std::string_view key);

// The README's option list: a Markdown table with a line per row (spellings,
// environment, default, torchrun's version that has it, meaning).
std::string options_markdown();

}  // namespace ctorchrun::cli
