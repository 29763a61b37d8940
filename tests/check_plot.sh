#!/usr/bin/env bash
# scripts/plot.py draws real logs (and, last, a --memory-timeline): 01 and 02 (dp 2) at the same global batch, overlaid, into a PNG
# of the size it asks for (16 × 4.8 in at 80 dpi = 1280 × 384 px), with 01's held-out loss
# (--eval-every 3 over 6 steps: after steps 2 and 5) as dots; then a run with --numerics-every and
# a poisoned batch, whose second row (per-unit norms, spikes) doubles the height.
set -eu
BUILD=${BUILD:-build}
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
args="--preset tiny --steps 6 --batch 8 --quiet --device cpu"
"$BUILD/01_single_gpu" $args --eval-every 3 --log-json "$d/01.jsonl" >/dev/null
mpirun -np 2 "$BUILD/02_data_parallel" $args --dp 2 --log-json "$d/02.jsonl" >/dev/null
out=$(/usr/bin/python3 scripts/plot.py "$d/01.jsonl" "$d/02.jsonl" --labels 01,02 -o "$d/runs.png")
echo "$out"
[ "$out" = "wrote $d/runs.png; eval points: 01 2" ] || { echo "expected 2 eval points for 01 and 02 not named"; exit 1; }
/usr/bin/python3 - "$d/runs.png" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
w, h = struct.unpack(">II", data[16:24])  # the IHDR chunk's width and height
assert (w, h) == (1280, 384), f"{w} x {h}"
assert len(data) > 20000, f"only {len(data)} bytes: an empty figure?"
print(f"PNG {w} x {h}, {len(data)} bytes")
PY
"$BUILD/01_single_gpu" --preset tiny --steps 10 --batch 8 --quiet --device cpu --numerics-every 2 --spike-window 4 \
  --poison-batch 7 --log-json "$d/spike.jsonl" >/dev/null
out=$(/usr/bin/python3 scripts/plot.py "$d/spike.jsonl" --labels poisoned -o "$d/numerics.png")
echo "$out"
[ "$out" = "wrote $d/numerics.png; spikes: poisoned 1" ] || { echo "expected one spike for the poisoned run"; exit 1; }
/usr/bin/python3 - "$d/numerics.png" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
w, h = struct.unpack(">II", data[16:24])
assert (w, h) == (1280, 768), f"{w} x {h}: no numerics row?"
print(f"PNG {w} x {h}, {len(data)} bytes")
PY
# --memory-timeline's picture: step 0 peaks below step 1 by the moments AdamW allocates at its first
# update (8Ψ = 952,832 B for the tiny model; notes/01), each peak inside the last layer's backward.
"$BUILD/01_single_gpu" --preset tiny --steps 2 --micro-batch 4 --quiet --device cpu --memory-timeline "$d/t.csv" >/dev/null
out=$(/usr/bin/python3 scripts/plot.py --timeline "$d/t.csv" -o "$d/timeline.png")
echo "$out"
[ "$out" = "wrote $d/timeline.png; step 0 peak 2254464 B at backward unit 2; step 1 peak 3207296 B at backward unit 2" ] ||
  { echo "expected the first-step anomaly's two peaks"; exit 1; }
