#!/usr/bin/env bash
# The wheel, as a user installs it (tests/package/package_test.cc runs it):
#   tests/package/wheel_test.sh WHEEL [CLEAN_ROOT]
# pip installs it with no index into a fresh venv (with the system's site
# packages, so Debian's torch is there) as a user who is not root; ctorchrun
# and `python -m ctorchrun` work from the venv, a torch script runs under
# it with the venv's python picked by default (python3 first on PATH; with
# python -m, that python even when the venv is not activated), its binaries
# need only the C
# library, and they run on the clean Debian 12 root too.
set -euo pipefail
wheel=$(realpath "$1")
root=${2:-${CTORCHRUN_CLEAN_ROOT:-/var/lib/ctorchrun/bookworm-clean}}
user=${CTORCHRUN_TEST_USER:-ctorchrun-test}
. "$(dirname "$0")/clean_root.sh"
[ -f "$wheel" ] || fail "no wheel at $1 (scripts/package.sh wheel makes it)"
[ "$(id -u)" = 0 ] || fail "the wheel test needs root (to make its user and use the clean root)"
id "$user" >/dev/null 2>&1 || useradd -m "$user" || fail "cannot add the user $user"
home=$(getent passwd "$user" | cut -d: -f6)
tmp=$(mktemp -d /tmp/ctorchrun-wheel-XXXXXX)
trap 'rm -rf "$tmp"; stop_clean_root' EXIT
cp "$wheel" "$tmp/"
chown -R "$user" "$tmp"
venv=$tmp/venv
# As the user, with a plain environment: the venv's bin first on PATH, no
# CTORCHRUN_PYTHON or PYTHON_EXEC.
as_user() {
  runuser -u "$user" -- env -i HOME="$home" PATH="$venv/bin:/usr/local/bin:/usr/bin:/bin" \
    LANG=C.UTF-8 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}

step "the wheel's RECORD: every file with its sha256 and size"
python3 - "$wheel" <<'EOT' || fail "the wheel's RECORD does not match its files"
import base64, hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = set(z.namelist())
record = [n for n in names if n.endswith(".dist-info/RECORD")]
assert len(record) == 1, record
listed = set()
for line in z.read(record[0]).decode().splitlines():
    path, digest, size = line.rsplit(",", 2)
    listed.add(path)
    if path == record[0]:
        continue
    data = z.read(path)
    want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert digest == want and int(size) == len(data), path
assert listed == names, names ^ listed
for name in ("ctorchrun", "ctorch-store", "ctorch-status"):
    info = z.getinfo(next(n for n in names if n.endswith(".data/scripts/" + name)))
    assert (info.external_attr >> 16) & 0o111, name + " is not executable"
EOT

step "pip install --no-index $(basename "$wheel") into a venv, as $user"
as_user python3 -m venv --system-site-packages "$venv"
as_user pip install -q --no-index "$tmp/$(basename "$wheel")" || fail "pip install failed"
version=$(basename "$wheel" | cut -d- -f2)
[ "$(as_user ctorchrun --version)" = "ctorchrun $version" ] || fail "ctorchrun --version: $(as_user ctorchrun --version)"
[ "$(as_user sh -c 'command -v ctorchrun')" = "$venv/bin/ctorchrun" ] || fail "ctorchrun is not the venv's"
[ "$(as_user ctorch-store --version)" = "ctorch-store $version" ] || fail "ctorch-store --version"
[ "$(as_user ctorch-status --version)" = "ctorch-status $version" ] || fail "ctorch-status --version"
[ "$(as_user python -m ctorchrun --version)" = "ctorchrun $version" ] || fail "python -m ctorchrun --version"
[ ! -e "$venv/bin/torchrun" ] || fail "the wheel installed a torchrun command"
listed=$(as_user pip show -f ctorchrun)
if echo "$listed" | grep -Eq '(^|/| )torchrun$'; then fail "the wheel carries a torchrun"; fi

step "ldd of the installed binaries: the C library only"
for b in ctorchrun ctorch-store ctorch-status; do
  libs=$(ldd "$venv/bin/$b" | awk '{print $1}' |
    grep -Ev '^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|lib(c|m|dl|pthread|rt)\.so\.[0-9]+)$' || true)
  [ -z "$libs" ] || fail "$b needs $(echo $libs)"
done

step "a torch script under ctorchrun, with the venv's python by default"
cat >"$tmp/job.py" <<'EOT'
import sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
# One write per line: the workers share ctorchrun's stdout.
sys.stdout.write(f"rank {dist.get_rank()} sum {t.item():g} prefix {sys.prefix}\n")
dist.destroy_process_group()
EOT
chown "$user" "$tmp/job.py"
out=$(as_user ctorchrun --nproc_per_node=2 "$tmp/job.py" 2>"$tmp/job.log") ||
  { tail -20 "$tmp/job.log"; fail "the torch job failed"; }
for rank in 0 1; do
  echo "$out" | grep -qx "rank $rank sum 3 prefix $venv" || fail "rank $rank did not run on the venv's python: '$out'"
done
# python -m ctorchrun from a venv that is not activated (its bin/ not on
# PATH): the workers still run on that python.
out=$(runuser -u "$user" -- env -i HOME="$home" PATH=/usr/bin:/bin \
  "$venv/bin/python" -m ctorchrun --nproc_per_node=1 "$tmp/job.py" 2>"$tmp/job.log") ||
  { tail -20 "$tmp/job.log"; fail "the torch job under python -m ctorchrun failed"; }
echo "$out" | grep -qx "rank 0 sum 1 prefix $venv" || fail "python -m ctorchrun: '$out'"

step "the wheel's binaries on the clean Debian 12 root"
start_clean_root "$root"
cp "$venv/bin/ctorchrun" "$venv/bin/ctorch-store" "$r/usr/local/bin/"
out=$(in_root ctorchrun --nproc_per_node=2 --no_python /bin/sh -c 'echo "rank $RANK"' 2>"$tmp/clean.log") ||
  { tail -20 "$tmp/clean.log"; fail "ctorchrun failed on the clean root"; }
[ "$(echo "$out" | sort)" = "$(printf 'rank 0\nrank 1')" ] || fail "the job printed '$out'"
[ "$(in_root ctorch-store --version)" = "ctorch-store $version" ] || fail "ctorch-store on the clean root"
step "passed"
