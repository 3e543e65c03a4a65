#pragma once

// Where the system's trusted CA certificates are, for the etcd client's TLS
// when no cacert is given. OpenSSL looks only where it was built to look
// (Debian's /usr/lib/ssl); the portable ctorchrun (the wheel) carries a
// static OpenSSL built on Debian and runs on other distributions too, so
// the usual places of each family are tried in turn, as Go's crypto/x509 and
// curl's configure do.

#include <string>
#include <vector>

namespace ctorchrun::etcd::detail {

struct TrustStore {
  std::string file;  // a PEM bundle ("" when none)
  std::string dir;   // a hashed certificate directory ("" when none)
  bool found() const { return !file.empty() || !dir.empty(); }
};

// The environment's say, as OpenSSL reads it: SSL_CERT_FILE and SSL_CERT_DIR
// ("" when unset).
struct TrustEnv {
  std::string cert_file;
  std::string cert_dir;
};

// The bundles tried, in order: Debian and Ubuntu, Fedora and RHEL, openSUSE,
// OpenELEC, Alpine and the BSDs.
const std::vector<std::string>& trust_bundle_candidates();
// The certificate directories tried, in order.
const std::vector<std::string>& trust_dir_candidates();

// SSL_CERT_FILE and SSL_CERT_DIR when either is set (as given, whether or not
// they exist: OpenSSL's own rule, so that a typo is an error naming the path
// rather than a silent fallback); otherwise the first bundle and
// the first directory of the candidates that exist under `root` ("" is the
// real root; the tests give a fake one), the found paths prefixed with it.
TrustStore find_trust_store(const TrustEnv& env, const std::string& root = "");

// The environment's SSL_CERT_FILE and SSL_CERT_DIR.
TrustEnv trust_env_from_process();

}  // namespace ctorchrun::etcd::detail
