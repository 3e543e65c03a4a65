#!/usr/bin/env bash
# The wheel of scripts/package.sh, from a CTORCHRUN_PORTABLE build:
#   scripts/package_wheel.sh BUILD_DIR VERSION OUT_DIR
# Checks that ctorchrun, ctorch-store and ctorch-status need nothing but the C library and
# no glibc newer than 2.36 (the manylinux_2_36 tag's promise), strips
# copies of them and writes the wheel with scripts/make_wheel.py.
set -euo pipefail
build=$1 version=$2 out=$3
cd "$(dirname "$0")/.."
fail() { echo "package_wheel: error: $*" >&2; exit 1; }
glibc_max=2.36
stage=$build/wheel-bin
rm -rf "$stage"
mkdir -p "$stage"
for b in ctorchrun ctorch-store ctorch-status; do
  strip -o "$stage/$b" "$build/bin/$b"
  needed=$(readelf -d "$stage/$b" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' |
    grep -Ev '^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64)\.so\.[0-9]+$' || true)
  [ -z "$needed" ] || fail "$b needs $(echo $needed) besides the C library (is $build a CTORCHRUN_PORTABLE build?)"
  newest=$(objdump -T "$stage/$b" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
  [ "$(printf '%s\n%s\n' "$newest" "$glibc_max" | sort -V | tail -1)" = "$glibc_max" ] ||
    fail "$b needs glibc $newest, newer than the tag's $glibc_max"
done
python3 scripts/make_wheel.py --version "$version" --platform "manylinux_${glibc_max/./_}_x86_64" \
  --bin "$stage" --out "$out"
