#!/usr/bin/env bash
# A second build with nothing changed compiles nothing: make keeps every object it built on the way
# to a binary (.SECONDARY), so `make -q` finds all of `make test`'s targets up to date.
set -u
BUILD=${BUILD:-build}
targets=(all "$BUILD/tests/comm_error_prog" "$BUILD/tests/gpu_probe")
for src in tests/test_*.cpp; do targets+=("$BUILD/tests/$(basename "$src" .cpp)"); done
# Outside make's own job server and flags, as a user typing the command again would be.
mk=(env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make --no-print-directory BUILD="$BUILD" ${CUDA:+CUDA=$CUDA})
if "${mk[@]}" -q "${targets[@]}"; then echo "nothing to rebuild"; exit 0; fi
echo "a second build would run:"
"${mk[@]}" -n "${targets[@]}" | grep -v 'is up to date\|Nothing to be done'
exit 1
