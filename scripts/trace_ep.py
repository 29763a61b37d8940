#!/usr/bin/env python3
"""The expert all-to-all a --trace file of 07 shows, per rank and step: the time the rank was blocked
in it (exposed: 07's "ep all_to_all_v (dispatch|combine ...)" on the comm lane, or --overlap-a2a's
"ep wait (...)"), the counts' all-to-all (blocking in both), and the time --overlap-a2a's
all-to-alls were in flight (the "comm 2" lane, beside the other micro-batch's compute).

  scripts/trace_ep.py TRACE.json STEPS

notes/07_expert_parallel.md ("The all-to-all hidden under the other micro-batch") runs it.
"""
import json
import sys
from collections import defaultdict

COMM, COMM2 = 1, 2


def main():
    path, steps = sys.argv[1], int(sys.argv[2])
    tally = defaultdict(lambda: defaultdict(float))  # rank -> what -> microseconds
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") != "X":
            continue
        name, lane, t = e["name"], e["tid"], tally[e["pid"]]
        if lane == COMM and (name.startswith("ep all_to_all_v (") or name.startswith("ep wait (")):
            t["rows"] += e["dur"]
        elif lane == COMM and name == "ep all_to_all (counts)":
            t["counts"] += e["dur"]
        elif lane == COMM2 and name.endswith(" in flight"):
            t["flight"] += e["dur"]
    print("rank  exposed all-to-all (rows)   counts all-to-all   in flight   (ms per step)")
    for rank in sorted(tally):
        t = {k: v / 1e3 / steps for k, v in tally[rank].items()}
        print(f"{rank:4d}  {t.get('rows', 0):22.2f} ms   {t.get('counts', 0):14.2f} ms   {t.get('flight', 0):8.2f} ms")


if __name__ == "__main__":
    main()
