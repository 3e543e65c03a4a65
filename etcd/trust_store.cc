#include "etcd/trust_store.h"

#include <sys/stat.h>

#include <cstdlib>

namespace ctorchrun::etcd::detail {

namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

const std::vector<std::string>& trust_bundle_candidates() {
  static const std::vector<std::string> files = {
      "/etc/ssl/certs/ca-certificates.crt",                 // Debian, Ubuntu, Gentoo, Arch
      "/etc/pki/tls/certs/ca-bundle.crt",                   // Fedora, RHEL
      "/etc/ssl/ca-bundle.pem",                             // openSUSE
      "/etc/pki/tls/cacert.pem",                            // OpenELEC
      "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",  // CentOS, RHEL 7+
      "/etc/ssl/cert.pem",                                  // Alpine, the BSDs, macOS
  };
  return files;
}

const std::vector<std::string>& trust_dir_candidates() {
  static const std::vector<std::string> dirs = {
      "/etc/ssl/certs",                // Debian, Ubuntu, SLES
      "/etc/pki/tls/certs",            // Fedora, RHEL
      "/usr/lib/ssl/certs",            // Debian's OpenSSL default
      "/system/etc/security/cacerts",  // Android
  };
  return dirs;
}

TrustStore find_trust_store(const TrustEnv& env, const std::string& root) {
  TrustStore out;
  if (!env.cert_file.empty() || !env.cert_dir.empty()) {
    out.file = env.cert_file;
    out.dir = env.cert_dir;
    return out;
  }
  for (const std::string& f : trust_bundle_candidates()) {
    if (is_file(root + f)) {
      out.file = root + f;
      break;
    }
  }
  for (const std::string& d : trust_dir_candidates()) {
    if (is_dir(root + d)) {
      out.dir = root + d;
      break;
    }
  }
  return out;
}

TrustEnv trust_env_from_process() {
  // OpenSSL's set_default_verify_paths() reads these two itself; this is the
  // same reading, done here so that the fallbacks apply after it.
  TrustEnv env;
  if (const char* v = std::getenv("SSL_CERT_FILE")) env.cert_file = v;
  if (const char* v = std::getenv("SSL_CERT_DIR")) env.cert_dir = v;
  return env;
}

}  // namespace ctorchrun::etcd::detail
