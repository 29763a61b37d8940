#!/usr/bin/python3
"""Draws what --log-json files recorded: the loss curves of several runs on one plot with the
data's loss floor (and the held-out loss of runs with --eval-every, as dots on their curve's colour), each run's memory per category measured next to predicted, and throughput.
Runs with --numerics-every get a second row: each unit's gradient norm and output RMS over the
steps, and the gradient norm with the spikes and rewinds the run logged.

  /usr/bin/python3 scripts/plot.py RUN.jsonl [RUN.jsonl ...] [-o runs.png] [--labels a,b,...]
  /usr/bin/python3 scripts/plot.py --timeline TIMELINE.csv [-o memory.png]

--timeline draws a run's --memory-timeline file instead: the playbook's chapter-1 picture, each
category's bytes in use stacked over every allocation and free, the first step beside the second,
each step's peak marked with its phase (forward unit k, backward unit k, optimizer).

Runs of different techniques at the same global batch lie on one loss curve (the equivalence the
tests prove); their memory bars show where each technique saves. Needs Debian's python3-matplotlib
(`make deps` installs it), hence /usr/bin/python3 rather than the first python3 on PATH.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

CATEGORIES = ["params", "grads", "optimizer", "activations", "comm", "workspace"]


def read_log(path):
    """The step records, the summary, and the events (spikes, rewinds, a non-finite step)."""
    steps, summary, events = [], {}, []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            j = json.loads(line)
            if "summary" in j:
                summary = j["summary"]
            elif "event" in j:
                events.append(j)
            else:
                steps.append(j)
    if not steps:
        sys.exit(f"{path}: no step records (is it a --log-json file?)")
    return steps, summary, events


def tail_inset(ax, runs, floors):
    """The last half of the steps magnified in the plot's upper right, where the falling curve has
    left room: on the full axis the last few hundredths of a nat to the floor are invisible. A run
    too short to have fallen (its curve still in the upper right) gets none: it has no tail."""
    low, high = ax.get_ylim()
    later = [s["loss"] for _, steps, _ in runs for s in steps[int(0.4 * len(steps)):]]
    if not later or max(later) > low + 0.38 * (high - low):
        return
    inset = ax.inset_axes([0.42, 0.42, 0.55, 0.5])
    lows, highs, gap = [], [], None
    for k, (label, steps, _) in enumerate(runs):
        tail = steps[len(steps) // 2:]
        losses = [s["loss"] for s in tail]
        inset.plot([s["step"] for s in tail], losses, color=f"C{k}", linewidth=0.8)
        lows.append(min(losses))
        highs.append(max(losses))
        if k == 0 and floors:  # the mean of the last 2% of steps: one step's loss is noisy
            last = losses[-max(1, len(steps) // 50):]
            gap = sum(last) / len(last) - min(floors)
    for f in floors:
        inset.axhline(f, color="black", linestyle=":", linewidth=1)
        lows.append(f)
    pad = 0.05 * max(1e-6, max(highs) - min(lows))
    inset.set_ylim(min(lows) - pad, max(highs) + pad)
    inset.tick_params(labelsize=7)
    title = "last half" + (f": ends {gap:.3f} nats above the floor" if gap is not None else "")
    inset.set_title(title, fontsize=7)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="*", help="--log-json files")
    ap.add_argument("-o", "--output", default="runs.png")
    ap.add_argument("--labels", help="comma-separated names, one per log (default: the file names)")
    ap.add_argument("--timeline", help="a --memory-timeline file: draw memory over one step instead")
    args = ap.parse_args()
    if args.timeline:
        return timeline_figure(args.timeline, args.output)
    if not args.logs:
        sys.exit("give --log-json files, or --timeline FILE")
    labels = args.labels.split(",") if args.labels else [os.path.basename(p).rsplit(".", 1)[0] for p in args.logs]
    if len(labels) != len(args.logs):
        sys.exit(f"--labels names {len(labels)} runs but {len(args.logs)} logs were given")
    logs = [(label, *read_log(p)) for label, p in zip(labels, args.logs)]
    runs = [(label, steps, summary) for label, steps, summary, _ in logs]
    numerics = any("numerics" in s for _, steps, _, _ in logs for s in steps)

    fig, axes = plt.subplots(2 if numerics else 1, 3, figsize=(16, 9.6 if numerics else 4.8), squeeze=False)
    ax_loss, ax_mem, ax_tps = axes[0]

    # Later runs are drawn thinner and dashed so that curves that coincide stay visible.
    floors = set()
    for k, (label, steps, summary) in enumerate(runs):
        ax_loss.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=label, color=f"C{k}",
                     linewidth=max(0.8, 2.4 - 0.6 * k), linestyle="-" if k == 0 else (0, (4, 2 + k)))
        evals = [s for s in steps if s.get("eval_loss") is not None]
        if evals:
            ax_loss.plot([s["step"] for s in evals], [s["eval_loss"] for s in evals], label=f"{label} eval (held out)",
                         color=f"C{k}", marker="o", markersize=4, linestyle=":", linewidth=1)
        if summary.get("loss_floor") is not None:
            floors.add(round(summary["loss_floor"], 6))
    for f in sorted(floors):  # named in the legend, so no label sits on the curve
        ax_loss.axhline(f, color="black", linestyle=":", linewidth=1, label=f"loss floor {f:.4f}")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)")
    # Above the plot, where no curve can pass under it (the legend is the panel's title).
    ax_loss.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.01), ncol=3, frameon=False, borderaxespad=0)
    tail_inset(ax_loss, runs, floors)

    # Memory: per category, two bars per run side by side: measured (solid), predicted (hatched;
    # comm and workspace have none).
    width = 0.8 / max(1, 2 * len(runs))
    for k, (label, _, summary) in enumerate(runs):
        mem = summary.get("memory", {})
        xs = [i + (2 * k - (2 * len(runs) - 1) / 2) * width for i in range(len(CATEGORIES))]
        measured = [mem.get(c, {}).get("measured", 0) / 2**20 for c in CATEGORIES]
        predicted = [mem.get(c, {}).get("predicted", 0) / 2**20 for c in CATEGORIES]
        ax_mem.bar(xs, measured, width * 0.95, color=f"C{k}", label=f"{label} measured")
        ax_mem.bar([x + width for x in xs], predicted, width * 0.95, fill=False, hatch="//", edgecolor=f"C{k}",
                   label=f"{label} predicted")
    ax_mem.set_xticks(range(len(CATEGORIES)), CATEGORIES, fontsize=8)
    ax_mem.set(title="memory per category (rank 0 peak)", ylabel="MiB")
    ax_mem.legend(fontsize=7)

    # A running median over 1% of the steps: single steps on a shared machine are noisy.
    for k, (label, steps, _) in enumerate(runs):
        tps = [s["tokens_per_s"] for s in steps]
        h = max(1, len(tps) // 200)
        smooth = [sorted(tps[max(0, i - h):i + h + 1])[len(tps[max(0, i - h):i + h + 1]) // 2] for i in range(len(tps))]
        ax_tps.plot([s["step"] for s in steps], smooth, label=label, color=f"C{k}", linewidth=1)
    ax_tps.set(title="throughput (running median)", xlabel="step", ylabel="tokens/s (whole job)")
    ax_tps.legend(fontsize=8)

    if numerics:
        numerics_row(axes[1], logs)
    fig.tight_layout()
    fig.savefig(args.output, dpi=80)
    evals = [(label, sum("eval_loss" in s for s in steps)) for label, steps, _ in runs]
    evals = ", ".join(f"{label} {n}" for label, n in evals if n)  # only the runs that have some
    spikes = ", ".join(f"{label} {n}" for label, n in
                       [(label, sum(e["event"] == "spike" for e in ev)) for label, _, _, ev in logs] if n)
    print(f"wrote {args.output}" + (f"; eval points: {evals}" if evals else "") + (f"; spikes: {spikes}" if spikes else ""))


def numerics_row(row, logs):
    """Per-unit gradient norms and output RMS of the first run that recorded them (one line per
    unit: 0 the embedding, 1..L the layers, L+1 the head), and every run's gradient norm with its
    spikes (x) and rewinds (vertical lines)."""
    ax_gn, ax_rms, ax_ev = row
    label, steps = next((label, steps) for label, steps, _, _ in logs if any("numerics" in s for s in steps))
    rec = [s for s in steps if "numerics" in s]
    for name, ax in (("grad_norm", ax_gn), ("act_rms", ax_rms)):
        units = len(rec[0]["numerics"][name])
        for u in range(units):
            ax.plot([s["step"] for s in rec], [s["numerics"][name][u] for s in rec], color=plt.cm.viridis(u / units),
                    linewidth=1, label=f"unit {u}")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
    ax_gn.set(title=f"{label}: gradient norm per unit", xlabel="step")
    ax_rms.set(title=f"{label}: output RMS per unit (0: embedding)", xlabel="step")
    for k, (label, steps, _, events) in enumerate(logs):
        ax_ev.plot([s["step"] for s in steps], [s["grad_norm"] for s in steps], color=f"C{k}", linewidth=1, label=label)
        for e in events:
            if e["event"] == "spike":
                ax_ev.plot([e["step"]], [e["grad_norm"]], "x", color=f"C{k}", markersize=9)
            elif e["event"] == "rewind":
                ax_ev.axvline(e["step"], color=f"C{k}", linestyle=":", linewidth=1)
    ax_ev.set_yscale("log")
    ax_ev.set(title="gradient norm; x: spike, dotted: rewind", xlabel="step")
    ax_ev.legend(fontsize=8)


def read_timeline(path):
    """The events of the device that holds the run's tensors (cuda when any event is there)."""
    import csv
    with open(path) as f:
        rows = list(csv.DictReader(f))
    dev = "cuda" if any(r["device"] == "cuda" for r in rows) else "cpu"
    return [r for r in rows if r["device"] == dev], dev


