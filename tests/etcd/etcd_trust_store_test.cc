// Where the etcd client finds the system's trusted CA certificates when no
// cacert is given (etcd/trust_store.h): SSL_CERT_FILE / SSL_CERT_DIR first,
// then the usual places of each distribution family, under a fake root.

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "etcd/trust_store.h"
#include "tests/support/temp_dir.h"

namespace ctorchrun::etcd::detail {
namespace {

using testing::TempDir;

// Makes `path` (and its parents) under `root`: a directory when it ends in
// '/', else a file.
void make(const std::string& root, const std::string& path) {
  std::string dir = root;
  size_t start = 1;
  for (size_t slash = path.find('/', start); slash != std::string::npos;
       slash = path.find('/', start)) {
    dir = root + path.substr(0, slash);
    ::mkdir(dir.c_str(), 0755);
    start = slash + 1;
  }
  if (path.back() != '/') std::ofstream(root + path) << "-----BEGIN CERTIFICATE-----\n";
}

TEST_CASE("trust store: Debian's bundle and directory come first", "[unit]") {
  TempDir root("trust");
  make(root.path, "/etc/ssl/certs/ca-certificates.crt");
  make(root.path, "/etc/pki/tls/certs/ca-bundle.crt");
  const TrustStore s = find_trust_store({}, root.path);
  CHECK(s.file == root.path + "/etc/ssl/certs/ca-certificates.crt");
  CHECK(s.dir == root.path + "/etc/ssl/certs");
}

TEST_CASE("trust store: each distribution's bundle is found on its own", "[unit]") {
  for (const std::string& bundle : trust_bundle_candidates()) {
    TempDir root("trust");
    make(root.path, bundle);
    const TrustStore s = find_trust_store({}, root.path);
    INFO(bundle);
    CHECK(s.file == root.path + bundle);
    CHECK(s.found());
  }
}

TEST_CASE("trust store: a certificate directory alone is enough", "[unit]") {
  TempDir root("trust");
  make(root.path, "/etc/pki/tls/certs/");
  const TrustStore s = find_trust_store({}, root.path);
  CHECK(s.file.empty());
  CHECK(s.dir == root.path + "/etc/pki/tls/certs");
  CHECK(s.found());
}

TEST_CASE("trust store: SSL_CERT_FILE and SSL_CERT_DIR win, as given", "[unit]") {
  TempDir root("trust");
  make(root.path, "/etc/ssl/certs/ca-certificates.crt");
  TrustStore s = find_trust_store({"/opt/corp/ca.pem", ""}, root.path);
  CHECK(s.file == "/opt/corp/ca.pem");
  CHECK(s.dir.empty());
  s = find_trust_store({"", "/opt/corp/certs"}, root.path);
  CHECK(s.file.empty());
  CHECK(s.dir == "/opt/corp/certs");
}

TEST_CASE("trust store: nothing found on a system without certificates", "[unit]") {
  TempDir root("trust");
  make(root.path, "/etc/ssl/");
  const TrustStore s = find_trust_store({}, root.path);
  CHECK_FALSE(s.found());
}

}  // namespace
}  // namespace ctorchrun::etcd::detail
