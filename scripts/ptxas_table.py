#!/usr/bin/python3
"""Every CUDA kernel's resources on sm_90 and its occupancy on an H100 (make ptxas).

  ptxas_table.py [--nvcc NVCC] [--cflags FLAGS] SRC...   compile each SRC for sm_90 with -Xptxas -v
  ptxas_table.py --log LOG --source SRC                  the table of a captured ptxas -v log of SRC
  ptxas_table.py --occupancy THREADS REGS SMEM_BYTES     one occupancy calculation

One row per kernel instantiation: registers per thread, spill stores/loads, static shared memory
(ptxas), the block size and dynamic shared memory of its launch (read from the source: the
kernel's __launch_bounds__, else the block argument of its TS_LAUNCH call, the named constants
resolved by their nearest preceding `constexpr int` definition; a dynamic size is the source's own
expression, evaluated at the head dim the instantiation serves), and the occupancy an H100 gives
it: active warps per SM of 64, and the resource that limits it.

The occupancy rules are the CUDA occupancy calculator's (the toolkit's cuda_occupancy.h,
cudaOccMaxActiveBlocksPerMultiprocessor) with the limits of compute capability 9.0 from the CUDA
C++ Programming Guide's "Compute Capabilities" table: 65,536 32-bit registers per SM, allocated per
warp in units of 256 and split over the SM's 4 sub-partitions; at most 255 registers per thread;
228 KiB of shared memory per SM, at most 227 KiB per block, 1 KiB reserved by the system per
block, allocated in units of 128 B; at most 2,048 threads (64 warps) and 32 blocks per SM.
Standard library only (c++filt, where present, demangles the names).
"""
import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

# Compute capability 9.0 (H100, H200).
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers, per warp
SUB_PARTITIONS = 4
MAX_REGS_PER_THREAD = 255
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
SMEM_ALLOC_UNIT = 128
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
MAX_THREADS_PER_BLOCK = 1024


def round_up(x, unit):
    return (x + unit - 1) // unit * unit


