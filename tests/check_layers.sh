#!/usr/bin/env bash
# common/'s layers depend one way (scripts/check_layers.py; notes/00_architecture.md, "A reader's
# map"), and the check would see it if they did not: on a copy of common/, a seeded include from a
# lower layer up into a higher one, an include that does not name its layer, and a cycle between
# two layers' "Uses:" lines must each be refused.
set -u
py=$(command -v python3 || echo /usr/bin/python3)
"$py" scripts/check_layers.py || exit 1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
seeded() {  # NAME, then a command that breaks the copy in $tmp/common
  local name=$1; shift
  rm -rf "$tmp/common" && cp -r common "$tmp/common" && (cd "$tmp" && eval "$*")
  if out=$("$py" scripts/check_layers.py --root "$tmp" 2>&1); then
    echo "seeded $name: not refused"; echo "$out"; exit 1
  fi
  echo "seeded $name: refused ($(echo "$out" | head -1))"
}
seeded "upward include" "sed -i '1a #include \"training/train.h\"' common/kernels/kernels.cu"
seeded "include without its layer" "sed -i '1a #include \"core.h\"' common/comm/mesh.cu"
seeded "cycle" "sed -i 's/^Uses: nothing/Uses: training/' common/tensor/README.md"
