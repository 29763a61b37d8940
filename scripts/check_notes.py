#!/usr/bin/env python3
"""Re-runs the commands quoted in the notes and the README and compares what they print now with
the excerpt that follows each one.

An excerpt is a line "$ COMMAND" (in a ``` block or an indented block) followed by the lines it
printed, up to the next "$ " line, the end of the block or a blank line; a line "..." stands for
lines left out. Every other excerpt line must appear in the output, in order. Numbers are compared
by kind, since the excerpts were printed on one machine and are re-run on any other:
  * times, rates and what is measured with a clock (tok/s, GFLOP/s, ms, ETA, MFU, hidden
    fraction, the bubble measured, thread counts) are not compared at all;
  * bytes (B, KiB, MiB, GiB, bytes) and integers (steps, counts, ranks) must be equal as written;
  * every other number with a decimal point or an exponent (losses, norms, learning rates,
    ratios) within a relative REL_BOUND of the excerpt's value, or half a unit of its last
    printed digit: another sgemm kernel sums in another order, and over a run's steps AdamW
    carries that rounding into the weights (see "What equal to 01 means" in
    notes/00_architecture.md). Under four OpenBLAS kernels the excerpts `make test` checks
    differ by at most 2e-7 (a last printed digit); 1e-4 leaves room for the long excerpts,
    whose extra steps carry the rounding further, and still catches any change a reader would
    see in a loss curve.
Commands are run from the repository root with ./build/ replaced by --build.

A command quoted without its output (a "./build/…" or "mpirun …" line in a ``` block, or in the
opening comment of a technique's .cu file) must run as written: it is run in a scratch directory
and must exit 0.

  scripts/check_notes.py [--build DIR] [--quick] [FILE ...]   (default: README.md notes/*.md 0*.cu)

--quick skips excerpts that train more than 50 steps, and runs the quoted commands for at most 3
steps (make test runs it with --quick).
"""
import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

# Fields whose value depends on the machine or the moment (times and rates), masked before comparing.
UNSTABLE = [
    (re.compile(r"[\d.]+ tok/s"), "# tok/s"),
    (re.compile(r"MFU +[\d.]+%"), "MFU #%"),
    (re.compile(r"[\d.]+ [GT]FLOP/s"), "# GFLOP/s"),
    (re.compile(r"[\d.]+ ms\b"), "# ms"),
    (re.compile(r"(ETA|took) \S+"), r"\1 #"),
    (re.compile(r"median [\d.]+ tokens/s"), "median # tokens/s"),
    (re.compile(r"hidden behind backward: [\d.]+%"), "hidden behind backward: #%"),
    (re.compile(r"^threads: .*"), "threads: #"),
]

REL_BOUND = 1e-4
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
BYTES = re.compile(r"^\s*(?:B|KiB|MiB|GiB|TiB|bytes)\b")


def mask(line):
    line = " ".join(line.split())
    for pattern, repl in UNSTABLE:
        line = pattern.sub(repl, line)
    return line


def numbers(line):
    """The line with every number replaced by #, and the numbers with their kinds."""
    found = []
    for m in NUMBER.finditer(line):
        text = m.group(0)
        exact = not re.search(r"[.eE]", text) or BYTES.match(line[m.end():]) is not None
        found.append((text, exact))
    return NUMBER.sub("#", line), found


def close(want, got):
    """Whether a printed number matches the excerpt's, by its kind."""
    (w, exact), (g, _) = want, got
    if exact:
        return w == g
    a, b = float(w), float(g)
    decimals = len(w.split("e")[0].split("E")[0].split(".")[1]) if "." in w else 0
    exponent = int(re.split(r"[eE]", w)[1]) if re.search(r"[eE]", w) else 0
    half_digit = 0.5 * 10.0 ** (exponent - decimals)
    ok = abs(a - b) <= max(REL_BOUND * abs(a), half_digit)
    if ok and a != 0:
        WORST[0] = max(WORST[0], abs(a - b) / abs(a))
    return ok


WORST = [0.0]  # the largest relative difference of a number that matched, for the summary line


def same_line(want, got):
    """Whether an output line (masked) shows what an excerpt line (masked) shows."""
    if want == got:
        return True
    (ws, wn), (gs, gn) = numbers(want), numbers(got)
    return ws == gs and len(wn) == len(gn) and all(close(a, b) for a, b in zip(wn, gn))