def occupancy(threads, regs, smem):
    """(active warps per SM, the limiting resources) for blocks of `threads` using `regs` registers
    per thread and `smem` bytes of shared memory (static + dynamic) per block."""
    if not 0 < threads <= MAX_THREADS_PER_BLOCK:
        raise ValueError("block of %d threads: must be 1..%d" % (threads, MAX_THREADS_PER_BLOCK))
    if not 0 <= regs <= MAX_REGS_PER_THREAD:
        raise ValueError("%d registers per thread: must be 0..%d" % (regs, MAX_REGS_PER_THREAD))
    smem_block = round_up(smem + SMEM_RESERVED_PER_BLOCK, SMEM_ALLOC_UNIT)
    if smem + SMEM_RESERVED_PER_BLOCK > SMEM_PER_BLOCK + SMEM_RESERVED_PER_BLOCK:
        raise ValueError("%d bytes of shared memory: a block may have at most %d" % (smem, SMEM_PER_BLOCK))
    warps = (threads + 31) // 32
    limits = {"blocks": MAX_BLOCKS_PER_SM, "warps": MAX_WARPS_PER_SM // warps, "smem": SMEM_PER_SM // smem_block}
    # Registers: each warp's allocation rounded up to the unit; a sub-partition holds whole warps.
    per_warp = round_up(regs * 32, REG_ALLOC_UNIT)
    if per_warp > 0:
        limits["regs"] = (REGS_PER_SM // SUB_PARTITIONS // per_warp) * SUB_PARTITIONS // warps
    blocks = min(limits.values())
    binding = [k for k in ("regs", "smem", "warps", "blocks") if limits.get(k) == blocks]
    return blocks * warps, binding


# ----- the source: launch configurations ------------------------------------------------------------

def safe_eval(expr, names):
    """An arithmetic expression of integers and names (+ - * / // parentheses, sizeof(float))."""
    widths = {"double": "8", "bf16": "2", "uint16_t": "2"}
    expr = re.sub(r"sizeof\((float|int32_t|int|double|bf16|uint16_t)\)", lambda m: widths.get(m.group(1), "4"), expr)
    expr = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", expr)
    tree = ast.parse(expr.strip(), mode="eval")

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name) and n.id in names:
            return names[n.id]
        if isinstance(n, ast.Attribute) and ast.unparse(n) in names:
            return names[ast.unparse(n)]
        if isinstance(n, ast.BinOp) and type(n.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv):
            a, b = ev(n.left), ev(n.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(n.op), a // b if b else 0)
        raise KeyError(ast.unparse(n))
    return ev(tree)


def split_args(text, start):
    """The comma-separated arguments of the call whose '(' is at text[start] (a comma inside a
    template's <...> does not split)."""
    depth, args, cur = 0, [], ""
    for c in text[start:]:
        if c in "([{":
            depth += 1
            if depth == 1:
                continue
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return args + [cur.strip()]
        elif c == "," and depth == 1 and cur.count("<") == cur.count(">"):
            args.append(cur.strip())
            cur = ""
            continue
        cur += c
    return args


def resolve(expr, text, pos, extra=None):
    """expr's value, its names resolved by their nearest `constexpr int NAME = ...;` or
    `size_t NAME = ...;` before pos (recursively); None when a name stays unknown."""
    names = dict(extra or {})
    for _ in range(8):
        try:
            return safe_eval(expr, names)
        except KeyError as e:
            name = e.args[0]
            if "." in name or name in names:
                return None
            defs = [m for m in re.finditer(r"(?:constexpr\s+int|size_t)\s+%s\s*=\s*([^;]+);" % re.escape(name), text)
                    if m.start() < pos]
            if not defs:
                return None
            value = resolve(defs[-1].group(1), text, defs[-1].start(), extra)
            if value is None:
                return None
            names[name] = value
        except (SyntaxError, ValueError):
            return None
    return None


def launches(path):
    """{kernel base name: [(block threads, dynamic smem expression, position)]} from the source."""
    text = open(path).read()
    found = {}
    for m in re.finditer(r"__global__\s+void\s+__launch_bounds__\((\w+)\)\s*(\w+)\s*\(", text):
        found.setdefault(m.group(2), []).append((resolve(m.group(1), text, m.start()), "0", m.start(), True))
    for m in re.finditer(r"TS_LAUNCH\(", text):
        args = split_args(text, m.end() - 1)
        if len(args) < 5:
            continue
        name = re.sub(r"^(\w+::)*", "", args[4]).split("<")[0].strip()
        block = re.sub(r"\b\w+::", "", args[1])
        found.setdefault(name, []).append((resolve(block, text, m.start()), args[2], m.start(), False))
    return text, found


def launch_config(name, head_dim, text, found):
    """(threads, dynamic smem bytes or None, where the block size came from) of kernel `name`."""
    entries = found.get(name)
    if not entries:
        # A kernel launched through a macro's parameter (moe.cu): the file's one block size.
        blocks = {e[0] for es in found.values() for e in es if not e[3]}
        return (blocks.pop() if len(blocks) == 1 else None), 0, "the file's launches"
    bounds = [e for e in entries if e[3]]
    calls = [e for e in entries if not e[3]]
    threads = bounds[0][0] if bounds else calls[0][0] if calls else None
    smem = 0
    for _, expr, pos, _ in calls:
        if expr.strip() != "0":
            # The source's expression at the largest head dim the instantiation serves.
            smem = resolve(expr, text, pos, {"a.hd": head_dim} if head_dim else None)
    return threads, smem, "__launch_bounds__" if bounds else "TS_LAUNCH"


# ----- ptxas -v ----------------------------------------------------------------------------------------

def parse_ptxas(log):
    """[{mangled, regs, spill_st, spill_ld, smem}] for each entry function of a ptxas -v log."""
    rows, cur = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for 'sm_(\d+)'", line)
        if m:
            cur = {"mangled": m.group(1), "sm": m.group(2), "regs": 0, "spill_st": 0, "spill_ld": 0, "smem": 0}
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur.get("props_of") in (None, cur["mangled"]):
            cur["spill_st"], cur["spill_ld"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            cur["props_of"] = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
            cur = None
    return rows


def demangle(names):
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


def short(demangled):
    """ts::cuda::attention_dq_kernel<ts::bf16, 2, 2>(...) -> attention_dq_kernel<bf16, 2, 2>."""
    name = re.sub(r"^void ", "", demangled)
    name = name.replace("ts::cuda::", "").replace("ts::", "").replace("(anonymous namespace)::", "")
    depth = 0
    for i, c in enumerate(name):
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            return name[:i]
    return name


def table_rows(log, source):
    text, found = launches(source)
    rows = [r for r in parse_ptxas(log) if r["sm"] == "90"]
    out = []
    for r, d in zip(rows, demangle([r["mangled"] for r in rows])):
        name = short(d)
        base = re.sub(r"^(\w+::)*", "", name.split("<")[0])
        targs = re.findall(r"<(.*)>", name)
        ints = [int(a) for a in (targs[0].split(",") if targs else []) if a.strip().isdigit()]
        # Head dims: v1's kernels serve hd ≤ 32·NCH (their first template int), v2's exactly HD.
        head_dim = None
        if ints and base.startswith("attention_"):
            head_dim = 32 * ints[0]
        elif ints and base.startswith("flash_v2_"):
            head_dim = ints[0]
        threads, dyn, origin = launch_config(base, head_dim, text, found)
        row = dict(r, name=name, file=source, threads=threads, dyn=dyn, origin=origin)
        if threads:
            warps, binding = occupancy(threads, r["regs"], r["smem"] + (dyn or 0))
            row["warps"], row["limit"] = warps, "/".join(binding)
        out.append(row)
    return out


def print_table(rows):
    print("%-44s %4s %6s %6s %6s %5s %7s %9s  %s" % ("kernel (sm_90)", "regs", "spillS", "spillL", "smem",
                                                     "block", "dynsmem", "occupancy", "limited by"))
    for r in rows:
        occ = "%2d/64 %3.0f%%" % (r["warps"], 100.0 * r["warps"] / 64) if "warps" in r else "?"
        print("%-44s %4d %6d %6d %6d %5s %7s %9s  %s" % (r["name"][:44], r["regs"], r["spill_st"], r["spill_ld"],
                                                         r["smem"], r["threads"] or "?",
                                                         "?" if r["dyn"] is None else r["dyn"], occ,
                                                         r.get("limit", "no launch found")))


def compile_log(nvcc, cflags, source):
    cmd = [nvcc, "-std=c++17", "-x", "cu", "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v"] + \
        cflags.split() + ["-c", source, "-o", os.devnull]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("ptxas_table: %s failed:\n%s" % (" ".join(cmd), p.stderr[-4000:]))
    return p.stderr


def main(argv):
    if argv[:1] == ["--occupancy"] and len(argv) == 4:
        try:
            warps, binding = occupancy(*(int(a) for a in argv[1:]))
        except ValueError as e:
            sys.exit("ptxas_table: %s" % e)
        print("%d/64 warps (%.1f%%), limited by %s" % (warps, 100.0 * warps / 64, "/".join(binding)))
        return
    if argv[:1] == ["--log"] and len(argv) == 4 and argv[2] == "--source":
        print_table(table_rows(open(argv[1]).read(), argv[3]))
        return
    nvcc, cflags, sources = "/usr/local/cuda/bin/nvcc", "", []
    i = 0
    while i < len(argv):
        if argv[i] in ("--nvcc", "--cflags") and i + 1 < len(argv):
            nvcc, cflags = (argv[i + 1], cflags) if argv[i] == "--nvcc" else (nvcc, argv[i + 1])
            i += 2
        elif argv[i].startswith("-"):
            sys.exit(__doc__)
        else:
            sources.append(argv[i])
            i += 1
    if not sources:
        sys.exit(__doc__)
    missing = [s for s in sources if not os.path.isfile(s)]
    if missing or not shutil.which(nvcc):
        sys.exit("ptxas_table: not found: %s" % ", ".join(missing or [nvcc]))
    # One nvcc per source, side by side (each runs only the sm_90 device pass).
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        logs = list(pool.map(lambda s: compile_log(nvcc, cflags, s), sources))
    print_table([row for s, log in zip(sources, logs) for row in table_rows(log, s)])


if __name__ == "__main__":
    main(sys.argv[1:])
