#!/usr/bin/env bash
# Runs every libFuzzer target in $BUILD/fuzz for FUZZ_SECONDS each, from its seed corpus in
# fuzz/corpus/NAME (read only: new inputs go to a scratch corpus under the build). Prints one line
# per target, "ok   fuzz NAME: ..." or "FAIL fuzz NAME: ...", with the inputs tried and the clean
# errors; a crash or a hang (one input over 10 s) fails it, the input kept in $BUILD/fuzz/.
set -u
BUILD=${BUILD:-build}
SECS=${FUZZ_SECONDS:-60}
status=0
for bin in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin"); name=${name#fuzz_}
  scratch="$BUILD/fuzz/corpus/$name"; mkdir -p "$scratch"
  log=$(mktemp)
  "$bin" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$BUILD/fuzz/$name-" "$scratch" "fuzz/corpus/$name" >"$log" 2>&1
  rc=$?
  counts=$(grep -m1 -E "^fuzz_$name: [0-9]+ inputs" "$log" | sed "s/^fuzz_$name: //")
  if [ $rc -eq 0 ] && [ -n "$counts" ]; then
    echo "ok   fuzz $name: ${SECS}s, $counts, 0 crashes, 0 hangs"
  else
    echo "FAIL fuzz $name (exit $rc):"
    grep -E "ERROR|SUMMARY|timeout|Test unit written|deadly signal" "$log" | head -20 | sed 's/^/    /'
    status=1
  fi
  rm -f "$log"
done
exit $status
