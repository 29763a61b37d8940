#!/usr/bin/env bash
# Installs PyTorch 2.x for the CPU into a virtual environment, for the training-step peer of
# `make bench` (bench/torch2_llama.py). Idempotent: does nothing when the venv already imports
# torch 2.x. Not run by make or CI.
#
#   scripts/torch-venv.sh                         # venv in build/torch-venv
#   TORCH_VENV=/opt/torch2 PYTHON=python3.12 scripts/torch-venv.sh
#   TORCH_SPEC='torch==2.9.1' scripts/torch-venv.sh
#
# The venv is made on a Python that is not Debian's /usr/bin/python3: Debian's python3-torch puts
# libtorch 1.13 in /usr/lib, and torch.compile's C++ link step can pick it up there. torch.compile
# also needs a C++ compiler (g++) and the interpreter's headers (Python.h).
#
# The PyPI wheel of torch for Linux x86-64 is the CUDA build and depends on several GB of
# nvidia-* wheels. Installing torch with --no-deps plus its pure-Python dependencies keeps the
# download to the torch wheel itself (1.2 GB installed); the CPU import still loads a few small
# CUDA libraries, installed below.
set -euo pipefail
cd "$(dirname "$0")/.."  # a relative TORCH_VENV is taken from the repository root, as make bench does
VENV=${TORCH_VENV:-build/torch-venv}
SPEC=${TORCH_SPEC:-torch>=2}

# torch's version when the venv imports torch 2.x; fails otherwise
works() {
  local v
  v=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) && [ "${v%%.*}" -ge 2 ] && echo "$v"
}
if [ -x "$VENV/bin/python" ] && v=$(works); then
  echo "$VENV: torch $v already installed"
  exit 0
fi

# The interpreter: $PYTHON, else the first python3 on PATH that is not Debian's.
pick_python() {
  local p
  if [ -n "${PYTHON:-}" ]; then command -v "$PYTHON"; return; fi
  for p in $(type -ap python3 python3.13 python3.12 python3.11 python3.10); do
    case "$(readlink -f "$p")" in /usr/bin/*|/bin/*) continue ;; esac
    echo "$p"; return
  done
}
PY=$(pick_python || true)
if [ -z "$PY" ]; then
  echo "no Python other than Debian's /usr/bin/python3 found; install one (pyenv, uv, conda) and" >&2
  echo "run again with PYTHON=/path/to/python3" >&2
  exit 1
fi
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$inc/Python.h" ] || { echo "$PY has no headers ($inc/Python.h): torch.compile cannot build its modules" >&2; exit 1; }
command -v g++ >/dev/null || { echo "torch.compile needs a C++ compiler: install g++" >&2; exit 1; }
echo "python: $PY ($("$PY" --version 2>&1)), venv: $VENV"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install --quiet "$@"; }
pip --no-deps "$SPEC"
reqs() {  # torch's requirements (from its wheel's metadata) that $1 selects
  "$VENV/bin/python" -c 'import sys; from importlib.metadata import requires
for r in requires("torch") or []:
    if eval(sys.argv[1]): print(r.split(";")[0].replace(" ", ""))' "$1"
}
# Its pure-Python dependencies are the requirements without an environment marker (filelock,
# typing-extensions, setuptools, sympy, networkx, jinja2, fsspec; pip adds mpmath and MarkupSafe);
# numpy is optional, and torch warns at import without it.
mapfile -t pure < <(reqs '";" not in r')
echo "pip will list the CUDA wheels left out as unmet requirements of torch: expected"
pip "${pure[@]}" numpy
# The CUDA libraries that the CPU import loads, at the versions torch pins: NCCL (from the wheel,
# not a system libnccl that a CUDA toolkit may have put on the library path: an older one lacks
# symbols libtorch_cuda needs), cuSPARSELt, NVSHMEM and cuFile (named by the cuda-toolkit extra
# from CUDA 13 on, so unpinned when torch does not name it).
mapfile -t libs < <(reqs 'r.startswith(("nvidia-nccl", "nvidia-cusparselt", "nvidia-nvshmem", "nvidia-cufile"))')
[[ " ${libs[*]} " == *nvidia-cufile* ]] || libs+=(nvidia-cufile)
pip --no-deps "${libs[@]}"
v=$(works) || { echo "torch in $VENV is not importable" >&2; exit 1; }
echo "torch $v in $VENV (make bench looks in build/torch-venv, or in \$TORCH_VENV)"
