#!/usr/bin/env bash
# The project's shape (scripts/check_shape.py): no function over 80 lines (CUDA kernels aside),
# technique mains of at most 20, no test switch or injected fault in the code a reader reads, the
# reading tier (chapter line limits, the header lines each chapter pulls in, no frontier variant's
# code in 05 or 07, no chapter naming a lab file or what is read after it), chapter dependencies
# one way (from the .d files). And the check would see a break: on a copy of the tree, each seeded
# break below must be refused.
set -u
py=$(command -v python3 || echo /usr/bin/python3)
build=$(cd "${BUILD:-build}" && pwd)
"$py" scripts/check_shape.py --build "$build" || exit 1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
seeded() {  # NAME, WHAT the refusal says, then a command that breaks the copy in $tmp
  local name=$1 what=$2; shift 2
  rm -rf "$tmp"/* && cp -r common lab notes scripts 0[1-8]*_*.cu "$tmp"/ && (cd "$tmp" && eval "$*")
  if out=$("$py" "$tmp/scripts/check_shape.py" --root "$tmp" --build "$build" 2>&1); then
    echo "seeded $name: not refused"; echo "$out"; exit 1
  fi
  echo "$out" | grep -q "$what" || { echo "seeded $name: refused, but not for it:"; echo "$out"; exit 1; }
  echo "seeded $name: refused ($(echo "$out" | grep -m1 "$what"))"
}
seeded "DualPipeV in 05" "frontier variant's code" \
  "sed -i 's/^namespace pp {/namespace pp {\ninline bool is_dualpipev(int s) { return s == 4; }/' 05_pipeline_parallel.cu"
seeded "two-level dispatch in 07" "frontier variant's code" \
  "sed -i 's/^namespace ep {/namespace ep {\nstruct TwoLevelPlan {};/' 07_expert_parallel.cu"
seeded "a lab header in 02" "never names what is read after it" \
  "sed -i '0,/#include \"model\\/model.h\"/s//#include \"model\\/model.h\"\n#include \"lab\\/02_data_parallel.h\"/' 02_data_parallel.cu"
seeded "a chapter past its limit" "lines (a chapter reads in one sitting" \
  "for i in \$(seq 400); do echo '// padding' >> 03_zero.cu; done"
seeded "machinery on 04's include path" "include path holds" \
  "sed -i '0,/#include \"model\\/model.h\"/s//#include \"model\\/model.h\"\n#include \"training\\/step_time.h\"/' 04_tensor_parallel.cu"
seeded "an injected fault in comm/" "getenv" \
  "sed -i '0,/^namespace ts {/s//namespace ts {\nstatic bool stop_here() { return std::getenv(\"TS_STOP_HERE\") != nullptr; }/' common/comm/comm.cu"
