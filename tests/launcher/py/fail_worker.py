#!/usr/bin/env python3
"""Worker that fails on purpose, for launcher failure/restart/shutdown tests.

Usage (as a launcher's worker script):
    fail_worker.py [--rank R] [--code C | --raise | --signal SIG] [--delay D]
                   [--sleep S] [--ignore-sigterm]
                   [--fail-only-attempt N | --fail-until-attempt N]
                   [--stamp-dir DIR]

The failing rank(s), --rank R (a global rank, a comma list, or "all"; default:
none), after --delay D seconds (default 0) do one of:
    --code C       exit with code C (the default, C=1)
    --raise        raise ValueError("boom from rank R") under torch's @record,
                   so TORCHELASTIC_ERROR_FILE (error.json) is written; exit 1
    --signal SIG   kill themselves with SIG (SEGV, SIGKILL, 9, ...)
Every other rank (and a failing rank on an attempt where it does not fail)
sleeps --sleep S seconds (default 0) and exits 0. With --ignore-sigterm every
rank ignores SIGTERM first (so a launcher's SIGTERM does not stop the sleep:
for shutdown-timeout tests; only SIGKILL or the end of S ends it).

Attempt filters (the attempt is TORCHELASTIC_RESTART_COUNT, "0" if unset):
    --fail-only-attempt N   fail only when the attempt is N
    --fail-until-attempt N  fail while the attempt is < N (flaky: N failures,
                            then success)
--stamp-dir DIR writes DIR/attempt<A>_rank<R> holding the time.time() at which
the process started (seconds, 6 decimals), written before anything heavy is
imported, for restart-latency measurements. Torch is only imported by a rank
that is about to --raise.

Each rank prints one line when it starts:
    fail_worker rank R local_rank L attempt A pid P: <what it will do>
"""
import time

START = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402


def env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def parse_signal(text):
    t = text.strip().upper()
    if t.isdigit():
        return signal.Signals(int(t))
    if not t.startswith("SIG"):
        t = "SIG" + t
    return signal.Signals[t]


def parse_ranks(text):
    if text is None:
        return set()
    if text.strip().lower() == "all":
        return None  # every rank
    return {int(x) for x in text.split(",") if x.strip()}


def parse_args(argv):
    p = argparse.ArgumentParser(description="worker that fails on purpose")
    p.add_argument("--rank", default=None, metavar="R", help="failing rank(s): R, R1,R2 or 'all'")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--code", type=int, default=None, metavar="C", help="exit with code C (default 1)")
    how.add_argument("--raise", dest="raise_", action="store_true", help="raise ValueError under @record")
    how.add_argument("--signal", type=parse_signal, default=None, metavar="SIG", help="kill self with SIG")
    p.add_argument("--delay", type=float, default=0.0, metavar="D", help="seconds before failing")
    p.add_argument("--sleep", type=float, default=0.0, metavar="S", help="seconds the other ranks sleep")
    p.add_argument("--ignore-sigterm", action="store_true", help="every rank ignores SIGTERM")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--fail-only-attempt", type=int, default=None, metavar="N")
    when.add_argument("--fail-until-attempt", type=int, default=None, metavar="N")
    p.add_argument("--stamp-dir", default=None, metavar="DIR")
    return p.parse_args(argv)


def write_stamp(stamp_dir, attempt, rank):
    os.makedirs(stamp_dir, exist_ok=True)
    path = os.path.join(stamp_dir, f"attempt{attempt}_rank{rank}")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{START:.6f}\n")
    os.replace(tmp, path)


def boom(rank):
    raise ValueError(f"boom from rank {rank}")


def main(argv=None):
    args = parse_args(argv)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    attempt = env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if args.stamp_dir:
        write_stamp(args.stamp_dir, attempt, rank)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    ranks = parse_ranks(args.rank)
    fails = ranks is None or rank in ranks
    if args.fail_only_attempt is not None:
        fails = fails and attempt == args.fail_only_attempt
    if args.fail_until_attempt is not None:
        fails = fails and attempt < args.fail_until_attempt

    if not fails:
        plan = f"sleep {args.sleep:g}s, exit 0"
    elif args.raise_:
        plan = f"raise ValueError after {args.delay:g}s"
    elif args.signal is not None:
        plan = f"kill self with {args.signal.name} after {args.delay:g}s"
    else:
        plan = f"exit {1 if args.code is None else args.code} after {args.delay:g}s"
    if args.ignore_sigterm:
        plan += " (ignoring SIGTERM)"
    print(f"fail_worker rank {rank} local_rank {local_rank} attempt {attempt} pid {os.getpid()}: {plan}", flush=True)

    if not fails:
        time.sleep(args.sleep)
        return 0
    time.sleep(args.delay)
    if args.raise_:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(boom)(rank)  # writes error.json, then re-raises: exit 1 with a traceback
    if args.signal is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), args.signal)
        time.sleep(1.0)  # a signal whose default action does not end the process lands here
        print(f"fail_worker rank {rank}: still alive after {args.signal.name}", file=sys.stderr, flush=True)
        return 1 if args.code is None else args.code
    return 1 if args.code is None else args.code


if __name__ == "__main__":
    sys.exit(main())
