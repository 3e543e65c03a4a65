#!/usr/bin/env bash
# Builds the libFuzzer target for the store's request parser with clang
# (ASan + UBSan) and runs it for a bounded time.
#   scripts/fuzz.sh [seconds]   (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
out=build-fuzz
mkdir -p "$out/corpus"
clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I. store/protocol.cc tests/fuzz/request_parser_fuzz.cc -o "$out/request_parser_fuzz"
# Seeds: a v113 SET, a v2 VALIDATE + PING, a v2 MULTI_SET.
printf '\x00\x02\x00\x00\x00\x00\x00\x00\x00/k\x01\x00\x00\x00\x00\x00\x00\x00v' > "$out/corpus/v113_set"
printf '\x00\xce\xf7\x85\x3c\x0d\x39\x30\x00\x00' > "$out/corpus/v2_ping"
printf '\x00\xce\xf7\x85\x3c\x0b\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00/a\x01\x00\x00\x00\x00\x00\x00\x001' > "$out/corpus/v2_multi_set"
echo "fuzz: running the request parser fuzzer for ${seconds}s"
"$out/request_parser_fuzz" -max_total_time="$seconds" -timeout=5 -max_len=4096 \
  -artifact_prefix="$out/" \
  -print_final_stats=1 "$out/corpus" 2> "$out/fuzz.log" || {
  tail -n 40 "$out/fuzz.log"
  echo "fuzz: FAILED (crash input saved in $out/)"
  exit 1
}
grep -E "stat::number_of_executed_units|Done" "$out/fuzz.log" | tail -n 2
echo "fuzz: no crash"
