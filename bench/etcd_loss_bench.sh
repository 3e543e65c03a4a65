#!/usr/bin/env bash
# Loss benchmarks of the etcd-v3 rendezvous, on loopback, against real etcd
# (Debian's /usr/bin/etcd 3.4, 3 members, --heartbeat-interval 50
# --election-timeout 500 as in the tests):
#
#   bench/etcd_loss_bench.sh [--runs N] [--only host-loss|leader-loss]
#                            [--ctorchrun PATH] [--torchrun PATH] [--failover-bench PATH]
#                            [--conf RDZV_CONF] [--client-read-timeout-ms MS]
#                            [--deadline S] [--startup-deadline S]
#                            [--keep-logs DIR]
#
# 1. host-loss: the node hosting the workers' store is lost. Three agents
#      ctorchrun --redirects 9:1 --tee 9:1 --monitor_interval 0.1 --nnodes=2:3
#        --nproc_per_node=1 --rdzv_backend=etcd-v3 --rdzv_endpoint=<3 members>
#        --rdzv_id=X --rdzv_conf=<--conf> --max_restarts=5 bench/c10d_join_worker.py
#    (--conf default keep_alive_interval=1,read_timeout=5,last_call_timeout=1),
#    each in its own session, torch workers on /usr/bin/python3. Under etcd-v3
#    the workers' store (MASTER_ADDR:MASTER_PORT) is hosted by the agent of
#    group rank 0: the harness reads GROUP_RANK, MASTER_ADDR and MASTER_PORT
#    from each worker's /proc/PID/environ (the pid is on its START line) and
#    checks that the rank-0 agent's process tree listens on MASTER_PORT. When
#    all three workers have stepped 3 times at world=3 the harness records
#    T0 = time.time() and SIGKILLs that agent's process group and, by pid,
#    everything it started (as bench/c10d_loss_bench.sh does). Measured, on
#    the one host clock: each survivor's first STEP line after a START line
#    with t > T0 (a new worker), minus T0 (the run's figure is the later of
#    the two: the world stepping again); the world it reports; the survivors'
#    TORCHELASTIC_RESTART_COUNT before -> after (a restart charged or not).
#    The peer is torchrun (torch 1.13) with --rdzv_backend=c10d on
#    --rdzv_endpoint=127.0.0.1:P, same flags and conf, the endpoint's agent
#    started first; the agent killed is that one (it hosts the c10d store).
#    torchrun's survivors are expected to end: recorded are the time from T0
#    to each survivor's exit and its exit code (or a new step, if any).
#    Launchers alternate per run.
# 2. leader-loss: the etcd leader (found with etcdctl endpoint status, as
#    bench/etcd_bench.sh does) is SIGKILLed
#    a) under build/bin/ctorch-etcd-failover-bench (bench/etcd_failover_bench.cc:
#       one EtcdStore set() every 20 ms, read timeout 2 s by default
#       (--client-read-timeout-ms), the leader first in its endpoint list so
#       that the loss hits the member it talks to): the time from the kill to
#       the end of its first successful write started after the kill, and the
#       writes that failed;
#    b) the peer of a): etcdctl put (etcd's Go client, one process per
#       attempt), the same members in the same order, --command-timeout=2s,
#       attempt after attempt from the kill: the time to its first success;
#    c) under a ctorchrun job on etcd-v3 (two agents, --nnodes=2:2, the same
#       flags, torch workers stepping): watched for 8 s after the kill (longer
#       than an election and the 3 s liveness bound): workers started anew,
#       restarts charged (TORCHELASTIC_RESTART_COUNT), the longest gap between
#       two STEP lines around the kill, and the agents' log lines about it.
#    A fresh cluster for each.
# A run has --deadline seconds (default 60) from T0; a run without its
# result by then is reported as a timeout and left out of the median (each
# run is printed). Everything is stopped (stop file, SIGTERM to groups and
# descendants, SIGKILL after 15 s; etcd members SIGTERM then SIGKILL) and
# the harness checks with pgrep and /proc/*/environ that none of its
# processes is left (exit 1 if any was).
set -euo pipefail
cd "$(dirname "$0")/.."
exec /usr/bin/python3 - "$@" <<'PY'
import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import benchproc as bp  # noqa: E402

PYTHON = "/usr/bin/python3"
WORKER = "bench/c10d_join_worker.py"

