#include "cli/completion.h"

#include "cli/option_table.h"
#include "common/error.h"

namespace ctorchrun::cli {

namespace {

// Every spelling of a row, short one first.
std::vector<std::string> spellings(const OptionRow& r) {
  std::vector<std::string> out;
  if (!r.short_name().empty()) out.push_back(r.short_name());
  for (const std::string& n : r.long_names()) out.push_back(n);
  return out;
}

std::string joined(const std::vector<std::string>& words, const std::string& sep) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : sep) + w;
  return out;
}

// What bash completes after a row's option, as a compgen argument list.
std::string bash_values(const OptionRow& r) {
  switch (r.completion) {
    case Completion::kChoices:
      return "-W '" + joined(r.choices, " ") + "'";
    case Completion::kDirectory:
      return "-d";
    case Completion::kFile:
      return "-f";
    case Completion::kNothing:
      break;
  }
  return "";
}

std::string bash_script() {
  std::vector<std::string> options = {"-h", "--help", "--version"}, valued;
  std::string cases;
  for (const OptionRow& r : option_table()) {
    for (const std::string& s : spellings(r)) options.push_back(s);
    if (!r.takes_value()) continue;
    for (const std::string& s : spellings(r)) valued.push_back(s);
    const std::string values = bash_values(r);
    cases +=
        "    " + joined(spellings(r), "|") + ")\n      " +
        (values.empty() ? "COMPREPLY=()" : "COMPREPLY=($(compgen " + values + " -- \"$cur\"))") +
        "\n      return ;;\n";
  }
  return R"(# bash completion for ctorchrun (from `ctorchrun --print-completion bash`)
_ctorchrun() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} i=1 word
  local valued=' )" +
         joined(valued, " ") + R"( '
  [ "$cur" = "=" ] && cur=
  # Once the script is given, the rest are its arguments: files.
  while [ "$i" -lt "$COMP_CWORD" ]; do
    word=${COMP_WORDS[i]}
    if [ "${COMP_WORDS[i+1]}" = "=" ]; then
      i=$((i + 3))
    elif [ "$word" = "--" ]; then
      COMPREPLY=($(compgen -f -- "$cur"))
      return
    elif [[ $word != -* ]]; then
      COMPREPLY=($(compgen -f -- "$cur"))
      return
    elif [[ $valued == *" $word "* ]]; then
      i=$((i + 2))
    else
      i=$((i + 1))
    fi
  done
  if [ "$prev" = "=" ] && [ "$COMP_CWORD" -ge 2 ]; then prev=${COMP_WORDS[COMP_CWORD-2]}; fi
  case "$prev" in
)" + cases +
         R"(  esac
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W ')" +
         joined(options, " ") + R"(' -- "$cur"))
    return
  fi
  COMPREPLY=($(compgen -f -- "$cur"))
}
complete -o filenames -F _ctorchrun ctorchrun
)";
}

// A help text as a zsh description: its first clause, without the
// characters that _arguments or the single quotes around it would read.
std::string zsh_description(const std::string& help) {
  std::string out;
  for (char c : help.substr(0, help.find_first_of(";(:"))) {
    if (c == '[' || c == ']' || c == '\'' || c == '\\' || c == '`' || c == '$') continue;
    out += c;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

std::string zsh_action(const OptionRow& r) {
  switch (r.completion) {
    case Completion::kChoices:
      return ":value:(" + joined(r.choices, " ") + ")";
    case Completion::kDirectory:
      return ":directory:_files -/";
    case Completion::kFile:
      return ":file:_files";
    case Completion::kNothing:
      break;
  }
  return ":value: ";
}

std::string zsh_script() {
  std::string specs;
  for (const OptionRow& r : option_table()) {
    std::vector<std::string> forms;
    for (const std::string& s : spellings(r)) {
      forms.push_back(s + (!r.takes_value() ? "" : s.size() == 2 ? "+" : "="));
    }
    const std::string exclusion = "'(" + joined(spellings(r), " ") + ")'";
    const std::string names = forms.size() == 1 ? forms.front() : "{" + joined(forms, ",") + "}";
    specs += "    " + exclusion + names + "'[" + zsh_description(r.help) + "]" +
             (r.takes_value() ? zsh_action(r) : "") + "' \\\n";
  }
  return R"(#compdef ctorchrun
# zsh completion for ctorchrun (from `ctorchrun --print-completion zsh`)
_ctorchrun() {
  _arguments -S \
    '(- *)'{-h,--help}'[print the help and exit]' \
    '(- *)--version[print the version and exit]' \
)" + specs +
         R"(    '1:script:_files' \
    '*::script argument:_files'
}
if [ "${funcstack[1]}" = _ctorchrun ]; then
  _ctorchrun "$@"
else
  compdef _ctorchrun ctorchrun
fi
)";
}

std::string tcsh_script() {
  std::vector<std::string> longs = {"help", "version"}, shorts = {"h"};
  std::string values;
  for (const OptionRow& r : option_table()) {
    for (const std::string& n : r.long_names()) longs.push_back(n.substr(2));
    if (!r.short_name().empty()) shorts.push_back(r.short_name().substr(1));
    if (!r.takes_value()) continue;
    std::string what = r.completion == Completion::kChoices     ? "(" + joined(r.choices, " ") + ")"
                       : r.completion == Completion::kDirectory ? "d"
                       : r.completion == Completion::kFile      ? "f"
                                                                : "x:<value>";
    for (const std::string& s : spellings(r)) {
      values += " \\\n  'n/" + s + "/" + what + "/'";
      if (s.size() > 2) values += " 'c/" + s + "=/" + what + "/'";
    }
  }
  return "# tcsh completion for ctorchrun (from `ctorchrun --print-completion tcsh`)\n"
         "complete ctorchrun \\\n  'c/--/(" +
         joined(longs, " ") + ")/' \\\n  'c/-/(" + joined(shorts, " ") + ")/'" + values +
         " \\\n  'p/*/f/'\n";
}

}  // namespace

const std::vector<std::string>& completion_shells() {
  static const std::vector<std::string> shells = {"bash", "zsh", "tcsh"};
  return shells;
}

std::string completion_script(const std::string& shell) {
  if (shell == "bash") return bash_script();
  if (shell == "zsh") return zsh_script();
  if (shell == "tcsh") return tcsh_script();
  throw InternalError("no completion script for shell '" + shell + "'");
}

}  // namespace ctorchrun::cli
