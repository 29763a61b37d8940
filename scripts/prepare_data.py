#!/usr/bin/env python3
"""Turns text files into llm.c token shards of bytes: PREFIX_train.bin and PREFIX_val.bin.

  scripts/prepare_data.py FILE.txt [FILE.txt ...] -o data/shakespeare [--val-fraction 0.1]
  ./build/01_single_gpu --data data/shakespeare_train.bin --eval-every 50 --eval-data data/shakespeare_val.bin

Every byte is one token (vocabulary 256, what --preset tiny and small use), so nothing needs a
tokenizer and 01's --sample prints what the model writes. The files are read in order and joined;
the last --val-fraction of the bytes becomes the validation shard, which training never reads.

The format is what common/formats/data.cu loads: a header of 256 little-endian int32 (magic 20240520,
version 1, the token count; int 3 = 1 marks the tokens as bytes, llm.c leaves it 0), then the
tokens as little-endian uint16. Standard library only: runs under any python3.
"""
import argparse
import os
import struct
import sys

MAGIC, VERSION = 20240520, 1  # kShardMagic, kShardVersion in common/formats/data.h
HEADER_INTS = 256             # kShardHeaderInts
KIND_INT, BYTES = 3, 1        # kShardKindInt, kShardBytes


def shard(tokens):
    """The bytes of an llm.c shard holding `tokens` (a bytes object: one token per byte)."""
    header = [0] * HEADER_INTS
    header[0], header[1], header[2], header[KIND_INT] = MAGIC, VERSION, len(tokens), BYTES
    return struct.pack(f"<{HEADER_INTS}i", *header) + struct.pack(f"<{len(tokens)}H", *tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="text files (read as bytes, joined in order)")
    ap.add_argument("-o", "--output", required=True, help="prefix of PREFIX_train.bin and PREFIX_val.bin")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="the tail of the bytes held out (default 0.1)")
    args = ap.parse_args()
    if not 0 < args.val_fraction < 1:
        sys.exit(f"error: --val-fraction must be between 0 and 1 (got {args.val_fraction})")
    data = b""
    for path in args.inputs:
        try:
            with open(path, "rb") as f:
                data += f.read()
        except OSError as e:
            sys.exit(f"error: {path}: {e.strerror}")
    val = int(len(data) * args.val_fraction)
    if val < 1 or len(data) - val < 1:
        sys.exit(f"error: {len(data)} bytes cannot be split into train and val at --val-fraction {args.val_fraction}")
    if os.path.dirname(args.output):
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
    for name, part in (("train", data[:len(data) - val]), ("val", data[len(data) - val:])):
        out = f"{args.output}_{name}.bin"
        with open(out, "wb") as f:
            f.write(shard(part))
        print(f"{out}: {len(part)} byte tokens")


if __name__ == "__main__":
    main()
