#!/usr/bin/env python3
"""The shape the project keeps, checked: what a reader of one chapter file has to open.

  * no function longer than 80 lines in the technique files, the lab (lab/*.h, lab/*.cu: 08's
    planner among them) and common/ (CUDA
    kernels, `__global__`, excepted: a kernel is one unit of the GPU's work and reads as one);
  * every technique's main() at most 20 lines, its braces included: what the chapter decides (its
    flags, its objects, its step), the start-up sequence being training/start.h's;
  * no test switch ("seeded_bug", TS_BUG...) in the code a reader reads: tests inject their own;
  * no test fault injection there either, judged by what the code does (check_fault_injection):
    the chapters, comm/ and checkpoint.cu read only the environment variables of USER_ENVIRONMENT
    and never raise, kill or _exit;
  * the reading tier (check_reading_tier): each chapter within its line limit (01 250, 02-04 350,
    05-07 550, 08 600) and the project headers it pulls in within theirs (02-04 1,500 lines,
    05-07 2,000, comments counted); no frontier variant's code in 05 (ZB-H1, DualPipeV) or 07 (the
    two-level dispatch); no chapter including a lab file, a variant or 08; every variant file
    opening with what it adds and including its chapter;
  * notes/00's table of chapters ("How to read this codebase") gives each chapter's length and
    header lines as they are;
  * dependencies one way (from the compiler's .d files in BUILD): no chapter 02-07 depends on
    08_5d_mesh.cu or lab/08_plan.h, 02-05 on no other chapter, 06 and 07 on 02 only.

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
    files = sorted(glob.glob(os.path.join(root, "0[1-8]*_*.cu")) + glob.glob(os.path.join(root, "lab", "*.h"))
                   + glob.glob(os.path.join(root, "lab", "*.cu"))
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


# The environment the code a reader reads may consult (check_fault_injection): a knob a user sets,
# or the program's own mark, each with where it is explained. A test's switch never belongs here:
# tests inject their own faults, from tests/bugs/ linked into a test-only variant of a binary (the
# Makefile's SEEDED_BUGS and INJECTED_FAULTS; notes/00_architecture.md, "Seeded bugs").
USER_ENVIRONMENT = {
    "TS_NCCL": "TS_NCCL=0 takes the staged MPI path where NCCL would run (README, comm/mesh.cu)",
    "OMP_NUM_THREADS": "the user's thread count, used when --threads is not given (README, \"Threads\")",
    "OPENBLAS_NUM_THREADS": "OpenBLAS's own threads (README, \"Threads\")",
    "OPENBLAS_CORETYPE": "the user's choice of OpenBLAS kernels, kept when set (comm/threads.cu)",
    "OMP_WAIT_POLICY": "set by the user, kept; else set before the re-exec (comm/threads.cu)",
    "GOMP_SPINCOUNT": "as OMP_WAIT_POLICY",
    "UCX_HANDLE_ERRORS": "set before the re-exec, so a lost rank ends the job without a backtrace (comm/threads.cu)",
    "TS_OPENBLAS_DETECTED": "the program's own mark across its re-exec: the core OpenBLAS detected (comm/threads.cu)",
}
# Where the rule holds: the chapters, their variants and lab (08's planner, lab/08_plan.h, among
# them), comm/ (every collective passes through it) and checkpoint.cu.
FAULT_FREE = ["0[1-8]*_*.cu", "lab/*.cu", "lab/*.h", "common/comm/*.cu", "common/comm/*.h",
              "common/training/checkpoint.cu"]
GETENV = re.compile(r"\b(?:std::)?(?:secure_)?getenv\s*\(")
# A process that stops, kills or ends itself on the spot: the shape of an injected fault.
KILL = re.compile(r"(?<![\w.])(?<!->)(?:std::|::)?(raise|kill|abort|_exit|_Exit|quick_exit|pthread_kill|tgkill)\s*\(")
DECLARATION = re.compile(r"\b(void|int|bool|auto|virtual|override)\s+$")


def check_fault_injection(root):
    """No test fault injection in the code a reader reads, judged by what the code does: every
    getenv names a literal variable of USER_ENVIRONMENT, and nothing raises, kills or _exits."""
    bad, used = [], set()
    files = sorted({f for g in FAULT_FREE for f in glob.glob(os.path.join(root, g))})
    for f in files:
        rel, text = os.path.relpath(f, root), open(f, encoding="utf-8").read()
        code = strip(text)  # comments and literals blanked, offsets kept
        line = lambda pos: code.count("\n", 0, pos) + 1
        for m in GETENV.finditer(code):
            name = re.match(r'\s*"([^"\\]*)"\s*\)', text[m.end():])
            if not name:
                bad.append(f"{rel}:{line(m.start())}: getenv of a computed name: name the variable, so this check can read it")
            elif name.group(1) not in USER_ENVIRONMENT:
                bad.append(f"{rel}:{line(m.start())}: getenv(\"{name.group(1)}\") is not in check_shape.py's USER_ENVIRONMENT: "
                           "a user's knob goes there with where it is explained; a test's switch goes into tests/bugs/")
            else:
                used.add(name.group(1))
        for m in KILL.finditer(code):
            before = code[code.rfind("\n", 0, m.start()) + 1:m.start()]
            if not DECLARATION.search(before):
                bad.append(f"{rel}:{line(m.start())}: {m.group(1)}() ends or stops the process on the spot, as an injected "
                           "fault does: tests inject their faults from tests/bugs/")
    for name in sorted(set(USER_ENVIRONMENT) - used):
        bad.append(f"scripts/check_shape.py: USER_ENVIRONMENT lists {name}, which no checked file reads: remove it")
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


# ----- the reading tier (notes/00_architecture.md, "How to read this codebase") ------------------
CHAPTER_LIMIT = {1: 250, 2: 350, 3: 350, 4: 350, 5: 550, 6: 550, 7: 550, 8: 600}
PATH_LIMIT = {2: 1500, 3: 1500, 4: 1500, 5: 2000, 6: 2000, 7: 2000}
# What a chapter leaves to the variant files read after it: 05 the zero-bubble schedules
# (05a, 05b), 07 the two-level dispatch (07a). Their names may appear in a chapter's comments
# (pointing ahead to where they live), never in its code.
VARIANT_WORDS = {5: r"zbh1|zb[-_]?h1|zero[-_]?bubble|dualpipe", 7: r"two[-_]?level|twolevel|topology|TwoLevel"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def chapters(root):
    """(number, path) of every chapter file: NN_name.cu at the top level."""
    return sorted((int(os.path.basename(p)[:2]), p) for p in glob.glob(os.path.join(root, "0[1-8]_*.cu")))


def include_path(root, path):
    """The project headers a reader of `path` opens: the closure of its #include "…" over the
    project's headers, through any earlier chapter (.cu) it includes; lines, comments included."""
    seen, todo = set(), [path]
    while todo:
        cur = todo.pop()
        for name in INCLUDE.findall(open(cur, encoding="utf-8").read()):
            for d in (os.path.dirname(cur), os.path.join(root, "common"), root):
                p = os.path.normpath(os.path.join(d, name))
                if os.path.exists(p):
                    break
            else:
                continue
            if p not in seen:
                seen.add(p)
                todo.append(p)
    headers = [p for p in seen if p.endswith(".h")]
    return sum(sum(1 for _ in open(p, encoding="utf-8")) for p in headers), headers


