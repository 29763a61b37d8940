#!/usr/bin/env python3
"""The training step of 01_single_gpu in PyTorch 2.x, eager or compiled, on the CPU.

The model and the step are 01's: token embedding; per layer RMSNorm, attention (GQA, RoPE with
rotate_half, causal), residual, RMSNorm, SwiGLU MLP, residual; final RMSNorm; an untied LM head;
mean cross-entropy over every token. fp32. Matrices start N(0, 0.02), norm weights 1. AdamW with
01's defaults: lr 3e-3 on a cosine schedule to 0 over the run, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1 on the matrices only, the gradients clipped to global norm 1.

  --attn manual   scores, mask and softmax as separate ops, each key-value head repeated for its
                  query heads (what an eager model written by hand runs)
  --attn sdpa     F.scaled_dot_product_attention(is_causal=True, enable_gqa=True): PyTorch's fused
                  CPU flash attention
  --compile none | default | max-autotune
                  torch.compile of the model (forward and, through AOTAutograd, backward); the
                  inductor's C++ backend needs g++ and Python's headers
  --data FILE     train on FILE's bytes, windows in 01's order (sequence i of step s starts at
                  ((s·batch + i)·seq) mod (bytes − seq − 1)): with 01 --data FILE the two runs see
                  the same tokens. Without it: uniform random bytes (the loss stays at ln vocab).

Steps before --warmup are not timed (compilation happens in the first). The last line is

  median N tokens/s over S steps (min A, max B); loss at step 0 L0, final loss L

with the same statistic as 01's last line (the median of the per-step rates).

  build/torch-venv/bin/python bench/torch2_llama.py --attn sdpa --compile default --threads 1
"""
import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.kind = a.heads, a.kv_heads, a.dim // a.heads, a.attn
        self.q_proj = nn.Linear(a.dim, a.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(a.dim, a.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(a.dim, a.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(a.heads * self.hd, a.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        split = lambda t, h: t.view(B, T, h, self.hd).transpose(1, 2)  # [B, heads, T, hd]
        q = split(self.q_proj(x), self.heads)
        k = split(self.k_proj(x), self.kv_heads)
        v = split(self.v_proj(x), self.kv_heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd))
            y = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.input_layernorm = RMSNorm(a.dim, a.eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.dim, a.eps)
        self.gate_proj = nn.Linear(a.dim, a.ffn, bias=False)
        self.up_proj = nn.Linear(a.dim, a.ffn, bias=False)
        self.down_proj = nn.Linear(a.ffn, a.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim, a.eps)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)
        hd = a.dim // a.heads
        inv_freq = a.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(a.seq, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # rotate_half pairs element i with i + hd/2
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.register_buffer("mask", torch.ones(a.seq, a.seq, dtype=torch.bool).triu(1), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens, targets):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(a, steps):
    """Yields (inputs, targets) for each step: 01's windows over --data's bytes, or random bytes."""
    if a.data:
        with open(a.data, "rb") as f:
            raw = f.read()
        span = len(raw) - a.seq - 1
        if span < 1:
            sys.exit(f"--data {a.data}: {len(raw)} bytes, too few for one window of {a.seq} + 2")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        for s in range(steps):
            starts = [((s * a.batch + i) * a.seq) % span for i in range(a.batch)]
            w = torch.stack([data[o:o + a.seq + 1] for o in starts])
            yield w[:, :-1], w[:, 1:]
    else:
        g = torch.Generator().manual_seed(a.seed)
        for _ in range(steps):
            w = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
            yield w[:, :-1], w[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("dim", 256), ("layers", 4), ("heads", 8), ("kv-heads", 4), ("ffn", 688),
                          ("vocab", 256), ("seq", 256), ("batch", 8)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up ones")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation runs in step 0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attn", choices=["manual", "sdpa"], default="sdpa")
    p.add_argument("--compile", choices=["none", "default", "max-autotune"], default="default")
    p.add_argument("--adam", choices=["for-loop", "foreach", "fused"], default="foreach",
                   help="AdamW's implementation (the same update)")
    p.add_argument("--data", default="", help="a file whose bytes are the tokens (vocab ≥ 256)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eps", type=float, default=1e-5, help="RMSNorm epsilon")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--print-losses", action="store_true", help="one line per step: its loss and time")
    p.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="bf16: forward and loss under torch.autocast (bf16 matmuls, fp32 weights and AdamW)")
    a = p.parse_args()
    if a.dim % a.heads or a.heads % a.kv_heads:
        sys.exit("dim must divide into heads, and heads into kv-heads")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Llama(a)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    impl = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[a.adam]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **impl)
    total = a.warmup + a.steps
    # 01's cosine schedule: lr at step s of n is lr · (1 + cos(π s / (n − 1))) / 2
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / (total - 1))) if total > 1 else 1.0)
    step_fn = model if a.compile == "none" else torch.compile(
        model, mode=None if a.compile == "default" else a.compile)
    print(f"torch2_llama: torch {torch.__version__}, {a.threads} thread(s), attn {a.attn}, compile {a.compile}, "
          f"AdamW {a.adam}, autocast {a.autocast}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"{'data ' + a.data if a.data else 'random bytes'}", flush=True)

    rates, losses, started = [], [], time.perf_counter()
    for s, (x, y) in enumerate(batches(a, total)):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast == "bf16"):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        dt = time.perf_counter() - t0
        if a.print_losses:
            print(f"step {s:4d} loss {losses[-1]:.6f} {dt * 1e3:9.1f} ms", flush=True)
        if s >= a.warmup:
            rates.append(a.batch * a.seq / dt)
        elif s == a.warmup - 1:
            print(f"warm-up: {a.warmup} step(s) in {time.perf_counter() - started:.1f} s", flush=True)
    if not rates:
        sys.exit("no timed step: --steps must be at least 1")
    print(f"median {statistics.median(rates):.0f} tokens/s over {len(rates)} steps (min {min(rates):.0f}, "
          f"max {max(rates):.0f}); loss at step 0 {losses[0]:.4f}, final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
