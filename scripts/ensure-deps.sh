#!/usr/bin/env bash
# Installs the Debian packages the build and tests need when they are missing (as root), or prints
# the exact command and stops (otherwise). Silent and fast when everything is present.
set -euo pipefail
missing=()
# The status is compared as a string, not piped to grep -q: under pipefail the pipe fails when
# grep exits first and dpkg-query dies of SIGPIPE, and an installed package would count as missing.
have() { [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) == *"install ok installed"* ]]; }
# libboost-context-dev gives the emulated GPU (make CUDA=emu) its fibers; python3-matplotlib draws the pictures (scripts/plot.py, make demo) for /usr/bin/python3.
for p in mpich libmpich-dev catch2 libopenblas-dev libboost-context-dev python3-matplotlib clang libclang-rt-dev; do have "$p" || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  echo "installing missing packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  $cmd >/dev/null
else
  echo "missing packages: ${missing[*]}" >&2
  echo "run: sudo apt-get update && sudo $cmd" >&2
  exit 1
fi
