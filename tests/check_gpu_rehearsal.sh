#!/usr/bin/env bash
# The GPU check rehearsed here (scripts/gpu-check.sh --emulated), so that a 15-minute GPU lease is
# not where we learn that the check cannot find its packages, build, or parse its own results:
#  1. with Catch2 and Boost's headers taken out of the carried packages, the check must stop at its
#     dependency list and name both, although this machine has them installed (the rehearsal looks
#     in the unpacked prefix alone, as the GPU machine, which has none, must);
#  2. then every step of the check, end to end, on the emulated GPU (make CUDA=emu, one emulated
#     GPU) against the unpacked .debs/ only; each step's row must say ok, with its number.
# For time (about 5 minutes from a cold build on 2 cores, 1 when built), its tests step runs the
# [cuda] cases of the cheap programs named below, not test_emu_chapters (~70 s) and test_single:
# `scripts/gpu-check.sh --emulated` runs them all.
# Needs .debs/ (scripts/fetch-gpu-debs.sh, run here when .debs/ is absent) and dpkg; without them
# this check fails, and says which.
set -u
cd "$(dirname "$0")/.." || exit 1
TESTS="test_attention_merge test_comm test_fp8 test_moe"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail() { echo "check_gpu_rehearsal: $*"; exit 1; }

command -v dpkg >/dev/null || fail "no dpkg here: the rehearsal unpacks .debs/ with dpkg -x"
if ! ls .debs/*.deb >/dev/null 2>&1; then
  echo "no .debs/: scripts/fetch-gpu-debs.sh"
  scripts/fetch-gpu-debs.sh >"$d/fetch.log" 2>&1 || { tail -n 20 "$d/fetch.log"; fail "no .debs/, and scripts/fetch-gpu-debs.sh failed (above)"; }
fi

# 1. The dependency check sees only the prefix.
mkdir "$d/debs"
for f in .debs/*.deb; do
  case $(basename "$f") in catch2_* | libboost1.74-dev_*) ;; *) ln -s "$(realpath "$f")" "$d/debs/" ;; esac
done
compgen -G '.debs/catch2_*.deb' >/dev/null && compgen -G '.debs/libboost1.74-dev_*.deb' >/dev/null ||
  fail ".debs/ lacks catch2 or libboost1.74-dev: run scripts/fetch-gpu-debs.sh again"
out=$(GPU_CHECK_DEBS="$d/debs" GPU_CHECK_BUILD="$d/build" scripts/gpu-check.sh --emulated --deps-only 2>&1)
rc=$?
echo "$out"
[ $rc -ne 0 ] || fail "the rehearsal's dependency check passed without Catch2 and Boost in the packages: it found this machine's copies"
grep -q 'Catch2' <<<"$out" && grep -q 'Boost.Context headers' <<<"$out" ||
  fail "the dependency check failed, but did not name both Catch2 and Boost.Context's headers"

# 2. The rehearsal itself.
OUT="$d/out" GPU_CHECK_EMULATED=1 GPU_CHECK_TESTS="$TESTS" scripts/gpu-check.sh
rc=$?
s="$d/out/summary.txt"
[ -s "$s" ] || fail "the rehearsal wrote no summary (exit $rc)"
steps="deps build prefix gpu_probe cuda_twins bench_small 01_tiny_cpu 01_tiny_cuda 01_tiny_vs_cpu 01_tiny_bf16 tests"
bad=""
for step in $steps; do
  grep -qE "^$step +ok +[0-9]+ +[^ ]" "$s" && continue
  bad+=" $step"
  # The step's own log, from the archive the check leaves.
  tar -xzf "$d/out/logs.tar.gz" -C "$d/out" "./$step.log" 2>/dev/null && { echo "--- $step.log"; tail -n 40 "$d/out/$step.log"; }
done
[ -z "$bad" ] || fail "steps not ok:$bad ($(grep -E '^(build|tests) ' "$s" | sed -E 's/ +/ /g' | paste -sd ';'))"
[ $rc -eq 0 ] || fail "the rehearsal exited $rc with every step ok"
n=$(wc -w <<<"$steps")
echo "the GPU check rehearsed: $n of $n steps ok on the emulated GPU against .debs/ alone, $(grep -m1 '^total' "$s")"