def excerpts(path):
    """(line number, command, expected lines) for every "$ " excerpt of a markdown file."""
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)\$ (.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, command, start = len(m.group(1)), m.group(2).strip(), i + 1
        expected = []
        i += 1
        while i < len(lines):
            line = lines[i]
            if line.strip().startswith("```") or re.match(r"^\s*\$ ", line) or not line.strip():
                break
            if len(line) - len(line.lstrip()) < indent:
                break
            expected.append(line.strip())
            i += 1
        found.append((start, command, expected))
    return found


def quoted_commands(path):
    """(line number, command) for every command quoted without output: in a .cu file the lines of
    its opening // comment, in a markdown file the lines of its ``` blocks, that start with
    "./build/" or "mpirun " (a trailing backslash continues the command on the next line)."""
    lines = open(path, encoding="utf-8").read().split("\n")
    cu = path.endswith(".cu")
    found, in_block, i = [], False, 0
    while i < len(lines):
        line = lines[i]
        if cu and not line.startswith("//"):
            break  # the opening comment ends here
        text = line[2:].strip() if cu else line.strip()
        if not cu and text.startswith("```"):
            in_block = not in_block
        elif (cu or in_block) and re.match(r"^(\./build/|mpirun )", text):
            start, command = i + 1, text
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1].rstrip() + " " + (lines[i][2:] if cu else lines[i]).strip()
            found.append((start, command))
        i += 1
    return found


def run_quoted(command, build, quick, env):
    """Runs a quoted command in a scratch directory; the output when it fails, else None."""
    cmd = shlex.join(shlex.split(command, comments=True))  # without a trailing "# comment"
    cmd = cmd.replace("./build/", os.path.abspath(build) + "/")
    if quick and steps_of(command) > 3:  # starts, validates and trains: the rest is the full check's
        cmd = re.sub(r"--steps \d+", "--steps 3", cmd) if "--steps" in cmd else cmd + " --steps 3"
    if "--device" not in cmd:
        cmd += " --device cpu"
    with tempfile.TemporaryDirectory() as scratch:
        out = subprocess.run(cmd, shell=True, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    return None if out.returncode == 0 else f"exit {out.returncode}\n{out.stdout}{out.stderr}"


def runnable(command):
    words = shlex.split(command)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value before the command: the shell sets it for the run
    if words and words[0] == "mpirun":
        words = words[3:] if len(words) > 3 and words[1] == "-np" else []
    return bool(words) and words[0].startswith("./build/")


def steps_of(command):
    m = re.search(r"--steps (\d+)", command)
    return int(m.group(1)) if m else 50  # the default


def in_order(expected, output):
    """The first excerpt line not found in order in the output, or None."""
    got = [mask(l) for l in output.split("\n")]
    k = 0
    for want in expected:
        if want == "...":
            continue
        w = mask(want)
        while k < len(got) and not same_line(w, got[k]):
            k += 1
        if k == len(got):
            return want
        k += 1
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = args.files or ["README.md"] + sorted(glob.glob("notes/*.md")) + sorted(glob.glob("0[1-8]_*.cu"))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    checked = failed = skipped = 0
    for path in files:
        for lineno, command in quoted_commands(path):
            if not runnable(command):
                continue
            checked += 1
            problem = run_quoted(command, args.build, args.quick, env)
            if problem is not None:
                failed += 1
                print(f"{path}:{lineno}: {command}\n  does not run as written: " + problem.replace("\n", "\n    "))
        for lineno, command, expected in excerpts(path):
            if not runnable(command) or not expected:
                continue
            if args.quick and steps_of(command) > 50 and "--dry-run" not in command:
                skipped += 1
                continue
            cmd = command.replace("./build/", args.build.rstrip("/") + "/")
            if "--device" not in cmd:
                cmd += " --device cpu"  # the excerpts are CPU runs
            out = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True, timeout=600)
            checked += 1
            missing = in_order(expected, out.stdout + out.stderr)
            if missing is not None:
                failed += 1
                print(f"{path}:{lineno}: $ {command}\n  this excerpt line is not in the output (in order):\n    {missing}")
                print("  output:\n" + "\n".join("    " + l for l in (out.stdout + out.stderr).split("\n")))
    print(f"{checked} excerpts checked, {failed} differ" + (f", {skipped} long runs skipped (--quick)" if skipped else "") +
          f"; numbers within {WORST[0]:.1e} relative (bound {REL_BOUND:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
