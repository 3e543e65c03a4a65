// EtcdClient over TLS against real etcd processes serving https with
// --client-cert-auth ([multiproc]), and the TLS settings it refuses before
// connecting anywhere ([unit]).

#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "etcd/client.h"
#include "etcd/lease_keeper.h"
#include "tests/support/etcd_server.h"
#include "tests/support/temp_dir.h"

namespace ctorchrun::etcd {
namespace {

using namespace std::chrono_literals;
using Catch::Matchers::Contains;
using Clock = std::chrono::steady_clock;
using testing::EtcdCluster;

TEST_CASE("EtcdClient over TLS: put, get, txn, add, watch and leases as over http", "[multiproc]") {
  EtcdCluster cluster(1, 30s, EtcdCluster::Tls::kOn);
  EtcdClient c(cluster.client_endpoints(), 5s, cluster.client_tls());
  CHECK(c.tls());

  CHECK_FALSE(c.get("/tls/a"));
  const auto r1 = c.put("/tls/a", "1");
  const auto a = c.get("/tls/a");
  REQUIRE(a);
  CHECK(a->value == "1");
  CHECK(a->mod_revision == r1);

  const auto ok = c.compare_set("/tls/a", std::string("1"), "2");
  CHECK(ok.succeeded);
  const auto lost = c.compare_set("/tls/a", std::string("1"), "3");
  CHECK_FALSE(lost.succeeded);
  REQUIRE(lost.current);
  CHECK(lost.current->value == "2");
  CHECK(c.add("/tls/n", 5) == 5);
  CHECK(c.add("/tls/n", 2) == 7);

  // A watch streams over its own TLS connection.
  auto w = c.watch("/tls/w/", 0, true);
  c.put("/tls/w/x", "v");
  c.delete_key("/tls/w/x");
  auto e1 = w->next(Clock::now() + 10s);
  auto e2 = w->next(Clock::now() + 10s);
  REQUIRE(e1);
  REQUIRE(e2);
  CHECK(e1->type == WatchEvent::Type::kPut);
  CHECK(e1->kv.value == "v");
  CHECK(e2->type == WatchEvent::Type::kDelete);
  // A wait that times out cancels its read; the TLS stream stays usable.
  for (int i = 0; i < 3; ++i) CHECK_FALSE(w->next(Clock::now() + 100ms));
  c.put("/tls/w/y", "after");
  auto e3 = w->next(Clock::now() + 10s);
  REQUIRE(e3);
  CHECK(e3->kv.key == "/tls/w/y");
  CHECK(e3->kv.value == "after");

  const Lease lease = c.lease_grant(5s);
  c.put("/tls/leased", "x", lease.id);
  CHECK(c.lease_keepalive(lease.id) > 0);
  {
    LeaseKeeper keeper(c, lease, 500ms);
    CHECK(c.get("/tls/leased"));
  }
  CHECK(c.lease_revoke(lease.id));
  CHECK_FALSE(c.get("/tls/leased"));
  CHECK(c.delete_prefix("/tls/") >= 2);
  CHECK(c.member_status(cluster.client_endpoint(0)).leader_id != 0);
}

TEST_CASE("EtcdClient over TLS: any member of three serves, one TLS context for all",
          "[multiproc]") {
  EtcdCluster cluster(3, 30s, EtcdCluster::Tls::kOn);
  EtcdClient c(cluster.client_endpoints(), 10s, cluster.client_tls());
  c.put("/tls3/k", "v");
  cluster.kill(cluster.leader());
  // The remaining two elect a leader; the client moves on to them.
  const auto kv = c.get("/tls3/k");
  REQUIRE(kv);
  CHECK(kv->value == "v");
  c.put("/tls3/k", "w");
  CHECK(c.get("/tls3/k")->value == "w");
}

TEST_CASE("EtcdClient over TLS: a member whose certificate does not verify is refused at once",
          "[multiproc]") {
  EtcdCluster cluster(1, 30s, EtcdCluster::Tls::kOn);
  const auto& certs = cluster.certificates();
  // A read timeout far above how long a refusal takes: the refusal is not
  // retried until the deadline.
  constexpr auto kReadTimeout = 60s;

  // The member's certificate chains to another CA.
  EtcdTls wrong_ca = cluster.client_tls();
  wrong_ca.ca_file = certs.other_ca;
  EtcdClient c(cluster.client_endpoints(), kReadTimeout, wrong_ca);
  auto start = Clock::now();
  try {
    c.get("/k");
    FAIL("a member with an untrusted certificate answered");
  } catch (const TlsError& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Contains(cluster.client_endpoint(0)));
    CHECK_THAT(what, Contains("certificate verify failed"));
    CHECK_THAT(what, Contains("local issuer certificate"));
  }
  CHECK(Clock::now() - start < kReadTimeout / 2);

  // Without a cacert the default trust store is used, which does not know
  // the test CA either.
  EtcdTls system_store = cluster.client_tls();
  system_store.ca_file.clear();
  EtcdClient s(cluster.client_endpoints(), kReadTimeout, system_store);
  start = Clock::now();
  CHECK_THROWS_WITH(s.put("/k", "v"), Contains("certificate verify failed"));
  CHECK(Clock::now() - start < kReadTimeout / 2);

