#!/usr/bin/env python3
"""Compare two worker environments dumped by dump_env.py.

Usage:
    compare_env.py A.json B.json [--ignore VAR ...] [--verbose]
    compare_env.py DIR_A DIR_B   [--ignore VAR ...]   (pairs env_rank*.json by name)

Every variable in either environment is one check, printed only when it fails
(all of them with --verbose):
    MISSING in A: VAR (B='...')       present only in B
    MISSING in B: VAR (A='...')       present only in A
    DIFF VAR: A='...' B='...'         present in both, different values
Rules for variables that legitimately differ between two launchers or runs:
    MASTER_PORT                     must be present in both (if in either) and be
                                    an integer; the value may differ.
    TORCHELASTIC_ERROR_FILE         must be present in both (if in either); each
                                    value must look like
                                    .../attempt_<n>/<local_rank>/error.json with n ==
                                    TORCHELASTIC_RESTART_COUNT and local_rank ==
                                    LOCAL_RANK of the same file; the rest may differ.
    TORCH_NCCL_ASYNC_ERROR_HANDLING may be present on one side only (torch 2.x
                                    launchers add it); compared if in both.
    DUMP_DIR, _                     ignored: the test harness's own directory, and
                                    the path of the program the shell started
                                    (the launcher itself), which bash exports.
    --ignore VAR                    ignored entirely; repeatable, comma lists and
                                    shell-style patterns (PET_*) accepted.
With directories, a rank file present on one side only is one failed check.

Prints a final line `N passed, M failed`. Exit status: 0 when nothing failed,
1 otherwise, 2 on usage errors (unreadable file, not a JSON object).
"""
import argparse
import fnmatch
import glob
import json
import os
import re
import sys

PORT_VARS = {"MASTER_PORT"}
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
OPTIONAL_VARS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
DEFAULT_IGNORED = {"DUMP_DIR", "_"}
ERROR_FILE_RE = re.compile(r"^.+/attempt_(\d+)/(\d+)/error\.json$")


class Usage(Exception):
    pass


def load(path):
    try:
        with open(path) as f:
            env = json.load(f)
    except (OSError, ValueError) as e:
        raise Usage(f"cannot read {path}: {e}")
    if not isinstance(env, dict):
        raise Usage(f"{path}: not a JSON object")
    return {str(k): str(v) for k, v in env.items()}


def error_file_problem(env):
    """None if TORCHELASTIC_ERROR_FILE has the expected shape, else why not."""
    value = env[ERROR_FILE_VAR]
    m = ERROR_FILE_RE.match(value)
    if not m:
        return f"{value!r} is not .../attempt_<n>/<local_rank>/error.json"
    attempt, local_rank = m.groups()
    if "TORCHELASTIC_RESTART_COUNT" in env and attempt != env["TORCHELASTIC_RESTART_COUNT"]:
        return f"{value!r}: attempt_{attempt} but TORCHELASTIC_RESTART_COUNT={env['TORCHELASTIC_RESTART_COUNT']}"
    if "LOCAL_RANK" in env and local_rank != env["LOCAL_RANK"]:
        return f"{value!r}: local rank dir {local_rank} but LOCAL_RANK={env['LOCAL_RANK']}"
    return None


def compare(a, b, ignore_patterns, verbose, out, prefix=""):
    """Compare two env dicts; print failures; return (passed, failed)."""
    passed = failed = 0

    def ignored(var):
        return var in DEFAULT_IGNORED or any(fnmatch.fnmatchcase(var, p) for p in ignore_patterns)

    for var in sorted(set(a) | set(b)):
        if ignored(var):
            continue
        problems = []
        in_a, in_b = var in a, var in b
        if not (in_a and in_b):
            if var not in OPTIONAL_VARS:
                side, other, val = ("A", "B", b[var]) if not in_a else ("B", "A", a[var])
                problems.append(f"MISSING in {side}: {var} ({other}={val!r})")
        elif var in PORT_VARS:
            for side, env in (("A", a), ("B", b)):
                if not env[var].isdigit():
                    problems.append(f"BAD {var} in {side}: {env[var]!r} is not a port number")
        elif var == ERROR_FILE_VAR:
            for side, env in (("A", a), ("B", b)):
                why = error_file_problem(env)
                if why:
                    problems.append(f"BAD {var} in {side}: {why}")
        elif a[var] != b[var]:
            problems.append(f"DIFF {var}: A={a[var]!r} B={b[var]!r}")
        if problems:
            failed += 1
            for p in problems:
                print(prefix + p, file=out)
        else:
            passed += 1
            if verbose:
                shown = a.get(var, b.get(var))
                print(f"{prefix}ok {var}={shown!r}", file=out)
    return passed, failed


def main(argv=None):
    p = argparse.ArgumentParser(description="compare two worker environments dumped by dump_env.py")
    p.add_argument("a", metavar="A", help="env JSON file, or a directory of env_rank*.json")
    p.add_argument("b", metavar="B", help="env JSON file, or a directory of env_rank*.json")
    p.add_argument("--ignore", action="append", default=[], metavar="VAR", help="variable (or pattern) to ignore")
    p.add_argument("--verbose", "-v", action="store_true", help="also print the checks that pass")
    args = p.parse_args(argv)
    patterns = [x for item in args.ignore for x in item.split(",") if x]
    out = sys.stdout
    try:
        if os.path.isdir(args.a) and os.path.isdir(args.b):
            names_a = {os.path.basename(f) for f in glob.glob(os.path.join(args.a, "env_rank*.json"))}
            names_b = {os.path.basename(f) for f in glob.glob(os.path.join(args.b, "env_rank*.json"))}
            passed = failed = 0
            for name in sorted(names_a | names_b):
                if name not in names_a or name not in names_b:
                    failed += 1
                    print(f"MISSING in {'A' if name not in names_a else 'B'}: file {name}", file=out)
                    continue
                pa, fa = compare(load(os.path.join(args.a, name)), load(os.path.join(args.b, name)),
                                 patterns, args.verbose, out, prefix=f"{name}: ")
                passed, failed = passed + pa, failed + fa
            if not names_a and not names_b:
                raise Usage(f"no env_rank*.json in {args.a} or {args.b}")
        elif os.path.isdir(args.a) or os.path.isdir(args.b):
            raise Usage("give two files or two directories")
        else:
            passed, failed = compare(load(args.a), load(args.b), patterns, args.verbose, out)
    except Usage as e:
        print(f"compare_env: {e}", file=sys.stderr)
        print("0 passed, 1 failed", file=out)
        return 2
    print(f"{passed} passed, {failed} failed", file=out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
