#include "cli/man_page.h"

#include <sstream>
#include <vector>

#include "cli/option_parser.h"
#include "cli/option_table.h"
#include "common/config.h"

namespace ctorchrun::cli {

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Paragraphs: runs of lines between blank ones.
std::vector<std::vector<std::string>> paragraphs_of(const std::string& text) {
  std::vector<std::vector<std::string>> out(1);
  for (const std::string& line : lines_of(text)) {
    if (line.find_first_not_of(' ') == std::string::npos) {
      if (!out.back().empty()) out.emplace_back();
    } else {
      out.back().push_back(line);
    }
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

std::string header(const std::string& name) {
  std::string upper;
  for (char c : name) upper += static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  return ".TH " + upper + " 1 \"\" \"ctorchrun " + CTORCHRUN_VERSION + "\" \"User Commands\"\n";
}

// A paragraph of --help's prose: filled when every line is flush left,
// kept as laid out (tables, indented lists) otherwise. "Exit codes:" is a
// section of its own.
std::string roff_paragraph(const std::vector<std::string>& lines) {
  bool laid_out = false;
  for (size_t i = 1; i < lines.size(); ++i) laid_out |= lines[i][0] == ' ';
  std::string out = lines.front().rfind("Exit codes:", 0) == 0 ? ".SH \"EXIT STATUS\"\n" : ".PP\n";
  if (laid_out) out += roff_escape(lines.front()) + "\n.nf\n";
  for (size_t i = laid_out ? 1 : 0; i < lines.size(); ++i) out += roff_escape(lines[i]) + "\n";
  if (laid_out) out += ".fi\n";
  return out;
}

// The value an option takes, as the page names it.
std::string value_name(const OptionRow& r) {
  if (r.nproc_check) return "N|cpu|gpu|auto";
  if (r.check_choices) {
    std::string out;
    for (const std::string& c : r.choices) out += (out.empty() ? "" : "|") + c;
    return out;
  }
  switch (r.type) {
    case ValueType::kInteger:
      return "N";
    case ValueType::kSeconds:
      return "SECONDS";
    case ValueType::kIntegerList:
      return "N,...";
    case ValueType::kFlag:
      return "";
    case ValueType::kText:
      break;
  }
  return r.completion == Completion::kFile        ? "FILE"
         : r.completion == Completion::kDirectory ? "DIR"
                                                  : "VALUE";
}

// One row: its spellings in bold, its value in italics, then its help, its
// default, its environment variables and the torchrun that has it.
std::string option_item(const OptionRow& r) {
  std::string names;
  std::vector<std::string> spellings = r.long_names();
  if (!r.short_name().empty()) spellings.insert(spellings.begin(), r.short_name());
  for (const std::string& s : spellings) {
    names += (names.empty() ? "" : ", ") + ("\\fB" + roff_escape(s) + "\\fR");
  }
  const std::string value = value_name(r);
  std::string out = ".TP\n" + names + (value.empty() ? "" : " \\fI" + roff_escape(value) + "\\fR") +
                    "\n" + roff_escape(r.help) + "\n";
  std::string facts;
  if (!r.default_text.empty()) facts += "Default: " + r.default_text + ". ";
  if (!r.env.empty()) {
    std::string env;
    for (const std::string& e : r.env) env += (env.empty() ? "" : ", ") + e;
    facts += "Environment: " + env + ". ";
  }
  facts += r.torchrun.empty() ? "ctorchrun's own." : "As torchrun " + r.torchrun + ".";
  return out + ".br\n" + roff_escape(facts) + "\n";
}

// CLI11's option lines ("  --port INT:INT in [0 - 65535]=29500", the
// description after two spaces or on the lines below, further indented) as
// tagged paragraphs: the option's names in bold, the rest as CLI11 says it.
std::string help_options(const std::string& text) {
  std::string out;
  for (const std::string& line : lines_of(text)) {
    const size_t start = line.find_first_not_of(' ');
    if (start == std::string::npos) continue;
    if (line[start] != '-' || start > 4) {
      out += roff_escape(line.substr(start)) + "\n";
      continue;
    }
    // CLI11 starts descriptions at column 30: a name that fills the column
    // leaves one space before its description, not two.
    constexpr size_t kColumn = 30;
    size_t gap = line.find("  ", start);
    if ((gap == std::string::npos || gap > kColumn) && line.size() > kColumn &&
        line[kColumn - 1] == ' ' && line[kColumn] != ' ')
      gap = kColumn - 1;
    const std::string spec = line.substr(start, gap == std::string::npos ? gap : gap - start);
    const size_t space = spec.find(' ');
    out += ".TP\n\\fB" + roff_escape(spec.substr(0, space)) + "\\fR";
    if (space != std::string::npos) out += " " + roff_escape(spec.substr(space + 1));
    out += "\n";
    const size_t words = gap == std::string::npos ? gap : line.find_first_not_of(' ', gap);
    if (words != std::string::npos) out += roff_escape(line.substr(words)) + "\n";
  }
  return out;
}

}  // namespace

std::string roff_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\\') {
      out += "\\e";
    } else if (c == '-') {
      out += "\\-";
    } else {
      out += c;
    }
    if (c == '\n') out += "\\&";
  }
  if (!out.empty() && (out[0] == '.' || out[0] == '\'')) out = "\\&" + out;
  return out;
}

