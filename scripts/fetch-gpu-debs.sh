#!/usr/bin/env bash
# Downloads into .debs/ the Debian 12 packages that scripts/gpu-check.sh unpacks (dpkg -x, no
# install) on a GPU machine that has nvcc but no MPI, OpenBLAS or Catch2 and no package mirror.
# Run it on a Debian 12 machine with apt sources; carry .debs/ (git-ignored, about 40 MB, 10 of
# them Boost for the rehearsal alone) to the GPU machine. `scripts/gpu-check.sh --emulated` unpacks
# the same files here, so a rehearsal proves them before GPU minutes are spent.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the build and the tests use directly.
PKGS=(mpich libmpich12 libmpich-dev libopenblas0 libopenblas0-pthread libopenblas-dev libopenblas-pthread-dev catch2)
# Boost.Context (headers and library) gives the emulated GPU (make CUDA=emu) its fibers. Only the
# rehearsal (gpu-check.sh --emulated) uses it; the GPU machine's check leaves these files packed.
EMU_PKGS=(libboost-context-dev libboost-context1.74-dev libboost-context1.74.0 libboost1.74-dev)
# Their shared-library dependencies that a CUDA image may lack (from `apt-cache depends`):
# mpiexec.hydra needs hwloc and slurm's client library, libmpich UCX (+ numa), OpenBLAS gfortran.
LIBS=(libhwloc15 libslurm38 libucx0 libnuma1 libgfortran5 libquadmath0 libudev1)
# Dependencies deliberately left out: base libraries every image has; UCX's InfiniBand transports
# (plugins it loads only if present); compilers, headers and tools the build does not use.
SKIP=(libc6 libstdc++6 libgcc-s1 gcc-12-base libibverbs1 librdmacm1 ibverbs-providers hwloc hwloc-nox
      g++ gfortran gfortran-12 libhwloc-dev libucx-dev
      # Boost.Context's fibers neither include nor link Boost.Thread (Debian's -dev package depends
      # on it for CMake's sake); libstdc++-12-dev comes with the g++ that compiles everything.
      libboost-thread1.74-dev libstdc++-12-dev)

# Check that the lists above still cover every dependency apt reports (an alternative group
# "a | b" is covered by any of its members).
known=" ${PKGS[*]} ${EMU_PKGS[*]} ${LIBS[*]} ${SKIP[*]} "
missing=0
for p in "${PKGS[@]}" "${EMU_PKGS[@]}" "${LIBS[@]}"; do
  groups=$(apt-cache depends --no-recommends --no-suggests --no-enhances --no-conflicts --no-breaks --no-replaces "$p" |
           awk '/Depends:/ { g = g (g ? " " : "") $2; if ($1 !~ /^\|/) { print g; g = "" } }')
  while read -r group; do
    [ -z "$group" ] && continue
    covered=0
    for d in $group; do case "$known" in *" $d "*) covered=1 ;; esac; done
    [ $covered -eq 0 ] && { echo "warning: $p depends on ($group), none of which is fetched or skipped" >&2; missing=1; }
  done <<<"$groups"
done

rm -rf .debs
mkdir -p .debs
(cd .debs && apt-get download "${PKGS[@]}" "${EMU_PKGS[@]}" "${LIBS[@]}")
echo "$(du -sh .debs | cut -f1) in .debs/"
exit $missing