def timeline_figure(path, output):
    """Stacked categories over the events of the first two steps (initialisation drawn with the
    first), each step's peak marked: the optimizer states appear at the first update only."""
    rows, dev = read_timeline(path)
    steps = sorted({int(r["step"]) for r in rows if int(r["step"]) >= 0})[:2]
    if not steps:
        sys.exit(f"{path}: no step recorded")
    fig, axes = plt.subplots(1, len(steps), figsize=(8 * len(steps), 4.8), squeeze=False, sharey=True)
    mib = 1024.0 * 1024.0
    said = []
    for ax, step in zip(axes[0], steps):
        part = [r for r in rows if int(r["step"]) == step or (step == steps[0] and int(r["step"]) < 0)]
        x = list(range(len(part)))
        ys = [[int(r[c]) / mib for r in part] for c in CATEGORIES]
        ax.stackplot(x, ys, labels=CATEGORIES, step="post")
        totals = [sum(int(r[c]) for c in CATEGORIES) for r in part]
        k = max(range(len(totals)), key=totals.__getitem__)
        ax.axvline(k, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"peak {totals[k] / mib:.2f} MiB\n{part[k]['phase']}", (k, totals[k] / mib),
                    xytext=(5, -25), textcoords="offset points", fontsize=8)
        last = None  # the first event of each phase family, as a tick on the x axis
        for i, r in enumerate(part):
            fam = r["phase"].split(" unit")[0]
            if fam != last and fam in ("forward", "backward", "optimizer"):
                ax.axvline(i, color="grey", linestyle=":", linewidth=0.8)
                ax.text(i, 0.98, " " + fam, rotation=90, fontsize=8, va="top", color="dimgrey",
                        transform=ax.get_xaxis_transform())
            last = fam
        ax.set(title=f"step {step}" + (" (with initialisation)" if step == steps[0] else ""),
               xlabel="allocation / free event", ylabel=f"MiB in use ({dev})")
        said.append(f"step {step} peak {totals[k]} B at {part[k]['phase']}")
    axes[0][0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=80)
    print(f"wrote {output}; " + "; ".join(said))


if __name__ == "__main__":
    main()
