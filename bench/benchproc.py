"""Process handling shared by the launcher benchmarks (bench/c10d_join_bench.sh,
bench/c10d_loss_bench.sh, bench/etcd_loss_bench.sh), which run inline Python
and import this module with
    sys.path.insert(0, os.path.join(os.getcwd(), "bench")); import benchproc as bp
after cd to the repository root.

Every process a harness starts carries its tag in the environment, so that
whatever is left can be found in /proc, and node n's processes carry
NODE_VAR=n as well (a node's loss kills what carries its mark: workers may sit
in other process groups than their agent's).

  Tag(value, var=TAG_VAR, node_var=NODE_VAR)  a harness's mark; .env(node)
      gives the environment entries. Wherever a tag is taken, a plain string
      s stands for Tag(s).
  Agent(name, cmd, env, log_path, notes=NOTE)  a launcher agent in its own
      session (setsid), its output in a log file; poll() reads the workers'
      START/STEP lines (bench/c10d_join_worker.py) and the lines matching
      notes into .events.
  kill_node(tag, agent, node)  SIGKILL of a node: its agent's group and, by
      pid, everything it started; returns T0 and what survived 2 s.
  stop_all(tag, agents, stop_file)  stop file, SIGTERM, SIGKILL after 15 s;
      returns the pids left.
  end_run(tag, res, agents, stop_file, keep_logs, label)  stop_all, the
      pids left noted in res, the agents' logs kept when asked.
  alternate(launchers, runs, measure, results)  runs with the launchers'
      order alternating, each result printed as JSON.
  end_harness(tag, top)  kill_leftovers, its summary line, top removed.
  kill_leftovers(tag)  SIGKILL to whatever of the harness is still alive
      (pgrep -f rdzv_id=<tag>, and the tag in /proc/*/environ); returns the
      pids.
  exit_on_signals()  SIGTERM/SIGHUP/SIGINT raise SystemExit once, so that
      the harness's finally blocks clean up.
  free_port(), accepts(port)  loopback ports.
  proc_stat, descendants, alive, comm, environ, tagged_pids, restart_count,
  load  /proc reads.
  EtcdCluster(work, n, tag)  n etcd members on 127.0.0.1 (leader, kill, stop).
"""
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time

TAG_VAR = "BENCH_TAG"
NODE_VAR = "BENCH_NODE"
ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"

STEP = re.compile(r"STEP t=([0-9.]+) world=(\d+) rank=(\d+)")
START = re.compile(r"START t=([0-9.]+) world=(\S+) rank=(\S+) pid=(\d+)")
# Launcher log lines about restarts and lost nodes (Agent's default notes).
NOTE = re.compile(r"restart|attempts left|gives way|lost|FAILED|Detected|heartbeat|dead|"
                  r"error|exit|rendezvous complete", re.IGNORECASE)


class Tag:
    """A harness's mark: var=value in the environment of everything it
    starts, and node_var=n in that of node n's processes."""

    def __init__(self, value, var=TAG_VAR, node_var=NODE_VAR):
        self.value, self.var, self.node_var = value, var, node_var

    def __str__(self):
        return self.value

    def env(self, node=None):
        """The environment entries that mark a process (of node, if given)."""
        marks = {self.var: self.value}
        if node is not None:
            marks[self.node_var] = str(node)
        return marks


def as_tag(tag):
    return tag if isinstance(tag, Tag) else Tag(tag)


def exit_on_signals():
    """SIGTERM, SIGHUP and SIGINT raise SystemExit, once: the harness's
    finally blocks then stop what it started, undisturbed by more signals."""
    def on_signal(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # let the cleanup finish
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(f"stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)


def free_port():
    """A port below the ephemeral range that nothing listens on (bind test on
    every IPv4 address, and every IPv6 one where the host has IPv6)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("0.0.0.0", port))
            if socket.has_ipv6:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                    s.bind(("::", port))
            return port
        except OSError:
            continue
    raise SystemExit("no free port found in 200 tries")


def accepts(port):
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def proc_stat(pid):
    """(ppid, state, starttime) from /proc/PID/stat, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19])


def descendants(roots):
    """{pid: starttime} of every live process under the given pids."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st:
                children.setdefault(st[0], []).append((int(name), st[2]))
    found, pending = {}, list(roots)
    while pending:
        for pid, start in children.get(pending.pop(), []):
            if pid not in found:
                found[pid] = start
                pending.append(pid)
    return found


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def alive(pid, start):
    st = proc_stat(pid)
    return st is not None and st[1] != "Z" and st[2] == start


def environ(pid):
    """The environment of a process as a dict, or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    env = {}
    for item in items:
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return env