std::string ctorchrun_man_page() {
  std::string out = header("ctorchrun");
  out +=
      ".SH NAME\nctorchrun \\- launch a distributed PyTorch (or C++) job, one agent per node\n"
      ".SH SYNOPSIS\n\\fBctorchrun\\fR [\\fIOPTIONS\\fR] [\\fB\\-\\-\\fR] \\fISCRIPT\\fR "
      "[\\fISCRIPT ARGS\\fR...]\n"
      ".SH DESCRIPTION\n"
      "A drop\\-in for PyTorch's torchrun: it starts \\fB\\-\\-nproc_per_node\\fR workers on "
      "this node, gives them torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...), "
      "forms the job with the other nodes' agents (static, c10d or etcd rendezvous), "
      "watches the workers and restarts them all when one fails, up to "
      "\\fB\\-\\-max_restarts\\fR times.\n"
      ".SH OPTIONS\n.TP\n\\fB\\-h\\fR, \\fB\\-\\-help\\fR\nprint the options and exit\n"
      ".TP\n\\fB\\-\\-version\\fR\nprint the version and exit\n";
  for (const OptionRow& r : option_table()) out += option_item(r);
  out += ".SH DETAILS\n";
  for (const auto& p : paragraphs_of(help_footer())) out += roff_paragraph(p);
  out +=
      ".SH EXAMPLES\n.nf\n"
      "ctorchrun \\-\\-nproc_per_node=4 train.py \\-\\-epochs 10\n"
      "ctorchrun \\-\\-nnodes=2 \\-\\-node_rank=0 \\-\\-nproc_per_node=8 "
      "\\-\\-master_addr=10.0.0.1 \\-\\-master_port=29500 train.py\n"
      "ctorchrun \\-\\-nproc_per_node=4 \\-\\-no_python ./my_trainer \\-\\-steps 1000\n"
      ".fi\n.SH \"SEE ALSO\"\n\\fBctorch\\-store\\fR(1)\n";
  return out;
}

std::string man_page_from_help(const std::string& name, const std::string& help) {
  const std::vector<std::string> lines = lines_of(help);
  std::string summary = lines.empty() ? name : lines.front();
  if (summary.rfind(name + ": ", 0) == 0) summary = summary.substr(name.size() + 2);
  if (!summary.empty() && summary.back() == '.') summary.pop_back();
  std::string prose, usage, options;
  enum { kProse, kUsage, kOptions } part = kProse;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (line.rfind("Usage: ", 0) == 0) {
      usage = line.substr(7);  // "path/to/name [OPTIONS]": the page says "name [OPTIONS]"
      usage = name + (usage.find(' ') == std::string::npos ? "" : usage.substr(usage.find(' ')));
      part = kUsage;
    } else if (line == "Options:") {
      part = kOptions;
    } else if (part == kOptions) {
      options += line + "\n";
    } else if (part == kProse) {
      prose += line + "\n";
    }
  }
  std::string out = header(name) + ".SH NAME\n" + roff_escape(name) + " \\- " +
                    roff_escape(summary) + "\n.SH SYNOPSIS\n" + roff_escape(usage) +
                    "\n.SH DESCRIPTION\n";
  for (const auto& p : paragraphs_of(prose)) out += roff_paragraph(p);
  return out + ".SH OPTIONS\n" + help_options(options);
}

}  // namespace ctorchrun::cli
