#!/usr/bin/env python3
"""Checks that common/'s layers depend on each other in one direction only.

Each folder of common/ is a layer and opens with a README.md whose line "Uses: a, b" names the
layers its files may include (or "Uses: nothing"). This script reads every `#include "…"` of every
file in common/ and fails when a file includes a header of a layer its folder does not name, when
an include does not say its layer ("tensor/core.h", never "core.h"), or when the declared uses form
a cycle (then some layer would, through others, stand on itself). The emulated device, common/emu/,
stands in for the CUDA headers: its own headers (cuda_runtime.h, …) are found by the compiler's
include path and are not layers' headers, so only includes that name a layer are checked there.

  scripts/check_layers.py [--root DIR]     (stdlib only: any python3)
Prints the layers from the bottom up with the includes each one makes, or every violation.
"""
import argparse
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def read_layers(common):
    layers = {}
    for name in sorted(os.listdir(common)):
        folder = os.path.join(common, name)
        if not os.path.isdir(folder):
            continue
        readme = os.path.join(folder, "README.md")
        if not os.path.exists(readme):
            sys.exit(f"error: {folder} has no README.md saying what the layer is and what it uses")
        uses = None
        for line in open(readme, encoding="utf-8"):
            m = re.match(r"^Uses:\s*(.*)$", line.strip())
            if m:
                words = re.findall(r"[a-z_]+", m.group(1))
                uses = set() if words[:1] == ["nothing"] else set(words)
                break
        if uses is None:
            sys.exit(f"error: {readme} has no line 'Uses: …' naming the layers it may include")
        layers[name] = uses
    for name, uses in layers.items():
        for u in uses:
            if u not in layers:
                sys.exit(f"error: common/{name}/README.md uses '{u}', which is not a folder of common/")
    return layers


def bottom_up(layers):
    """The layers in an order where each comes after everything it uses; exits on a cycle."""
    order, state = [], {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        if state.get(name) == "open":
            sys.exit("error: the layers' uses form a cycle: " + " -> ".join(path + [name]))
        state[name] = "open"
        for u in sorted(layers[name]):
            visit(u, path + [name])
        state[name] = "done"
        order.append(name)

    for name in sorted(layers):
        visit(name, [])
    depth = {}
    for name in order:  # each after what it uses: a layer's depth is its longest path down
        depth[name] = 1 + max((depth[u] for u in layers[name]), default=-1)
    return sorted(order, key=lambda n: (depth[n], n))


def check(common, layers):
    errors, edges = [], {}
    for layer in layers:
        folder = os.path.join(common, layer)
        for f in sorted(os.listdir(folder)):
            if not f.endswith((".h", ".cu", ".cpp")):
                continue
            text = open(os.path.join(folder, f), encoding="utf-8").read()
            for m in INCLUDE.finditer(text):
                inc = m.group(1)
                line = text.count("\n", 0, m.start()) + 1
                where = f"common/{layer}/{f}:{line}"
                target = inc.split("/")[0] if "/" in inc else None
                if target is None:
                    if layer == "emu" and os.path.exists(os.path.join(folder, inc)):
                        continue  # the emulated device's stand-ins for CUDA's own headers
                    errors.append(f'{where}: #include "{inc}" does not name its layer (write "LAYER/{inc}")')
                    continue
                if target not in layers or not os.path.exists(os.path.join(common, inc)):
                    errors.append(f'{where}: #include "{inc}" is not a header of common/')
                    continue
                if target != layer and target not in layers[layer]:
                    errors.append(f'{where}: #include "{inc}": layer {layer} does not use {target} '
                                  f"(common/{layer}/README.md; a lower layer may not reach up)")
                    continue
                if target != layer:
                    edges.setdefault(layer, set()).add(target)
    return errors, edges


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=".")
    args = ap.parse_args()
    common = os.path.join(args.root, "common")
    layers = read_layers(common)
    order = bottom_up(layers)
    errors, edges = check(common, layers)
    if errors:
        print("\n".join(errors))
        print(f"{len(errors)} include(s) break common/'s layering")
        return 1
    for name in order:
        used = ", ".join(u for u in order if u in edges.get(name, ())) or "nothing"
        print(f"{name:9} includes {used}")
    print(f"common/: {len(order)} layers, every include points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
