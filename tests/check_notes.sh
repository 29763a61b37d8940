#!/usr/bin/env bash
# Every "$ command" excerpt in README.md and notes/ is what the current build prints (the stable
# fields); the long training runs are left to `scripts/check_notes.py` without --quick.
exec python3 scripts/check_notes.py --build "${BUILD:-build}" --quick
