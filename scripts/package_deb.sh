#!/usr/bin/env bash
# The .deb of scripts/package.sh, from a built Release folder:
#   scripts/package_deb.sh BUILD_DIR VERSION OUT_DIR
# `cmake --install` (stripped) into a staging root under BUILD_DIR, the man
# pages compressed, Debian's copyright and changelog added, Depends computed
# by dpkg-shlibdeps from the ELF files, then dpkg-deb.
set -euo pipefail
build=$1 version=$2 out=$3
cd "$(dirname "$0")/.."
build=$(realpath "$build")
fail() { echo "package_deb: error: $*" >&2; exit 1; }
for tool in dpkg-deb dpkg-shlibdeps; do
  command -v $tool >/dev/null 2>&1 || fail "$tool is missing (apt-get install dpkg-dev)"
done
arch=$(dpkg --print-architecture)
# Who answers for the package: $DEBFULLNAME <$DEBEMAIL>, as Debian's tools take it.
maintainer="${DEBFULLNAME:-ctorchrun maintainers} <${DEBEMAIL:-ctorchrun@localhost}>"
stage=$build/deb-root
rm -rf "$stage" "$build/deb-shlibs"
DESTDIR=$stage cmake --install "$build" --prefix /usr --strip >/dev/null
[ ! -e "$stage/usr/lib/ctorchrun/python" ] ||
  fail "$build has the ctorch torch extension (configure it with -DCTORCHRUN_TORCH_BACKEND=OFF)"
find "$stage/usr/share/man" -type f -name '*.[0-9]' -exec gzip -9n {} +

doc=$stage/usr/share/doc/ctorchrun
mkdir -p "$doc"
cat >"$doc/copyright" <<EOT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: ctorchrun
Source: the ctorchrun repository

Files: *
Copyright: 2025-2026 the ctorchrun authors
License: see the ctorchrun repository
EOT
printf 'ctorchrun (%s) unstable; urgency=medium\n\n  * Built from the ctorchrun repository by scripts/package.sh.\n\n -- %s  %s\n' \
  "$version" "$maintainer" "$(date -R -d @"${SOURCE_DATE_EPOCH:-0}")" | gzip -9n >"$doc/changelog.gz"

# dpkg-shlibdeps reads debian/control and, for our own library,
# debian/shlibs.local (the package provides libctorch_dist; -x keeps it out).
work=$build/deb-shlibs
mkdir -p "$work/debian"
echo "Source: ctorchrun" >"$work/debian/control"
soname=$(cd "$stage/usr" && find . -name 'libctorch_dist.so.*' -type f | head -1)
[ -n "$soname" ] || fail "libctorch_dist is not in the staging root"
echo "libctorch_dist ${version%%.*} ctorchrun (>= $version)" >"$work/debian/shlibs.local"
mapfile -t elves < <(cd "$stage" && find . -type f -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print)
libdirs=$(cd "$stage" && find . -name 'libctorch_dist.so*' -printf '%h\n' | sort -u | sed "s|^\.|-l$stage|")
depends=$(cd "$work" && dpkg-shlibdeps -O -xctorchrun $libdirs "${elves[@]/#./$stage}" 2>"$work/warnings" |
  sed -n 's/^shlibs:Depends=//p')
[ -n "$depends" ] || { cat "$work/warnings" >&2; fail "dpkg-shlibdeps found no dependencies"; }

mkdir -p "$stage/DEBIAN"
# libctorch_dist: its shlibs entry for packages built against it, and
# ldconfig run after an install or removal.
cp "$work/debian/shlibs.local" "$stage/DEBIAN/shlibs"
echo "activate-noawait ldconfig" >"$stage/DEBIAN/triggers"
(cd "$stage" && find usr -type f -exec md5sum {} + | sort -k2 >DEBIAN/md5sums)
cat >"$stage/DEBIAN/control" <<EOT
Package: ctorchrun
Version: $version
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $(du -sk --exclude=DEBIAN "$stage" | cut -f1)
Depends: $depends
Suggests: python3-torch, etcd-server, etcd-client, slurm-client
Section: utils
Priority: optional
Description: launcher for distributed PyTorch and C++ jobs (a torchrun drop-in)
 ctorchrun starts and watches the workers of a distributed training job, one
 agent per node, as PyTorch's torchrun does: static, c10d and etcd
 rendezvous, elastic restarts, a TCPStore-compatible store (ctorch-store).
 Also carries libctorch_dist (collectives for C++ workers) with its headers
 and CMake package, the manual pages and bash, zsh and tcsh completions.
EOT
deb=$out/ctorchrun_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "package_deb: $deb ($(du -k "$deb" | cut -f1) KiB); Depends: $depends"
if command -v lintian >/dev/null 2>&1; then
  lintian --no-tag-display-limit "$deb" || true
fi
