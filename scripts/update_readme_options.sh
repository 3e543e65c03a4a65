#!/usr/bin/env bash
# Rewrites the README's option list (between the "options table" markers)
# from cli/option_table.cc, through the unit test that compares them.
#   scripts/update_readme_options.sh [build dir, default build]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(cd "${1:-build}" && pwd)
cmake --build "$build" --target launcher_tests >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && "$build/bin/launcher_tests" "option table: the README's option list is the table's" >/dev/null) || true
if [ ! -f "$work/README.options.md" ]; then
  echo "update_readme_options: README.md is already in step"
  exit 0
fi
python3 - "$work/README.options.md" <<'PY'
import sys
table = open(sys.argv[1]).read()
s = open("README.md").read()
begin, end = "<!-- options table: begin -->\n", "<!-- options table: end -->"
b, e = s.index(begin) + len(begin), s.index(end)
open("README.md", "w").write(s[:b] + table + s[e:])
PY
echo "update_readme_options: README.md's option list rewritten"