ap = argparse.ArgumentParser(prog="bench/etcd_loss_bench.sh")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--only", choices=["host-loss", "leader-loss"], default=None)
ap.add_argument("--ctorchrun", default=None, help="ctorchrun binary")
ap.add_argument("--torchrun", default="/usr/bin/torchrun")
ap.add_argument("--failover-bench", default="build/bin/ctorch-etcd-failover-bench")
ap.add_argument("--conf", default="keep_alive_interval=1,read_timeout=5,last_call_timeout=1",
                help="--rdzv_conf of every agent")
ap.add_argument("--client-read-timeout-ms", type=int, default=2000,
                help="read timeout of ctorch-etcd-failover-bench's client (leader-loss a)")
ap.add_argument("--deadline", type=float, default=60.0, help="seconds from the loss")
ap.add_argument("--startup-deadline", type=float, default=120.0,
                help="seconds for every worker to step 3 times at full world")
ap.add_argument("--keep-logs", default=None, help="copy every agent's log into this folder")
args = ap.parse_args()
if args.runs < 1:
    sys.exit("--runs must be at least 1")
for tool in (bp.ETCD, bp.ETCDCTL, args.torchrun):
    if not os.access(tool, os.X_OK):
        sys.exit(f"missing {tool}")
ctorchrun = args.ctorchrun or next((p for p in ("build/bin/ctorchrun", "build/cli/ctorchrun")
                                    if os.access(p, os.X_OK)), None)
if not ctorchrun or not os.access(ctorchrun, os.X_OK):
    sys.exit("no ctorchrun binary: build it (ninja -C build ctorchrun) or pass --ctorchrun PATH")
ctorchrun = os.path.abspath(ctorchrun)
if args.only != "host-loss" and not os.access(args.failover_bench, os.X_OK):
    sys.exit(f"no {args.failover_bench}: ninja -C build ctorch-etcd-failover-bench")

tag = f"elb{os.getpid()}x{random.randrange(1 << 30):x}"
top = tempfile.mkdtemp(prefix="etcd_loss_bench.")
clusters = []  # every cluster started, stopped at the end whatever happens
bp.exit_on_signals()


def new_cluster(work):
    c = bp.EtcdCluster(work, 3, tag)
    clusters.append(c)
    return c


def job_env(work, stop_file):
    env = dict(os.environ)
    env.update({bp.TAG_VAR: tag}, CJB_STOP_FILE=stop_file,
               CJB_MAX_SECONDS=str(int(args.startup_deadline + args.deadline + 60)),
               CTORCHRUN_PYTHON=PYTHON, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               LOGLEVEL="INFO", TMPDIR=os.path.join(work, "tmp"))
    return env


def agent_cmd(path, backend, endpoint, rdzv_id, nnodes):
    return [path, "--redirects", "9:1", "--tee", "9:1", "--monitor_interval", "0.1",
            f"--nnodes={nnodes}", "--nproc_per_node=1", f"--rdzv_backend={backend}",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rdzv_id}", f"--rdzv_conf={args.conf}",
            "--max_restarts=5", WORKER]


def wait_stepping(agents, world, end, res):
    """Until every agent's worker stepped 3 times at world; False (res says
    why) when an agent exits or the deadline passes."""
    while True:
        for a in agents:
            a.poll()
        if all(a.steps(world) >= 3 for a in agents):
            return True
        for a in agents:
            if a.exited():
                res.update(status=f"failed: {a.name} exited rc={a.proc.returncode} before the "
                                  f"world of {world} stepped",
                           tails={x.name: x.tail() for x in agents})
                return False
        if time.monotonic() > end:
            res.update(status=f"timeout: no world of {world} stepping within "
                              f"{args.startup_deadline:g} s",
                       tails={x.name: x.tail() for x in agents})
            return False
        time.sleep(0.02)


