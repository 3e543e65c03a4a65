#pragma once

// Test helper: a fresh temporary directory, removed with its contents by the
// destructor, so that a test (passing or failing) leaves nothing behind.

#include <string>
#include <vector>

namespace ctorchrun::testing {

class TempDir {
 public:
  // Who may enter the directory.
  enum class Access {
    // mkdtemp's mode 0700, under $TMPDIR (or /tmp when it is unset or empty).
    kOwner,
    // Mode 0755, and under /tmp whatever $TMPDIR says: for a daemon that runs
    // as another user (munged, as 'munge', in the Slurm fixture), which must
    // traverse this directory and every one above it; a private $TMPDIR
    // would stop it.
    kAllUsers,
  };

  // Creates BASE/ctorchrun-TAG-XXXXXX (`tag` names the test for whoever
  // finds one left by a killed run; no '/'). Throws std::runtime_error,
  // naming the path, when it cannot be made.
  explicit TempDir(const std::string& tag = "test", Access access = Access::kOwner);
  // Removes the directory with its contents; errors are ignored.
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // The path of `name` (a file or a relative path) inside the directory.
  std::string file(const std::string& name) const { return path + "/" + name; }

  // The names of what the directory holds now ("." and ".." left out), in
  // no particular order.
  std::vector<std::string> entries() const;

  // The directory's absolute path. A member rather than an accessor: the
  // tests spell it `dir.path` (tests/collectives among them).
  const std::string path;
};

}  // namespace ctorchrun::testing
