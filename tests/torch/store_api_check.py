#!/usr/bin/env python3
"""Exercise every torch 1.13 Python TCPStore API against a running store server.

Usage: /usr/bin/python3 store_api_check.py --host 127.0.0.1 --port P

The server (ctorch-store, the reference ref_server.py or torch's own server)
must already listen on host:port. Every client here is a pure client:
TCPStore(host, port, world_size=None, is_master=False, timeout) sends no
`ADD init/` and waits for nobody. All keys carry a per-run tag, so the script
can be run repeatedly against one long-lived server.

Prints `ok <name>` / `FAIL <name>: <detail>` per check and a final
`N passed, M failed`; exits 0 only if every check passed. A watchdog thread
(torch releases the GIL in store calls) ends the run after WATCHDOG_S seconds
even if the server hangs.

Against torch 1.13's own server (torch_store_server.py) exactly one check is
expected to fail: client_usable_after_wait_timeout, the stale STOP_WAITING
hazard of the 1.13 server (spec §4.6, §10 item 10).

Hidden modes (used by the script itself to get separate client processes):
  --child-adder TAG   wait for TAG/go, then add(TAG/ctr, 1) ADDS_PER_CHILD times
  --child-waiter KEY  print "waiting", then block in wait([KEY])
"""
import argparse
import datetime
import os
import select
import signal
import subprocess
import sys
import threading
import time

WATCHDOG_S = 55          # whole run, parent process
CHILD_WATCHDOG_S = 45    # any helper child process
ADDER_CHILDREN = 16
ADDS_PER_CHILD = 50

CHILDREN = []            # Popen objects still to be reaped, killed by the watchdog


def td(seconds):
    return datetime.timedelta(seconds=seconds)


class CheckFailed(Exception):
    pass


def expect(cond, detail):
    if not cond:
        raise CheckFailed(detail)


def expect_eq(got, want, what):
    expect(got == want, f"{what}: got {short(got)}, want {short(want)}")


def short(v):
    r = repr(v)
    return r if len(r) <= 80 else f"{r[:60]}... ({len(r)} chars)"


class Checker:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def run(self, name, fn):
        try:
            fn()
        except Exception as e:  # any exception is a failed check, with its text
            self.failed += 1
            detail = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
            print(f"FAIL {name}: {detail}", flush=True)
            return False
        self.passed += 1
        print(f"ok {name}", flush=True)
        return True

    def summary(self):
        print(f"{self.passed} passed, {self.failed} failed", flush=True)
        return 0 if self.failed == 0 else 1


def start_watchdog(seconds, on_fire):
    t = threading.Timer(seconds, on_fire)
    t.daemon = True
    t.start()


class ForkedChild:
    """A child forked from this process (torch already imported: on a loaded
    2-core machine 16 fresh interpreters importing torch outlast the test's
    bounds). Enough of Popen's interface for wait_proc and kill_children."""

    def __init__(self, fn):
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            rc = 3
            try:
                start_watchdog(CHILD_WATCHDOG_S, lambda: os._exit(3))
                rc = fn()
            finally:
                os._exit(rc)
        CHILDREN.append(self)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def kill_children():
    for p in CHILDREN:
        if p.poll() is None:
            p.kill()


