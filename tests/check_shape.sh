#!/usr/bin/env bash
# The project's shape: no function over 80 lines (CUDA kernels aside), technique mains of at most
# 20, no test switch in the code a reader reads, chapter dependencies one way (from the .d files).
exec python3 scripts/check_shape.py --build "${BUILD:-build}"