def check_reading_tier(root):
    bad = []
    for n, path in chapters(root):
        rel = os.path.relpath(path, root)
        lines = sum(1 for _ in open(path, encoding="utf-8"))
        if lines > CHAPTER_LIMIT[n]:
            bad.append(f"{rel}: {lines} lines (a chapter reads in one sitting: at most {CHAPTER_LIMIT[n]})")
        if n in PATH_LIMIT:
            total, _ = include_path(root, path)
            if total > PATH_LIMIT[n]:
                bad.append(f"{rel}: its include path holds {total} lines of project headers (at most {PATH_LIMIT[n]}): "
                           "take machinery off it, into .cu files or the lab's headers")
        text = strip(open(path, encoding="utf-8").read())
        for name in INCLUDE.findall(open(path, encoding="utf-8").read()):
            later = re.match(r"(?:\.\./)?0([1-8])[a-z]_", name)
            if name.startswith(("lab/", "../lab/")) or (later and int(later.group(1)) >= n):
                bad.append(f"{rel}: includes {name}: a chapter never names what is read after it")
            if n < 8 and re.search(r"08_", name):
                bad.append(f"{rel}: includes {name}")
        if n in VARIANT_WORDS:
            for k, line in enumerate(text.split("\n"), 1):
                if re.search(VARIANT_WORDS[n], line, re.I):
                    bad.append(f"{rel}:{k}: a frontier variant's code in the chapter (it lives in the file read after it)")
    for path in glob.glob(os.path.join(root, "0[1-8][a-z]_*.cu")):
        rel = os.path.relpath(path, root)
        head = open(path, encoding="utf-8").read().split("\n", 3)[:3]
        if not head[0].startswith("// " + os.path.basename(path)):
            bad.append(f"{rel}:1: a variant file opens with its name and what it adds to which chapter")
        chapter = os.path.basename(path)[:2]
        if not any(re.match(r'(\.\./)?' + chapter + r'[a-z]?_', i) for i in INCLUDE.findall(open(path, encoding="utf-8").read())):
            bad.append(f"{rel}: a variant includes the chapter it plugs into ({chapter}_*.cu, or a variant before it)")
    return bad


def check_reading_table(root):
    """notes/00's table of chapters ("How to read this codebase") gives each chapter's length and
    the header lines its include path holds: they must be today's."""
    bad, rows = [], 0
    note = os.path.join(root, "notes", "00_architecture.md")
    for k, line in enumerate(open(note, encoding="utf-8"), 1):
        m = re.match(r"^\| (0[1-8]) [^|]*\| ([\d,]+) \| ([\d,]+) \|", line)
        if not m:
            continue
        rows += 1
        path = glob.glob(os.path.join(root, m.group(1) + "_*.cu"))[0]
        given = [int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))]
        actual = [sum(1 for _ in open(path, encoding="utf-8")), include_path(root, path)[0]]
        if given != actual:
            bad.append(f"notes/00_architecture.md:{k}: chapter {m.group(1)} has {actual[0]} lines and {actual[1]} lines "
                       f"of headers on its include path; the table says {given[0]} and {given[1]}")
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
    bad += check_fault_injection(a.root)
    bad += check_reading_tier(a.root)
    bad += check_reading_table(a.root)
    bad += check_deps(os.path.join(a.root, a.build) if not os.path.isabs(a.build) else a.build)
    for b in bad:
        print(b)
    print(f"{len(files)} files, {count} functions, the .d files of 02-07: {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