class Suite:
    def __init__(self, host, port, checker):
        import torch.distributed as dist
        self.dist = dist
        self.host, self.port = host, port
        self.tag = f"sac{os.getpid()}_{int(time.time() * 1000)}"
        self.c = checker
        self.s = None                 # shared client for the simple checks
        self.timed_out_client = None  # set by wait_timeout

    def k(self, name):
        return f"{self.tag}/{name}"

    def client(self, timeout_s=5.0):
        return self.dist.TCPStore(self.host, self.port, None, False, td(timeout_s))

    def spawn(self, *extra, **kw):
        cmd = [sys.executable, os.path.abspath(__file__),
               "--host", self.host, "--port", str(self.port), *extra]
        p = subprocess.Popen(cmd, **kw)
        CHILDREN.append(p)
        return p

    # -- checks -----------------------------------------------------------------
    def connect(self):
        self.s = self.client()
        n = self.s.num_keys()
        expect(isinstance(n, int) and n >= 0, f"num_keys() = {n!r}")

    def set_get(self):
        self.s.set(self.k("a"), "hello")
        expect_eq(self.s.get(self.k("a")), b"hello", "get")

    def overwrite(self):
        self.s.set(self.k("ow"), "v1")
        self.s.set(self.k("ow"), "second value")
        expect_eq(self.s.get(self.k("ow")), b"second value", "get after overwrite")

    def empty_value(self):
        self.s.set(self.k("empty"), "")
        expect_eq(self.s.get(self.k("empty")), b"", "get")

    def binary_value(self):
        v = bytes(range(256)) + bytes(range(255, -1, -1))  # NUL inside and at both ends
        self.s.set(self.k("bin"), v)
        expect_eq(self.s.get(self.k("bin")), v, "get")

    def long_key(self):
        key = self.k("long_") + "x" * 4000
        self.s.set(key, "lk")
        expect_eq(self.s.get(key), b"lk", "get")

    def unicode_key(self):
        key = self.k("ключ-鍵-🔑")
        self.s.set(key, "значение")
        expect_eq(self.s.get(key), "значение".encode(), "get")

    def long_value(self):
        v = bytes(range(256)) * (4 * 1024 * 1024 // 256)  # 4 MiB
        self.s.set(self.k("big"), v)
        got = self.s.get(self.k("big"))
        expect(got == v, f"4 MiB value differs (got {len(got)} bytes)")

    def add_missing(self):
        expect_eq(self.s.add(self.k("n1"), 3), 3, "add on missing key")
        expect_eq(self.s.get(self.k("n1")), b"3", "stored as decimal text")

    def add_negative(self):
        expect_eq(self.s.add(self.k("n1"), -5), -2, "add -5 to 3")
        expect_eq(self.s.get(self.k("n1")), b"-2", "stored as decimal text")

    def add_zero_reads(self):
        expect_eq(self.s.add(self.k("n1"), 0), -2, "add 0")
        expect_eq(self.s.get(self.k("n1")), b"-2", "value unchanged")

    def add_on_string(self):
        self.s.set(self.k("n2"), "12")
        expect_eq(self.s.add(self.k("n2"), 5), 17, "add 5 to '12'")
        expect_eq(self.s.get(self.k("n2")), b"17", "stored as decimal text")

    # compare_set, spec §4.3
    def cas_missing_empty_expected(self):
        expect_eq(self.s.compare_set(self.k("c1"), "", "new"), b"new", "reply")
        expect_eq(self.s.get(self.k("c1")), b"new", "key created")

    def cas_missing_nonempty_expected(self):
        expect_eq(self.s.compare_set(self.k("c2"), "exp", "new"), b"exp", "reply")
        # delete_key reports whether the key existed, without waiting on it
        expect_eq(self.s.delete_key(self.k("c2")), False, "key must not exist")

    def cas_present_equal(self):
        self.s.set(self.k("c3"), "old")
        expect_eq(self.s.compare_set(self.k("c3"), "old", "new"), b"new", "reply")
        expect_eq(self.s.get(self.k("c3")), b"new", "value swapped")

    def cas_present_different(self):
        self.s.set(self.k("c4"), "cur")
        expect_eq(self.s.compare_set(self.k("c4"), "other", "new"), b"cur", "reply")
        expect_eq(self.s.get(self.k("c4")), b"cur", "value unchanged")

    def delete_key(self):
        self.s.set(self.k("del"), "x")
        expect_eq(self.s.delete_key(self.k("del")), True, "first delete")
        expect_eq(self.s.delete_key(self.k("del")), False, "second delete")

    def num_keys(self):
        # Deltas only: other tenants' keys (init/, agents, earlier runs) count too.
        n0 = self.s.num_keys()
        for i in range(3):
            self.s.set(self.k(f"nk{i}"), "v")
        expect_eq(self.s.num_keys() - n0, 3, "delta after 3 new keys")
        self.s.set(self.k("nk0"), "again")
        expect_eq(self.s.num_keys() - n0, 3, "delta after an overwrite")
        self.s.delete_key(self.k("nk1"))
        expect_eq(self.s.num_keys() - n0, 2, "delta after a delete")
        self.s.delete_key(self.k("nk1"))
        expect_eq(self.s.num_keys() - n0, 2, "delta after deleting a missing key")

    def wait_existing(self):
        self.s.set(self.k("w1"), "1")
        self.s.set(self.k("w2"), "2")
        t0 = time.monotonic()
        self.s.wait([self.k("w1"), self.k("w2")], td(5))
        self.s.wait([self.k("w1")])          # overload using the store timeout
        self.s.wait([])                      # zero keys: immediate STOP_WAITING
        dt = time.monotonic() - t0
        expect(dt < 1.0, f"waits on existing keys took {dt:.2f}s")

    def timed_wait(self, call):
        """Run call(), which must time out (1.13: RuntimeError) within 0.25..5 s."""
        t0 = time.monotonic()
        try:
            call()
        except RuntimeError:
            dt = time.monotonic() - t0
            expect(0.25 <= dt < 5.0, f"timed out after {dt:.2f}s, want 0.25..5")
            return
        raise CheckFailed("returned instead of raising a timeout")

    def wait_timeout(self):
        # wait() on a missing key times out client-side (1.13 sends no cancel).
        a = self.client(timeout_s=3)
        self.timed_wait(lambda: a.wait([self.k("late")], td(0.3)))
        self.timed_out_client = a

    def reuse_after_wait_timeout(self):
        # Stale-WAIT hazard (spec §4.6): the server still holds the WAIT of the
        # client that timed out. Its next request proves it gave up, so the
        # server must drop that WAIT rather than answer it when another client
        # later sets the key; a stray STOP_WAITING byte would desynchronise all
        # later replies. (Were the key set before the client sends anything,
        # the byte would already be on its way and no server could help, so
        # the client writes first here.)
        a = self.timed_out_client
        expect(a is not None, "no timed-out client (previous check failed)")
        a.set(self.k("y"), "hello")
        self.client().set(self.k("late"), "1")
        time.sleep(0.3)  # let a stray STOP_WAITING arrive, if one is sent
        expect_eq(a.get(self.k("y")), b"hello", "get(y) on the timed-out client")
        expect_eq(a.add(self.k("y_ctr"), 7), 7, "add on the timed-out client")
        expect(a.num_keys() > 0, "num_keys on the timed-out client")

    def get_timeout(self):
        a = self.client()
        a.set_timeout(td(0.3))
        self.timed_wait(lambda: a.get(self.k("never_get")))

    def wait_released_by_other(self):
        a, b = self.client(timeout_s=10), self.client()
        key = self.k("rel")
        setter = threading.Timer(0.5, lambda: b.set(key, "go"))
        setter.start()
        t0 = time.monotonic()
        try:
            a.wait([key], td(10))
        finally:
            setter.join(5)
        dt = time.monotonic() - t0
        expect(0.4 <= dt < 5.0, f"released after {dt:.2f}s, want 0.4..5")
        expect_eq(a.get(key), b"go", "value seen by the waiter")

    def prefix_store(self):
        pfx = self.k("pfx")
        ps = self.dist.PrefixStore(pfx, self.s)
        ps.set("a", "pv")
        expect_eq(self.s.get(pfx + "/a"), b"pv", "raw key pfx/a")
        expect_eq(ps.get("a"), b"pv", "through the PrefixStore")

    def concurrent_adds(self):
        ready, go, ctr = self.k("ready"), self.k("go"), self.k("ctr")
        procs = [ForkedChild(lambda: child_adder(self.host, self.port, self.tag))
                 for _ in range(ADDER_CHILDREN)]
        # Release all adders together once every child is connected.
        deadline = time.monotonic() + 30
        while self.s.add(ready, 0) < ADDER_CHILDREN and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        self.s.set(go, "1")
        rcs = [wait_proc(p, deadline - time.monotonic() + 10) for p in procs]
        expect(all(rc == 0 for rc in rcs), f"adder exit codes {rcs}")
        want = ADDER_CHILDREN * ADDS_PER_CHILD
        expect_eq(self.s.add(ctr, 0), want, "counter")

    def dead_waiter_killed(self):
        p = self.spawn("--child-waiter", self.k("never"), stdout=subprocess.PIPE, text=True)
        r, _, _ = select.select([p.stdout], [], [], 20)
        expect(bool(r) and p.stdout.readline().strip() == "waiting",
               "waiter child did not start")
        time.sleep(0.5)  # the WAIT request is on the wire by now
        expect(p.poll() is None, f"waiter exited early with {p.returncode}")
        p.send_signal(signal.SIGKILL)
        expect_eq(wait_proc(p, 5), -signal.SIGKILL, "waiter exit status")
        p.stdout.close()
        time.sleep(0.2)  # let the server notice the closed connection

    def round_trip_fresh_client(self, name):
        c = self.client()
        c.set(self.k(name), name)
        expect_eq(c.get(self.k(name)), name.encode(), f"{name} round trip")

    def dead_waiter_server_serves(self):
        self.round_trip_fresh_client("after_kill")

    def dead_waiter_key_set(self):
        self.client().set(self.k("never"), "finally")
        time.sleep(0.2)
        self.round_trip_fresh_client("after_never")
        expect_eq(self.s.get(self.k("never")), b"finally", "value of the dead waiter's key")

    def all(self):
        if not self.c.run("connect", self.connect):
            return  # nothing else can work; do not spend the watchdog on it
        run = self.c.run
        run("set_get", self.set_get)
        run("overwrite", self.overwrite)
        run("empty_value", self.empty_value)
        run("binary_value_all_bytes", self.binary_value)
        run("long_key_4000", self.long_key)
        run("unicode_key", self.unicode_key)
        run("long_value_4MiB", self.long_value)
        run("add_missing_key", self.add_missing)
        run("add_negative", self.add_negative)
        run("add_zero_reads", self.add_zero_reads)
        run("add_on_string_12", self.add_on_string)
        run("compare_set_missing_empty_expected_creates", self.cas_missing_empty_expected)
        run("compare_set_missing_nonempty_expected_stores_nothing",
            self.cas_missing_nonempty_expected)
        run("compare_set_present_equal_swaps", self.cas_present_equal)
        run("compare_set_present_different_returns_current", self.cas_present_different)
        run("delete_key_true_then_false", self.delete_key)
        run("num_keys_deltas", self.num_keys)
        run("wait_existing_keys_immediate", self.wait_existing)
        run("wait_timeout_missing_key", self.wait_timeout)
        run("client_usable_after_wait_timeout", self.reuse_after_wait_timeout)
        run("get_timeout_missing_key", self.get_timeout)
        run("wait_released_by_other_client", self.wait_released_by_other)
        run("prefix_store_visible_raw", self.prefix_store)
        run(f"concurrent_add_{ADDER_CHILDREN}x{ADDS_PER_CHILD}", self.concurrent_adds)
        run("dead_waiter_killed", self.dead_waiter_killed)
        run("dead_waiter_server_still_serves", self.dead_waiter_server_serves)
        run("dead_waiter_key_set_afterwards", self.dead_waiter_key_set)


def wait_proc(p, timeout):
    try:
        return p.wait(max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "timeout"


def child_adder(host, port, tag):
    import torch.distributed as dist
    s = dist.TCPStore(host, port, None, False, td(30))
    s.add(f"{tag}/ready", 1)
    s.wait([f"{tag}/go"], td(35))
    for _ in range(ADDS_PER_CHILD):
        s.add(f"{tag}/ctr", 1)
    return 0


def child_waiter(host, port, key):
    import torch.distributed as dist
    s = dist.TCPStore(host, port, None, False, td(60))
    print("waiting", flush=True)
    s.wait([key], td(60))  # never returns: the parent SIGKILLs this process
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--child-adder", metavar="TAG", help=argparse.SUPPRESS)
    ap.add_argument("--child-waiter", metavar="KEY", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child_adder or a.child_waiter:
        start_watchdog(CHILD_WATCHDOG_S, lambda: os._exit(3))
        if a.child_adder:
            return child_adder(a.host, a.port, a.child_adder)
        return child_waiter(a.host, a.port, a.child_waiter)

    checker = Checker()

    def fire():
        print(f"FAIL watchdog: run exceeded {WATCHDOG_S}s (server hung?)", flush=True)
        kill_children()
        print(f"{checker.passed} passed, {checker.failed + 1} failed", flush=True)
        os._exit(1)

    start_watchdog(WATCHDOG_S, fire)
    try:
        Suite(a.host, a.port, checker).all()
    finally:
        kill_children()
    return checker.summary()


if __name__ == "__main__":
    sys.exit(main())