def tagged_pids(tag, node=None):
    """{pid: starttime} of live processes whose environment carries the tag
    (and, with node, that node's mark)."""
    tag = as_tag(tag)
    pids = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        env = environ(int(name))
        st = proc_stat(int(name))
        if not env or not st or st[1] == "Z" or env.get(tag.var) != tag.value:
            continue
        if node is None or env.get(tag.node_var) == str(node):
            pids[int(name)] = st[2]
    return pids


def restart_count(pid):
    env = environ(pid)
    return None if env is None else env.get("TORCHELASTIC_RESTART_COUNT")


class Agent:
    """One launcher agent in its own session, its output in a log file; the
    log lines matching notes are kept as ("note", line) events."""

    def __init__(self, name, cmd, env, log_path, notes=NOTE):
        self.name, self.log_path, self.notes = name, log_path, notes
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.exit_t = None  # time.time() when poll() first saw it exited
        self.pos, self.partial = 0, b""
        # In log order: ("step", t, world, rank) / ("start", t, world, rank, pid) / ("note", line)
        self.events = []

    def exited(self):
        if self.proc.poll() is not None and self.exit_t is None:
            self.exit_t = time.time()
        return self.proc.returncode is not None

    def poll(self):
        with open(self.log_path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        self.pos += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            m = STEP.search(line)
            if m:
                self.events.append(("step", float(m[1]), int(m[2]), int(m[3])))
                continue
            m = START.search(line)
            if m:
                self.events.append(("start", float(m[1]), m[2], m[3], int(m[4])))
                continue
            if self.notes.search(line):
                self.events.append(("note", line.strip()[:300]))

    def steps(self, world):
        return sum(1 for e in self.events if e[0] == "step" and e[2] == world)

    def first_step(self, world):
        """t of the first STEP line at world, or None."""
        return min((e[1] for e in self.events if e[0] == "step" and e[2] == world), default=None)

    def first_start(self, world):
        """t of the first START line at world, or None."""
        return min((e[1] for e in self.events if e[0] == "start" and e[2] == str(world)),
                   default=None)

    def last_start(self):
        return next((e for e in reversed(self.events) if e[0] == "start"), None)

    def after(self, t0):
        """([START events with t > t0 up to the first STEP after them], that
        STEP event or None), in log order."""
        starts = []
        for e in self.events:
            if e[0] == "start" and e[1] > t0:
                starts.append(e)
            elif starts and e[0] == "step" and e[1] > t0:
                return starts, e
        return starts, None

    def text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def tail(self, n=8):
        return [l[:300] for l in self.text().splitlines()[-n:]]


def kill_node(tag, agent, node):
    """SIGKILL to the agent's process group and, by pid, to every process it
    started (descendants, and whatever carries the node's mark: workers may
    sit in other groups). Returns T0, taken just before the first signal, and
    the pids of the node still alive after 2 s (none expected)."""
    victims = descendants([agent.proc.pid])
    victims.update(tagged_pids(tag, node))
    t0 = time.time()
    try:
        os.killpg(agent.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    end = time.monotonic() + 2.0
    while True:  # again, for anything started while the signals went out, until all are gone
        for pid, start in victims.items():
            if alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        victims = {p: s for p, s in victims.items() if alive(p, s)}
        victims.update(tagged_pids(tag, node))
        if not victims or time.monotonic() > end:
            break
        time.sleep(0.05)
    return t0, [f"{pid} {comm(pid)}" for pid in sorted(victims)]


def wait_gone(live, tree, grace):
    """Waits up to grace seconds for the agents to exit and every process of
    tree (growing with whatever the agents start meanwhile) to end; returns
    the pids still alive."""
    end = time.monotonic() + grace
    while True:
        for a in live:
            a.exited()
        tree.update(descendants([a.proc.pid for a in live if a.proc.returncode is None]))
        left = [p for p, s in tree.items() if alive(p, s)]
        if not left and all(a.proc.returncode is not None for a in live):
            return []
        if time.monotonic() > end:
            return left
        time.sleep(0.05)


def stop_all(tag, agents, stop_file):
    """Stop file, then SIGTERM to each agent's group and, by pid, to every
    descendant and every process carrying a node's mark (not the other tagged
    ones, such as etcd members: their owner stops them); SIGKILL whatever is
    left after 15 s. agents may hold None. Returns the pids still alive."""
    tag = as_tag(tag)
    open(stop_file, "w").close()
    live = [a for a in agents if a is not None]
    tree = descendants([a.proc.pid for a in live])
    tree.update({p: s for p, s in tagged_pids(tag).items()
                 if (environ(p) or {}).get(tag.node_var) is not None})
    for a in live:
        try:
            os.killpg(a.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid, start in tree.items():
        if alive(pid, start):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    left = wait_gone(live, tree, 15.0)
    if left or any(a.proc.returncode is None for a in live):
        for a in (a for a in live if a.proc.returncode is None):
            try:
                os.killpg(a.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = wait_gone(live, tree, 5.0)
    for a in live:
        try:
            a.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            left.append(a.proc.pid)
        a.log.close()
    return left


def end_run(tag, res, agents, stop_file, keep_logs=None, label=""):
    """A run's end: stop_all, the pids left noted in res["left_after_stop"],
    and the agents' logs copied to keep_logs/label when asked."""
    left = stop_all(tag, agents, stop_file)
    if left:
        res["left_after_stop"] = left
    if keep_logs:
        dest = os.path.join(keep_logs, label)
        os.makedirs(dest, exist_ok=True)
        for a in agents:
            if a is not None and os.path.exists(a.log_path):
                shutil.copy(a.log_path, dest)


def alternate(launchers, runs, measure, results):
    """measure(launcher, run) for runs 1..runs, the launchers in order on odd
    runs and reversed on even ones (machine noise hits both alike); each
    result appended to results and printed as one JSON line."""
    order = list(launchers)
    for run in range(1, runs + 1):
        for launcher in (order if run % 2 else order[::-1]):
            r = measure(launcher, run)
            results.append(r)
            print(json.dumps(r), flush=True)


def end_harness(tag, top):
    """The harness's end: kill_leftovers, the line that says what was left,
    and top (the harness's temporary directory) removed. Returns the pids."""
    tag = as_tag(tag)
    orphans = kill_leftovers(tag)
    print(f"# leftover processes after the runs: {orphans if orphans else 'none'} "
          f"(pgrep -f rdzv_id={tag.value} and /proc/*/environ {tag.var})", flush=True)
    shutil.rmtree(top, ignore_errors=True)
    return orphans


def kill_leftovers(tag):
    """SIGKILL to whatever of the harness is still alive: processes whose
    command line holds rdzv_id=<tag> (pgrep -f; agents carry the tag in their
    --rdzv_id) and processes whose environment carries the tag. Returns their
    pids, sorted (none expected)."""
    tag = as_tag(tag)
    pg = subprocess.run(["pgrep", "-f", f"rdzv_id={tag.value}"], capture_output=True,
                        text=True).stdout.split()
    orphans = sorted(set(map(int, pg)) | set(tagged_pids(tag)))
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return orphans


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class EtcdCluster:
    """n members of /usr/bin/etcd on 127.0.0.1, each in its own session, with
    the tests' timings (--heartbeat-interval 50 --election-timeout 500)."""

    def __init__(self, work, n, tag, ready_deadline=60.0):
        self.members, self.endpoints = [], []
        name = f"etb{os.getpid()}x{random.randrange(1 << 30):x}"
        cports = [free_port() for _ in range(n)]
        pports = [free_port() for _ in range(n)]
        initial = ",".join(f"m{i}=http://127.0.0.1:{pports[i]}" for i in range(n))
        env = dict(os.environ, **as_tag(tag).env())
        for i in range(n):
            log = open(os.path.join(work, f"{name}-m{i}.log"), "wb")
            cmd = [ETCD, "--name", f"m{i}", "--data-dir", os.path.join(work, f"{name}-m{i}"),
                   "--listen-client-urls", f"http://127.0.0.1:{cports[i]}",
                   "--advertise-client-urls", f"http://127.0.0.1:{cports[i]}",
                   "--listen-peer-urls", f"http://127.0.0.1:{pports[i]}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{pports[i]}",
                   "--initial-cluster", initial, "--initial-cluster-token", name,
                   "--heartbeat-interval", "50", "--election-timeout", "500"]
            self.members.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                                 stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True))
            log.close()
            self.endpoints.append(f"127.0.0.1:{cports[i]}")
        end = time.monotonic() + ready_deadline
        for _ in range(1000):
            if self.ctl(",".join(self.endpoints), "put", "/bench/ready", "1") is not None:
                return
            if time.monotonic() > end:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the etcd cluster did not start within {ready_deadline:g} s")

    @staticmethod
    def ctl(endpoints, *args, timeout="1s"):
        """etcdctl's stdout, or None when it failed."""
        try:
            r = subprocess.run([ETCDCTL, f"--endpoints={endpoints}", f"--command-timeout={timeout}",
                                *args], env=dict(os.environ, ETCDCTL_API="3"),
                               capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return None
        return r.stdout if r.returncode == 0 else None

    def leader(self, deadline=10.0):
        """The leader's index, asked of each member (etcdctl endpoint status,
        as bench/etcd_bench.sh does); None when none says so in time."""
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            for i, ep in enumerate(self.endpoints):
                if self.members[i].poll() is not None:
                    continue
                out = self.ctl(ep, "endpoint", "status", "-w", "simple")
                if out and len(out.split(", ")) > 4 and out.split(", ")[4].strip() == "true":
                    return i
            time.sleep(0.1)
        return None

    def kill(self, i):
        try:
            os.killpg(self.members[i].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.members[i].wait(timeout=10)

    def stop(self):
        for p in self.members:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.members:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
