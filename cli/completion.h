#pragma once

// Shell completion scripts for ctorchrun, made from the option table
// (cli/option_table.h): every spelling of every option, the values of the
// options that take one of a few (--rdzv_backend, --nproc_per_node...),
// directories after --log_dir, files after --events_file and for the script.
//   ctorchrun --print-completion bash > ~/.local/share/bash-completion/completions/ctorchrun
//   ctorchrun --print-completion zsh > ~/.zfunc/_ctorchrun   (a directory on $fpath)
//   ctorchrun --print-completion tcsh >> ~/.tcshrc

#include <string>
#include <vector>

namespace ctorchrun::cli {

// The shells there is a script for: bash, zsh, tcsh.
const std::vector<std::string>& completion_shells();

// The script for `shell` (one of completion_shells(); anything else is an
// InternalError: the parser checks the choice first).
std::string completion_script(const std::string& shell);

}  // namespace ctorchrun::cli
