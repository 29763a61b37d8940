#!/usr/bin/env python3
"""The shape the project keeps, checked: what a reader of one chapter file has to open.

  * no function longer than 80 lines in the technique files, 08_plan.h and common/ (CUDA
    kernels, `__global__`, excepted: a kernel is one unit of the GPU's work and reads as one);
  * every technique's main() at most 20 lines, its braces included: what the chapter decides (its
    flags, its objects, its step), the start-up sequence being training/start.h's;
  * no test switch ("seeded_bug", TS_BUG...) in the code a reader reads: tests inject their own;
  * notes/00's table of chapters ("How to read a chapter") gives each chapter's length as it is;
  * dependencies one way (from the compiler's .d files in BUILD): no chapter 02-07 depends on
    08_5d_mesh.cu or 08_plan.h, 02-05 on no other chapter, 06 and 07 on 02 only.

  scripts/check_shape.py [--build DIR]     (stdlib only: any python3)
Prints each violation and exits 1 if there is any; the last line says what was checked.
"""
import argparse
import glob
import os
import re
import sys

MAX_FUNCTION, MAX_MAIN = 80, 20
CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|do|else|return|try)\b")


def strip(text):
    """The source with comments, string and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1:j]) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """(name, first line, lines, is_kernel) of every function body in the file."""
    text = strip(open(path, encoding="utf-8").read())
    text = re.sub(r"(?m)^\s*#.*$", lambda m: " " * len(m.group(0)), text)  # preprocessor lines
    found, depth, head_start, i = [], 0, 0, 0
    stack = []  # for each open brace: is it a function body we are inside?
    inside = 0  # depth of function bodies we are in
    while i < len(text):
        c = text[i]
        if c in ";}" and not inside:
            head_start = i + 1
        if c == "{":
            head = text[head_start:i]
            is_fn = False
            if not inside:
                h = " ".join(head.split())
                if ("(" in h and ")" in h and not CONTROL.match(h) and not re.search(r"\b(namespace|enum)\b", h)
                        and not re.search(r"=\s*$", h) and not re.search(r"\b(class|struct|union)\s+\w+[^()]*$", h)):
                    is_fn = True
            stack.append((is_fn, i, head))
            if is_fn:
                inside += 1
            elif not inside:
                head_start = i + 1
        elif c == "}":
            if stack:
                is_fn, start, head = stack.pop()
                if is_fn:
                    inside -= 1
                    first = text.count("\n", 0, head_start + len(head) - len(head.lstrip()))
                    last = text.count("\n", 0, i)
                    m = re.search(r"([\w:~<>=!+\-*/\[\]]+)\s*\(", " ".join(head.split()))
                    name = m.group(1) if m else head.strip()[:40]
                    found.append((name, first + 1, last - first + 1, "__global__" in head))
                    head_start = i + 1
            if not inside:
                head_start = i + 1
        i += 1
    return found


def check_functions(root):
    bad = []
    files = sorted(glob.glob(os.path.join(root, "0[1-8]_*.cu")) + glob.glob(os.path.join(root, "08_plan.h"))
                   + glob.glob(os.path.join(root, "common", "*", "*.cu")) + glob.glob(os.path.join(root, "common", "*", "*.h")))
    count = 0
    for f in files:
        rel = os.path.relpath(f, root)
        for name, line, n, kernel in functions(f):
            count += 1
            if name == "main" and re.match(r"0[1-8]_", rel) and n > MAX_MAIN:
                bad.append(f"{rel}:{line}: main is {n} lines (at most {MAX_MAIN})")
            elif n > MAX_FUNCTION and not kernel:
                bad.append(f"{rel}:{line}: {name} is {n} lines (at most {MAX_FUNCTION})")
    return bad, count, files


def check_switches(files, root):
    bad = []
    for f in files:
        for k, line in enumerate(open(f, encoding="utf-8"), 1):
            if re.search(r"seeded_bug|TS_BUG|TS_SEEDED", line):
                bad.append(f"{os.path.relpath(f, root)}:{k}: a test switch in the code a reader reads")
    return bad


def deps(dfile):
    text = open(dfile, encoding="utf-8").read().replace("\\\n", " ")
    first = text.split("\n\n")[0] if "\n\n" in text else text.splitlines()[0]
    return {os.path.basename(p) for p in first.split(":", 1)[1].split()}


def check_deps(build):
    bad, allowed = [], {n: set() for n in range(2, 6)}
    allowed[6] = allowed[7] = {"02_data_parallel.cu"}
    seen = 0
    for n in range(2, 8):
        for d in glob.glob(os.path.join(build, f"0{n}_*.d")):
            seen += 1
            own = os.path.basename(d)[:-2] + ".cu"
            chapters = {p for p in deps(d) if re.match(r"0[1-8]_.*\.(cu|h)$", p)} - {own}
            for p in sorted(chapters - allowed[n]):
                bad.append(f"{os.path.basename(d)}: chapter {n} depends on {p}")
    if seen < 6:
        bad.append(f"only {seen} of the .d files of 02-07 in {build}: build first (make)")
    return bad


def check_reading_table(root):
    """notes/00's "How to read a chapter" table gives each chapter's length: it must be today's."""
    bad, rows = [], 0
    note = os.path.join(root, "notes", "00_architecture.md")
    for k, line in enumerate(open(note, encoding="utf-8"), 1):
        m = re.match(r"^\| (0[1-8]) [^|]*\| (\d+)(?: \+ (\d+) \(`08_plan.h`\))? \|", line)
        if not m:
            continue
        rows += 1
        files = glob.glob(os.path.join(root, m.group(1) + "_*.cu")) + (
            [os.path.join(root, "08_plan.h")] if m.group(3) else [])
        given = [int(m.group(2))] + ([int(m.group(3))] if m.group(3) else [])
        actual = [sum(1 for _ in open(f, encoding="utf-8")) for f in files]
        if given != actual:
            bad.append(f"notes/00_architecture.md:{k}: chapter {m.group(1)} is {actual} lines, the table says {given}")
    if rows != 8:
        bad.append(f"notes/00_architecture.md: {rows} rows of chapter lengths found, not 8")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    bad, count, files = check_functions(a.root)
    bad += check_switches(files, a.root)
    bad += check_reading_table(a.root)
    bad += check_deps(os.path.join(a.root, a.build) if not os.path.isabs(a.build) else a.build)
    for b in bad:
        print(b)
    print(f"{len(files)} files, {count} functions, the .d files of 02-07: {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
