#!/usr/bin/env python3
"""The tensor-parallel communication a --trace file shows, per rank and step: the time the rank was
blocked in it (exposed: 04's collectives and async TP's "tp wait" on the comm lane) and the time
async TP's ring transfers were in flight (the "comm 2" lane, beside the GEMMs they overlap).

  scripts/trace_tp.py TRACE.json STEPS

"f and g" is the part 04a_async_tp.cu changes: 04's "tp all_gather (f)" (the forward's, and
backward's rebuilding ones, which both keep) and "tp reduce_scatter (g)", against async TP's
rebuilding all-gathers and its "tp wait" for the rings (notes/04_tensor_parallel.md).
"""
import json
import sys
from collections import defaultdict

COMPUTE, COMM, COMM2 = 0, 1, 2


def main():
    path, steps = sys.argv[1], int(sys.argv[2])
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    tally = defaultdict(lambda: defaultdict(float))  # rank -> what -> microseconds
    for e in events:
        name, rank, lane, dur = e["name"], e["pid"], e["tid"], e["dur"]
        t = tally[rank]
        if lane == COMM and name.startswith("tp "):
            t["exposed"] += dur
            if name in ("tp all_gather (f)", "tp reduce_scatter (g)") or name.startswith("tp wait ("):
                t["forward"] += dur
        elif lane == COMM2 and "ring (" in name:
            t["ring"] += dur
        elif lane == COMPUTE and (name.startswith("fwd ") or name.startswith("bwd ") or name.startswith("head ")):
            t["compute"] += dur
    print("rank  exposed tp comm     of it f and g   ring transfers in flight   (ms per step)")
    for rank in sorted(tally):
        t = tally[rank]
        print(f"{rank:4d}  {t['exposed'] / 1e3 / steps:10.2f} ms   {t['forward'] / 1e3 / steps:12.2f} ms   "
              f"{t['ring'] / 1e3 / steps:18.2f} ms")


if __name__ == "__main__":
    main()
