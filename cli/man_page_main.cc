// ctorchrun-man: the build's generator of the manual pages (not installed).
//   ctorchrun-man ctorchrun                     ctorchrun(1), from the option table
//   ctorch-store --help | ctorchrun-man --from-help ctorch-store
// The page goes to stdout; exit 2 on a usage error.

#include <iostream>
#include <iterator>
#include <string>

#include "cli/man_page.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (argc == 2 && mode == "ctorchrun") {
    std::cout << ctorchrun::cli::ctorchrun_man_page();
    return 0;
  }
  if (argc == 3 && mode == "--from-help") {
    const std::string help{std::istreambuf_iterator<char>(std::cin),
                           std::istreambuf_iterator<char>()};
    std::cout << ctorchrun::cli::man_page_from_help(argv[2], help);
    return 0;
  }
  std::cerr << "usage: ctorchrun-man ctorchrun | ctorchrun-man --from-help NAME < HELP\n";
  return 2;
}
