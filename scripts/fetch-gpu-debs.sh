#!/usr/bin/env bash
# Downloads into .debs/ the Debian 12 packages that scripts/gpu-check.sh unpacks (dpkg -x, no
# install) on a GPU machine that has nvcc but no MPI, OpenBLAS or Catch2 and no package mirror.
# Run it on a Debian 12 machine with apt sources; carry .debs/ (git-ignored) to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the build and the tests use directly.
PKGS=(mpich libmpich12 libmpich-dev libopenblas0 libopenblas0-pthread libopenblas-dev libopenblas-pthread-dev catch2)
# Their shared-library dependencies that a CUDA image may lack (from `apt-cache depends`):
# mpiexec.hydra needs hwloc and slurm's client library, libmpich UCX (+ numa), OpenBLAS gfortran.
LIBS=(libhwloc15 libslurm38 libucx0 libnuma1 libgfortran5 libquadmath0 libudev1)
# Dependencies deliberately left out: base libraries every image has; UCX's InfiniBand transports
# (plugins it loads only if present); compilers, headers and tools the build does not use.
SKIP=(libc6 libstdc++6 libgcc-s1 gcc-12-base libibverbs1 librdmacm1 ibverbs-providers hwloc hwloc-nox
      g++ gfortran gfortran-12 libhwloc-dev libucx-dev)

# Check that the lists above still cover every dependency apt reports (an alternative group
# "a | b" is covered by any of its members).
known=" ${PKGS[*]} ${LIBS[*]} ${SKIP[*]} "
missing=0
for p in "${PKGS[@]}" "${LIBS[@]}"; do
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
(cd .debs && apt-get download "${PKGS[@]}" "${LIBS[@]}")
echo "$(du -sh .debs | cut -f1) in .debs/"
exit $missing