def listening_ports(pids):
    """TCP ports listened on by any of the pids (sockets from /proc/PID/fd
    matched with /proc/net/tcp{,6} in state LISTEN)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def finish(res, agents, stop_file, work, label):
    bp.end_run(tag, res, agents, stop_file, args.keep_logs, label)


LOG_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})\]")


def log_time_after(agent, first, text, t0):
    """The stamp of ctorchrun's first log line containing text among the
    agent's events from index first on, minus t0 (None without one). The
    stamps are local time with milliseconds."""
    for e in agent.events[first:]:
        if e[0] == "note" and text in e[1]:
            m = LOG_STAMP.match(e[1])
            if m:
                t = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
                return round(t - t0, 3)
    return None


# ---------------------------------------------------------------- host loss
def host_loss(launcher, run, cluster):
    work = os.path.join(top, f"host-{launcher}-{run}")
    os.makedirs(os.path.join(work, "tmp"))
    stop_file = os.path.join(work, "stop")
    env = job_env(work, stop_file)
    rdzv_id = f"{tag}_host_{launcher}_{run}"
    res = {"bench": "host-loss", "launcher": launcher, "run": run, "status": None}
    agents = []
    try:
        end = time.monotonic() + args.startup_deadline
        if launcher == "ctorchrun":
            cmd = agent_cmd(ctorchrun, "etcd-v3", ",".join(cluster.endpoints), rdzv_id, "2:3")
            for n in (1, 2, 3):
                agents.append(bp.Agent(f"agent{n}", cmd, dict(env, **{bp.NODE_VAR: str(n)}),
                                       os.path.join(work, f"agent{n}.log")))
        else:
            port = bp.free_port()
            cmd = agent_cmd(args.torchrun, "c10d", f"127.0.0.1:{port}", rdzv_id, "2:3")
            agents.append(bp.Agent("agent1", cmd, dict(env, **{bp.NODE_VAR: "1"}),
                                   os.path.join(work, "agent1.log")))
            while not bp.accepts(port):  # agent 1 hosts the c10d store: it binds first
                if agents[0].exited() or time.monotonic() > end:
                    res.update(status="failed: the endpoint did not come up",
                               tails={"agent1": agents[0].tail()})
                    return res
                time.sleep(0.02)
            for n in (2, 3):
                agents.append(bp.Agent(f"agent{n}", cmd, dict(env, **{bp.NODE_VAR: str(n)}),
                                       os.path.join(work, f"agent{n}.log")))
        if not wait_stepping(agents, 3, end, res):
            return res
        # Which agent hosts the workers' store: its worker has GROUP_RANK 0,
        # and its process tree listens on MASTER_PORT.
        info = {}
        for i, a in enumerate(agents):
            st = a.last_start()
            e = bp.environ(st[4]) or {}
            info[i] = (e.get("GROUP_RANK"), e.get("MASTER_ADDR"), e.get("MASTER_PORT"),
                       e.get("TORCHELASTIC_RESTART_COUNT"))
        res["workers_env"] = {agents[i].name: f"group_rank={v[0]} master={v[1]}:{v[2]} "
                                              f"restart_count={v[3]}" for i, v in info.items()}
        rank0 = [i for i, v in info.items() if v[0] == "0"]
        if len(rank0) != 1:
            res.update(status=f"failed: {len(rank0)} workers with GROUP_RANK 0")
            return res
        master_port = int(info[rank0[0]][2] or 0)
        listeners = [a.name for a in agents
                     if master_port in listening_ports([a.proc.pid] +
                                                       list(bp.descendants([a.proc.pid])))]
        res["master_port_listened_by"] = listeners
        if launcher == "ctorchrun":
            victim = rank0[0]
            if listeners != [agents[victim].name]:
                res.update(status=f"failed: MASTER_PORT {master_port} is listened on by "
                                  f"{listeners}, the group rank 0 agent is {agents[victim].name}")
                return res
        else:
            victim = 0  # the endpoint's host: it serves the c10d store
        res["killed"] = agents[victim].name
        survivors = [a for i, a in enumerate(agents) if i != victim]
        before = {a.name: bp.restart_count(a.last_start()[4]) for a in survivors}
        seen = {a.name: len(a.events) for a in survivors}
        t0, survived = bp.kill_node(tag, agents[victim], victim + 1)
        res["t0"] = t0
        if survived:
            res["node_alive_after_kill"] = survived
        end = time.monotonic() + args.deadline
        outcome = {}  # survivor name -> its result
        counts = {}   # pid of a worker started after the loss -> its TORCHELASTIC_RESTART_COUNT
        while len(outcome) < len(survivors):
            for a in survivors:
                if a.name in outcome:
                    continue
                a.poll()
                starts, step = a.after(t0)
                for e in starts:
                    if e[4] not in counts:
                        counts[e[4]] = bp.restart_count(e[4]) or "?"
                if step is not None:
                    outcome[a.name] = {"step_s": round(step[1] - t0, 4), "world": step[2],
                                       "gives_way_s": log_time_after(a, seen[a.name],
                                                                     "gives way", t0),
                                       "rdzv_complete_s": log_time_after(a, seen[a.name],
                                                                         "rendezvous complete",
                                                                         t0),
                                       "worker_started_s": round(starts[0][1] - t0, 4),
                                       "workers_started": len(starts),
                                       "restart_count": f"{before[a.name]} -> "
                                                        f"{counts[starts[-1][4]]}"}
                elif a.exited():
                    a.poll()
                    if a.after(t0)[1] is None:
                        outcome[a.name] = {"exit_s": round(a.exit_t - t0, 3),
                                           "rc": a.proc.returncode,
                                           "workers_started": len(a.after(t0)[0])}
            if time.monotonic() > end:
                break
            time.sleep(0.02)
        res["survivors"] = outcome
        res["notes_after_loss"] = {a.name: [e[1] for e in a.events[seen[a.name]:]
                                            if e[0] == "note"][:12] for a in survivors}
        stepped = [o for o in outcome.values() if "step_s" in o]
        ended = [o for o in outcome.values() if "exit_s" in o]
        if len(stepped) == len(survivors):
            res.update(status="ok", world_stepping_s=max(o["step_s"] for o in stepped),
                       first_step_s=min(o["step_s"] for o in stepped),
                       charged=any(o["restart_count"].split(" -> ")[0]
                                   != o["restart_count"].split(" -> ")[1] for o in stepped))
        elif len(ended) == len(survivors):
            res.update(status="job ended", survivors_exit_s=max(o["exit_s"] for o in ended),
                       exit_codes=sorted({o["rc"] for o in ended}))
        else:
            res.update(status=f"timeout: after {args.deadline:g} s {len(stepped)} stepped, "
                              f"{len(ended)} ended, of {len(survivors)} survivors",
                       tails={a.name: a.tail() for a in survivors})
        return res
    finally:
        finish(res, agents, stop_file, work, f"host-{launcher}-{run}")


# ---------------------------------------------------------------- leader loss
def leader_loss_client(run):
    work = os.path.join(top, f"leader-client-{run}")
    os.makedirs(work)
    res = {"bench": "leader-loss, our client", "run": run, "status": None}
    cluster = new_cluster(work)
    proc = None
    try:
        leader = cluster.leader()
        if leader is None:
            res["status"] = "failed: no leader found"
            return res
        res["leader"] = f"m{leader}"
        eps = [cluster.endpoints[leader]] + [e for i, e in enumerate(cluster.endpoints)
                                             if i != leader]
        kill_file = os.path.join(work, "kill_t")
        out_path = os.path.join(work, "bench.out")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([args.failover_bench, "--endpoints", ",".join(eps),
                                     "--kill-file", kill_file, "--interval-ms", "20",
                                     "--read-timeout-ms", str(args.client_read_timeout_ms), "--after-writes", "25",
                                     "--max-seconds", str(int(args.deadline) + 15)],
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, **{bp.TAG_VAR: tag}))
        end = time.monotonic() + 15
        while b"READY" not in open(out_path, "rb").read():
            if proc.poll() is not None or time.monotonic() > end:
                res["status"] = "failed: the writer did not get ready"
                res["output"] = open(out_path, "rb").read().decode("utf-8", "replace")[-800:]
                return res
            time.sleep(0.02)
        time.sleep(1.0)  # a second of steady writes through the leader
        t0 = time.time()
        cluster.kill(leader)
        with open(kill_file + ".tmp", "w") as f:
            f.write(f"{t0:.6f}\n")
        os.rename(kill_file + ".tmp", kill_file)
        try:
            proc.wait(timeout=args.deadline + 30)
        except subprocess.TimeoutExpired:
            pass
        lines = open(out_path, "rb").read().decode("utf-8", "replace").splitlines()
        try:
            report = json.loads(lines[-1])
        except (ValueError, IndexError):
            res["status"] = f"failed: no report (rc {proc.returncode})"
            res["output"] = lines[-5:]
            return res
        res.update(report)
        res["run"], res["bench"] = run, "leader-loss, our client"
        return res
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        cluster.stop()


def leader_loss_etcdctl(run):
    """The peer of leader_loss_client: etcd's own Go client (etcdctl 3.4, one
    process per attempt), the same members in the same order (the leader
    first), --command-timeout=2s, put after put from the kill on."""
    work = os.path.join(top, f"leader-etcdctl-{run}")
    os.makedirs(work)
    res = {"bench": "leader-loss, etcdctl", "run": run, "status": None}
    cluster = new_cluster(work)
    try:
        leader = cluster.leader()
        if leader is None:
            res["status"] = "failed: no leader found"
            return res
        res["leader"] = f"m{leader}"
        eps = ",".join([cluster.endpoints[leader]] + [e for i, e in enumerate(cluster.endpoints)
                                                      if i != leader])
        for _ in range(5):  # the same warm cluster as our client sees
            cluster.ctl(eps, "put", "/ctorchrun-failover-bench/w", "warm", timeout="2s")
        t0 = time.time()
        cluster.kill(leader)
        failed, end = 0, time.monotonic() + args.deadline
        for _ in range(1000):
            if cluster.ctl(eps, "put", "/ctorchrun-failover-bench/w", "after",
                           timeout="2s") is not None:
                res.update(status="ok", first_ok_after_kill_s=round(time.time() - t0, 4),
                           failed_after_kill=failed)
                return res
            failed += 1
            if time.monotonic() > end:
                break
        res.update(status="timeout", failed_after_kill=failed)
        return res
    finally:
        cluster.stop()


def leader_loss_job(run):
    work = os.path.join(top, f"leader-job-{run}")
    os.makedirs(os.path.join(work, "tmp"))
    stop_file = os.path.join(work, "stop")
    env = job_env(work, stop_file)
    res = {"bench": "leader-loss, ctorchrun job", "run": run, "status": None}
    cluster = new_cluster(work)
    agents = []
    try:
        cmd = agent_cmd(ctorchrun, "etcd-v3", ",".join(cluster.endpoints),
                        f"{tag}_leader_{run}", "2:2")
        for n in (1, 2):
            agents.append(bp.Agent(f"agent{n}", cmd, dict(env, **{bp.NODE_VAR: str(n)}),
                                   os.path.join(work, f"agent{n}.log")))
        if not wait_stepping(agents, 2, time.monotonic() + args.startup_deadline, res):
            return res
        leader = cluster.leader()
        if leader is None:
            res["status"] = "failed: no leader found"
            return res
        res["leader"] = f"m{leader}"
        before = {a.name: bp.restart_count(a.last_start()[4]) for a in agents}
        pids = {a.name: a.last_start()[4] for a in agents}
        seen = {a.name: len(a.events) for a in agents}
        t0 = time.time()
        cluster.kill(leader)
        end = time.monotonic() + 8.0
        while time.monotonic() < end and not any(a.exited() for a in agents):
            time.sleep(0.1)
        for a in agents:
            a.poll()
        new_starts = {a.name: len(a.after(t0)[0]) for a in agents}
        after = {a.name: bp.restart_count(a.last_start()[4]) for a in agents}
        steps = [e[1] for e in agents[0].events if e[0] == "step" and t0 - 1 <= e[1] <= t0 + 8]
        gap = max((b - a for a, b in zip(steps, steps[1:])), default=None)
        charged = sum(int(after[n] or 0) - int(before[n] or 0) for n in before)
        res.update(status="ok" if not any(a.proc.returncode is not None for a in agents)
                   else "failed: an agent exited",
                   restarts_charged=charged,
                   restart_count={n: f"{before[n]} -> {after[n]}" for n in before},
                   workers_started_after_kill=new_starts,
                   same_workers=all(a.last_start()[4] == pids[a.name] for a in agents),
                   steps_in_8s_after=sum(1 for t in steps if t > t0),
                   longest_step_gap_s=round(gap, 3) if gap is not None else None,
                   notes_after_kill={a.name: [e[1] for e in a.events[seen[a.name]:]
                                              if e[0] == "note"][:8] for a in agents})
        return res
    finally:
        finish(res, agents, stop_file, work, f"leader-job-{run}")
        cluster.stop()


def median(xs):
    return f"{statistics.median(xs):.3f} s" if xs else "-"


results = []
orphans = []
try:
    print(f"# etcd loss bench: nproc {len(os.sched_getaffinity(0))}, load average {bp.load()}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, runs {args.runs}, conf {args.conf}",
          flush=True)
    print(f"# ctorchrun: {ctorchrun}; torchrun: {args.torchrun}; etcd: {bp.ETCD}", flush=True)
    if args.only != "leader-loss":
        work = os.path.join(top, "host-cluster")
        os.makedirs(work)
        cluster = new_cluster(work)
        print(f"# host-loss: etcd members {','.join(cluster.endpoints)}", flush=True)
        bp.alternate(["ctorchrun", "torchrun"], args.runs,
                     lambda launcher, run: host_loss(launcher, run, cluster), results)
        cluster.stop()
    if args.only != "host-loss":
        for run in range(1, args.runs + 1):
            for fn in (leader_loss_client, leader_loss_etcdctl, leader_loss_job):
                r = fn(run)
                results.append(r)
                print(json.dumps(r), flush=True)
finally:
    for c in clusters:
        c.stop()
    # Nothing of ours may outlive the harness: agents carry the tag in their
    # --rdzv_id, everything started in its environment (etcd members too).
    orphans = bp.end_harness(tag, top)

print(f"# load average at the end {bp.load()}")
host = [r for r in results if r["bench"] == "host-loss"]
if host:
    print("\n## loss of the node hosting the workers' store (3 nodes, --nnodes=2:3)")
    print("| launcher | outcome | median | each run (s) | restart count before -> after | ok / runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    c = [r for r in host if r["launcher"] == "ctorchrun"]
    ok = [r for r in c if r["status"] == "ok"]
    each = ", ".join(f"{r['world_stepping_s']:.3f}" if r["status"] == "ok"
                     else r["status"].split(":")[0] for r in c)
    counts = "; ".join(", ".join(o["restart_count"] for o in r["survivors"].values()) for r in ok)
    # Per run, the later of the two survivors at each stage.
    gw = [max(o.get("gives_way_s") or 0 for o in r["survivors"].values()) for r in ok]
    ws = [max(o["worker_started_s"] for o in r["survivors"].values()) for r in ok]
    ss = [r["world_stepping_s"] - w for r, w in zip(ok, ws)]
    detail = (f"ctorchrun, per run (the later survivor at each stage): loss -> round gives way "
          f"{median(gw)} ({', '.join(f'{x:.3f}' for x in gw)}); loss -> new worker started "
          f"{median(ws)} ({', '.join(f'{x:.3f}' for x in ws)}); worker start -> step "
          f"{median(ss)} ({', '.join(f'{x:.2f}' for x in ss)})")
    print(f"| ctorchrun (etcd-v3) | survivors stepping again (world "
          f"{','.join(sorted({str(o['world']) for r in ok for o in r['survivors'].values()})) or '-'}) "
          f"| {median([r['world_stepping_s'] for r in ok])} | {each} | {counts or '-'} "
          f"| {len(ok)} / {len(c)} |")
    t = [r for r in host if r["launcher"] == "torchrun"]
    ended = [r for r in t if r["status"] == "job ended"]
    each = ", ".join(f"{r['survivors_exit_s']:.3f}" if r["status"] == "job ended"
                     else r["status"].split(":")[0] for r in t)
    codes = sorted({c for r in ended for c in r["exit_codes"]})
    print(f"| torchrun (c10d) | survivors exit, rc {codes or '-'} | "
          f"{median([r['survivors_exit_s'] for r in ended])} | {each} | - "
          f"| {len(ended)} ended / {len(t)} |")
    print(f"\n{detail}")
lc = [r for r in results if r["bench"] == "leader-loss, our client"]
if lc:
    ok = [r for r in lc if r["status"] == "ok"]
    print(f"\n## etcd leader SIGKILLed: our client writing every 20 ms (read timeout "
          f"{args.client_read_timeout_ms} ms)")
    print(f"kill -> first successful write, median {median([r['first_ok_after_kill_s'] for r in ok])}; "
          "each run: " + ", ".join(f"{r['first_ok_after_kill_s']:.3f} s ({r['failed_after_kill']} failed, "
                                   f"max latency {r['max_latency_after_kill_ms']:.0f} ms)"
                                   if r["status"] == "ok" else r["status"] for r in lc))
le = [r for r in results if r["bench"] == "leader-loss, etcdctl"]
if le:
    ok = [r for r in le if r["status"] == "ok"]
    print(f"peer, etcdctl put (same members, leader first, 2 s timeout): median "
          f"{median([r['first_ok_after_kill_s'] for r in ok])}; each run: " +
          ", ".join(f"{r['first_ok_after_kill_s']:.3f} s ({r['failed_after_kill']} failed)"
                    if r["status"] == "ok" else r["status"] for r in le))
lj = [r for r in results if r["bench"] == "leader-loss, ctorchrun job"]
if lj:
    print("\n## etcd leader SIGKILLed under a ctorchrun job (2 nodes, torch workers)")
    print("each run: " + "; ".join(
        f"restarts charged {r['restarts_charged']}, workers started {sum(r['workers_started_after_kill'].values())}, "
        f"longest step gap {r['longest_step_gap_s']} s" if r["status"] == "ok" else r["status"]
        for r in lj))
bad = [r for r in results if r.get("left_after_stop") or r.get("node_alive_after_kill")]
sys.exit(1 if orphans or bad else 0)
PY
