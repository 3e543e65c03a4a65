# Sourced by the package tests: a throwaway copy of the clean Debian 12 root
# (scripts/setup_clean_root.sh), an overlay on it so that the root itself
# stays clean, with /proc and /dev mounted; everything is undone on exit.
#   start_clean_root ROOT    sets $r, the copy's path
#   in_root CMD...           runs CMD chrooted in the copy
fail() { echo "$(basename "$0"): FAILED: $*" >&2; exit 1; }
step() { echo "== $(basename "$0"): $* ($((SECONDS - test_start)) s)"; }
test_start=$SECONDS

start_clean_root() {
  local root=$1
  [ -f "$root/.ctorchrun-clean-complete" ] ||
    fail "no clean Debian 12 root at $root: make it with scripts/setup_clean_root.sh (scripts/setup.sh calls it)"
  [ "$(id -u)" = 0 ] || fail "the package tests need root (chroot, mount)"
  copy=$(mktemp -d "$(dirname "$root")/$(basename "$root")-copy-XXXXXX")
  mkdir "$copy/upper" "$copy/work" "$copy/root"
  trap stop_clean_root EXIT
  mount -t overlay overlay -o "lowerdir=$root,upperdir=$copy/upper,workdir=$copy/work" "$copy/root" ||
    fail "cannot mount an overlay on $root"
  r=$copy/root
  mount -t proc proc "$r/proc"
  mount --rbind /dev "$r/dev"
  mount --make-rslave "$r/dev"
}

stop_clean_root() {
  [ -n "${copy:-}" ] || return 0
  umount -R "$copy/root/dev" 2>/dev/null || umount -lR "$copy/root/dev" 2>/dev/null || true
  umount "$copy/root/proc" 2>/dev/null || umount -l "$copy/root/proc" 2>/dev/null || true
  umount "$copy/root" 2>/dev/null || umount -l "$copy/root" 2>/dev/null || true
  rm -rf --one-file-system "$copy"
}

in_root() {
  chroot "$r" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
}

installed_packages() { in_root dpkg-query -W -f '${Package}\n' | sort; }
