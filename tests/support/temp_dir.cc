#include "tests/support/temp_dir.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>

namespace ctorchrun::testing {

namespace {

std::string make_dir(const std::string& tag, TempDir::Access access) {
  std::string base = "/tmp";
  if (access == TempDir::Access::kOwner) {
    const char* tmpdir = std::getenv("TMPDIR");
    if (tmpdir != nullptr && *tmpdir != '\0') base = tmpdir;
  }
  std::string templ = base + "/ctorchrun-" + tag + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    throw std::runtime_error("mkdtemp " + templ + ": " + std::strerror(errno));
  }
  if (access == TempDir::Access::kAllUsers && ::chmod(templ.c_str(), 0755) != 0) {
    const std::string why = std::strerror(errno);
    std::error_code ec;
    std::filesystem::remove_all(templ, ec);
    throw std::runtime_error("chmod 0755 " + templ + ": " + why);
  }
  return templ;
}

}  // namespace

TempDir::TempDir(const std::string& tag, Access access) : path(make_dir(tag, access)) {}

std::vector<std::string> TempDir::entries() const {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
    names.push_back(entry.path().filename().string());
  }
  return names;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

}  // namespace ctorchrun::testing