  // The certificate names 127.0.0.1, not "localhost".
  const std::string by_name = "localhost:" + cluster.client_endpoint(0).substr(10);
  EtcdClient n({by_name}, kReadTimeout, cluster.client_tls());
  start = Clock::now();
  CHECK_THROWS_AS(n.get("/k"), TlsError);
  CHECK_THROWS_WITH(n.get("/k"), Contains("hostname mismatch") && Contains(by_name));
  CHECK(Clock::now() - start < kReadTimeout / 2);

  // A watch is refused the same way.
  CHECK_THROWS_AS(c.watch("/k", 0), TlsError);
}

TEST_CASE("EtcdClient over TLS: a member demanding a client certificate refuses a client without",
          "[multiproc]") {
  EtcdCluster cluster(1, 30s, EtcdCluster::Tls::kOn);
  EtcdTls no_cert = cluster.client_tls();
  no_cert.cert_file.clear();
  no_cert.key_file.clear();
  constexpr auto kReadTimeout = 60s;
  EtcdClient c(cluster.client_endpoints(), kReadTimeout, no_cert);
  const auto start = Clock::now();
  try {
    c.put("/k", "v");
    FAIL("a member with --client-cert-auth served a client without a certificate");
  } catch (const TlsError& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Contains(cluster.client_endpoint(0)));
    CHECK_THAT(what, Contains("TLS"));
    CHECK_THAT(what, Contains("certificate"));
  }
  CHECK(Clock::now() - start < kReadTimeout / 2);
}

TEST_CASE("EtcdClient: https against an http member and http against an https member fail",
          "[multiproc]") {
  // Both members close the connection without an answer, as a member that
  // stops might: retried until read_timeout, then an IoError saying so.
  EtcdCluster secure(1, 30s, EtcdCluster::Tls::kOn);
  EtcdClient plain_to_tls(secure.client_endpoints(), 2s);
  CHECK_THROWS_AS(plain_to_tls.get("/k"), IoError);

  EtcdCluster plain(1);
  // The plain member refuses each handshake at once; the last attempt, cut
  // short by the call's deadline on a loaded (sanitised) run, must not hide
  // that.
  EtcdClient tls_to_plain(plain.client_endpoints(), 5s, secure.client_tls());
  CHECK_THROWS_WITH(tls_to_plain.get("/k"), Contains("TLS handshake failed") &&
                                                Contains("does it serve https?") &&
                                                Contains(plain.client_endpoint(0)));
}

TEST_CASE("EtcdClient: TLS files that cannot be read or used are ConfigErrors naming them",
          "[multiproc]") {
  testing::TempDir dir("tls");
  const auto certs = testing::make_test_certificates(dir.path);
  const std::vector<std::string> eps = {"127.0.0.1:1"};
  auto tls = [&](std::string ca, std::string cert, std::string key) {
    EtcdTls t;
    t.enabled = true;
    t.ca_file = std::move(ca);
    t.cert_file = std::move(cert);
    t.key_file = std::move(key);
    return t;
  };
  // Good files load; nothing connects until the first call.
  CHECK_NOTHROW(EtcdClient(eps, 1s, tls(certs.ca, certs.client_cert, certs.client_key)));
  CHECK_NOTHROW(EtcdClient(eps, 1s, tls(certs.ca, "", "")));

  const std::string missing = dir.path + "/no-such-ca.pem";
  CHECK_THROWS_AS(EtcdClient(eps, 1s, tls(missing, "", "")), ConfigError);
  CHECK_THROWS_WITH(EtcdClient(eps, 1s, tls(missing, "", "")),
                    Contains("cacert '" + missing + "'") && Contains("No such file"));

  const std::string garbage = dir.path + "/garbage.pem";
  std::ofstream(garbage) << "not a certificate\n";
  CHECK_THROWS_WITH(EtcdClient(eps, 1s, tls(garbage, "", "")),
                    Contains("cacert '" + garbage + "'"));
  CHECK_THROWS_WITH(EtcdClient(eps, 1s, tls(certs.ca, garbage, certs.client_key)),
                    Contains("cert '" + garbage + "'"));
  CHECK_THROWS_WITH(EtcdClient(eps, 1s, tls(certs.ca, certs.client_cert, garbage)),
                    Contains("key '" + garbage + "'"));
  CHECK_THROWS_WITH(EtcdClient(eps, 1s, tls(certs.ca, certs.client_cert, missing)),
                    Contains("key '" + missing + "'"));
  // A key that is not the certificate's.
  CHECK_THROWS_WITH(EtcdClient(eps, 1s, tls(certs.ca, certs.client_cert, certs.server_key)),
                    Contains("key '" + certs.server_key + "'") && Contains("mismatch"));
  // A certificate without its key, or a key without its certificate.
  CHECK_THROWS_AS(EtcdClient(eps, 1s, tls(certs.ca, certs.client_cert, "")), ConfigError);
  CHECK_THROWS_AS(EtcdClient(eps, 1s, tls(certs.ca, "", certs.client_key)), ConfigError);
  // Files for TLS while TLS is off: a mistake, not silently ignored.
  EtcdTls off = tls(certs.ca, "", "");
  off.enabled = false;
  CHECK_THROWS_AS(EtcdClient(eps, 1s, off), ConfigError);
}

}  // namespace
}  // namespace ctorchrun::etcd
