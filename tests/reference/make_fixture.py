#!/usr/bin/env python3
"""Generate the reference fixture for tinyscale's model/optimizer tests.

    /usr/bin/python3 tests/reference/make_fixture.py

Writes (next to this script):
  tiny/model.safetensors  initial weights, HF Llama names, F32
  tiny/config.json        HF LlamaConfig for the same model
  fixture.safetensors     tokens, loss0, grad.<name>, losses, grad_norms, final.<name>

Needs only torch, numpy and the standard library. Deterministic: fixed seeds, CPU, float32,
one thread, torch.use_deterministic_algorithms(True). The safetensors files are written by hand
(no safetensors package) so the C++ reader is checked against an independent writer.
See README.md in this directory for the exact conventions.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- model / data / optimizer hyperparameters -------------------------------------------------
V, D, L, H, KV, FFN = 256, 64, 2, 4, 2, 160
HD = D // H
T, B, NBATCH = 32, 4, 6
EPS, THETA = 1e-5, 10000.0
INIT_STD = 0.02
STEPS = 5
LR, BETA1, BETA2, ADAM_EPS, WD = 3e-3, 0.9, 0.95, 1e-8, 0.1
CLIP_EPS = 1e-6  # clip coefficient = min(1, clip / (norm + CLIP_EPS))
SEED_WEIGHTS, SEED_DATA = 1234, 5678
MOTIF_VOCAB = 32


def param_shapes():
    """HF names and shapes, in model order (also the order the init RNG is consumed in)."""
    s = [("model.embed_tokens.weight", (V, D))]
    for i in range(L):
        p = f"model.layers.{i}."
        s += [(p + "input_layernorm.weight", (D,)),
              (p + "self_attn.q_proj.weight", (H * HD, D)),
              (p + "self_attn.k_proj.weight", (KV * HD, D)),
              (p + "self_attn.v_proj.weight", (KV * HD, D)),
              (p + "self_attn.o_proj.weight", (D, H * HD)),
              (p + "post_attention_layernorm.weight", (D,)),
              (p + "mlp.gate_proj.weight", (FFN, D)),
              (p + "mlp.up_proj.weight", (FFN, D)),
              (p + "mlp.down_proj.weight", (D, FFN))]
    s += [("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]
    return s


def init_weights():
    g = torch.Generator().manual_seed(SEED_WEIGHTS)
    w = {}
    for name, shape in param_shapes():
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        # matrices N(0, 0.02); norm weights 1 + 0.1*N(0,1) so their gradient path is exercised
        w[name] = (r * INIT_STD) if len(shape) == 2 else (1.0 + 0.1 * r)
    return w


def make_tokens():
    """[NBATCH, B, T+1] int32: each window repeats a random motif (period 3..8) of tokens from
    [0, MOTIF_VOCAB); 15% of positions are replaced by uniform noise over [0, V)."""
    g = torch.Generator().manual_seed(SEED_DATA)
    out = torch.empty(NBATCH, B, T + 1, dtype=torch.int64)
    for n in range(NBATCH):
        for b in range(B):
            period = int(torch.randint(3, 9, (1,), generator=g))
            motif = torch.randint(0, MOTIF_VOCAB, (period,), generator=g)
            seq = motif.repeat(T + 1 + period)[: T + 1].clone()
            noise = torch.rand(T + 1, generator=g) < 0.15
            seq[noise] = torch.randint(0, V, (int(noise.sum()),), generator=g)
            out[n, b] = seq
    return out.to(torch.int32)


# ---- model forward (HF Llama semantics) -------------------------------------------------------
def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope_tables(dtype):
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, HD]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def forward_loss(w, tokens):
    """tokens: [B, T+1] int. Returns mean cross-entropy over all B*T predictions."""
    inp, tgt = tokens[:, :-1].long(), tokens[:, 1:].long()
    Bn, Tn = inp.shape
    dtype = w["lm_head.weight"].dtype
    cos, sin = rope_tables(dtype)
    x = w["model.embed_tokens.weight"][inp]  # [B, T, D]
    mask = torch.ones(Tn, Tn, dtype=torch.bool).triu(1)
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].t()).view(Bn, Tn, H, HD).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].t()).view(Bn, Tn, KV, HD).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].t()).view(Bn, Tn, KV, HD).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)  # query head h uses kv head h // (H/KV)
        v = v.repeat_interleave(H // KV, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(Bn, Tn, H * HD)
        x = x + y @ w[p + "self_attn.o_proj.weight"].t()
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].t()
        up = h @ w[p + "mlp.up_proj.weight"].t()
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].t()
    logits = rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].t()
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))


def loss_and_grads(w, tokens):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in w.items()}
    loss = forward_loss(leaves, tokens)
    loss.backward()
    return loss.detach(), {n: t.grad.detach().clone() for n, t in leaves.items()}


# ---- training (global-norm clip + torch AdamW, foreach=False) ---------------------------------
def train(w0, tokens, clip):
    """STEPS steps, step k on batch k. clip=None disables clipping. Returns losses, norms, weights."""
    params = {n: t.detach().clone().requires_grad_(True) for n, t in w0.items()}
    decay = [p for n, p in params.items() if p.dim() == 2]
    no_decay = [p for n, p in params.items() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(BETA1, BETA2), eps=ADAM_EPS, foreach=False)
    losses, norms = [], []
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(params, tokens[k])
        loss.backward()
        grads = [p.grad for p in params.values()]
        # Same as torch.nn.utils.clip_grad_norm_(..., norm_type=2): L2 of per-tensor L2 norms.
        norm = torch.norm(torch.stack([torch.norm(g, 2.0) for g in grads]), 2.0)
        if clip is not None:
            coef = torch.clamp(clip / (norm + CLIP_EPS), max=1.0)
            for g in grads:
                g.mul_(coef)
        opt.step()
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, {n: p.detach().clone() for n, p in params.items()}


# ---- hand-written safetensors ------------------------------------------------------------------
def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, np.ndarray float32/int32) in file order."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    blobs, off = [], 0
    for name, a in tensors:
        if a.dtype == np.float32:
            dt = "F32"
        elif a.dtype == np.int32:
            dt = "I32"
        else:
            raise ValueError(f"{name}: unsupported dtype {a.dtype}")
        b = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """Minimal reader used only to round-trip check the writer."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    meta = hdr.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for k, v in hdr.items():
        dt = {"F32": "<f4", "I32": "<i4"}[v["dtype"]]
        b, e = v["data_offsets"]
        out[k] = np.frombuffer(data[b:e], dtype=dt).reshape(v["shape"])
    return out, meta


# ---- self checks ------------------------------------------------------------------------------
def check_float64_and_fd(w, tokens):
    """fp64 forward/backward agrees with fp32; fp64 autograd agrees with central differences."""
    w64 = {n: t.double() for n, t in w.items()}
    l32, g32 = loss_and_grads(w, tokens)
    l64, g64 = loss_and_grads(w64, tokens)
    assert abs(float(l32) - float(l64)) < 1e-5, (float(l32), float(l64))
    for n in w:
        err = (g32[n].double() - g64[n]).abs().max().item()
        scale = g64[n].abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, (n, err, scale)
    g = torch.Generator().manual_seed(99)
    h = 1e-6
    worst = 0.0
    for n, t in w64.items():
        for _ in range(3):
            idx = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in t.shape)
            wp = dict(w64); wp[n] = t.clone(); wp[n][idx] += h
            wm = dict(w64); wm[n] = t.clone(); wm[n][idx] -= h
            with torch.no_grad():
                fd = (float(forward_loss(wp, tokens)) - float(forward_loss(wm, tokens))) / (2 * h)
            an = float(g64[n][idx])
            rel = abs(fd - an) / max(abs(an), 1e-6)
            worst = max(worst, min(rel, abs(fd - an) * 1e4))
            assert abs(fd - an) <= 1e-6 + 1e-4 * abs(an), (n, idx, fd, an)
    print(f"self-check: fp32 vs fp64 ok, finite differences ok (worst {worst:.2e})")


def check_adamw_by_hand(w0, tokens, clip, losses_torch, final_torch):
    """Re-run the training with a by-hand clip + AdamW (fp32, torch's op order) and compare."""
    params = {n: t.clone() for n, t in w0.items()}
    m = {n: torch.zeros_like(t) for n, t in params.items()}
    v = {n: torch.zeros_like(t) for n, t in params.items()}
    for k in range(STEPS):
        loss, g = loss_and_grads(params, tokens[k])
        assert abs(float(loss) - losses_torch[k]) < 1e-5, (k, float(loss), losses_torch[k])
        norm = math.sqrt(sum(float((x.double() ** 2).sum()) for x in g.values()))
        coef = min(1.0, clip / (norm + CLIP_EPS))
        step = k + 1
        for n, p in params.items():
            gr = g[n] * coef
            wd = WD if p.dim() == 2 else 0.0
            p.mul_(1 - LR * wd)                          # decoupled weight decay first
            m[n] = BETA1 * m[n] + (1 - BETA1) * gr
            v[n] = BETA2 * v[n] + (1 - BETA2) * gr * gr
            denom = v[n].sqrt() / math.sqrt(1 - BETA2 ** step) + ADAM_EPS
            p.sub_((LR / (1 - BETA1 ** step)) * m[n] / denom)
    worst = max((params[n] - final_torch[n]).abs().max().item() for n in params)
    assert worst < 1e-5, worst
    print(f"self-check: by-hand clip+AdamW vs torch.optim.AdamW: max |dw| = {worst:.2e}")


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)

    w0 = init_weights()
    tokens = make_tokens()

    loss0, grads0 = loss_and_grads(w0, tokens[0])

    # Pick the clip threshold from an unclipped run: halfway between the 2nd and 3rd smallest
    # norms, rounded to 2 significant digits, so that clipping is active (coef < 1) in 3 of the
    # 5 steps and inactive in the others (both branches exercised). Verified on the real run.
    _, norms_free, _ = train(w0, tokens, clip=None)
    srt = sorted(norms_free)
    clip = float(f"{0.5 * (srt[1] + srt[2]):.2g}")
    print("unclipped grad norms:", " ".join(f"{x:.6f}" for x in norms_free), f"-> clip {clip}")

    losses, norms, final = train(w0, tokens, clip=clip)
    coefs = [min(1.0, clip / (n + CLIP_EPS)) for n in norms]
    active = sum(c < 1.0 for c in coefs)
    assert 3 <= active < STEPS, (norms, clip)
    # No norm within 2% of the threshold, so a float-level difference can't flip a branch.
    assert all(abs(n - clip) > 0.02 * clip for n in norms), (norms, clip)
    assert abs(losses[0] - float(loss0)) == 0.0, (losses[0], float(loss0))

    # Determinism: a second run gives bit-identical results.
    losses2, norms2, final2 = train(w0, tokens, clip=clip)
    assert losses2 == losses and norms2 == norms
    assert all(torch.equal(final[n], final2[n]) for n in final)

    check_float64_and_fd(w0, tokens[0])
    check_adamw_by_hand(w0, tokens, clip, losses, final)

    try:
        import transformers  # noqa: F401
        cross_check_transformers(w0, tokens[0], float(loss0))
    except ImportError:
        print("transformers not importable: skipping HF cross-check")

    # ---- write files ----
    names = [n for n, _ in param_shapes()]
    os.makedirs(os.path.join(HERE, "tiny"), exist_ok=True)
    write_safetensors(os.path.join(HERE, "tiny", "model.safetensors"),
                      [(n, w0[n].numpy()) for n in names], {"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "vocab_size": V,
        "max_position_embeddings": T,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
    }
    with open(os.path.join(HERE, "tiny", "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    meta = {
        "lr": repr(LR), "beta1": repr(BETA1), "beta2": repr(BETA2), "eps": repr(ADAM_EPS),
        "weight_decay": repr(WD), "weight_decay_applies_to": "2-D tensors only",
        "clip": repr(clip), "clip_eps": repr(CLIP_EPS), "steps": str(STEPS),
        "batch": str(B), "seq": str(T), "num_batches": str(NBATCH),
        "rms_norm_eps": repr(EPS), "rope_theta": repr(THETA),
        "seed_weights": str(SEED_WEIGHTS), "seed_data": str(SEED_DATA), "motif_vocab": str(MOTIF_VOCAB),
        "torch_version": torch.__version__,
        "generator": "tests/reference/make_fixture.py",
    }
    ts = [("tokens", tokens.numpy()),
          ("loss0", np.array([float(loss0)], dtype=np.float32))]
    ts += [("grad." + n, grads0[n].numpy()) for n in names]
    ts += [("losses", np.array(losses, dtype=np.float32)),
           ("grad_norms", np.array(norms, dtype=np.float32))]
    ts += [("final." + n, final[n].numpy()) for n in names]
    fx = os.path.join(HERE, "fixture.safetensors")
    write_safetensors(fx, ts, meta)

    # Round-trip check of the writer.
    back, meta_back = read_safetensors(fx)
    assert meta_back == meta
    for n, a in ts:
        assert back[n].dtype.kind == a.dtype.kind and np.array_equal(back[n], a), n

    print("---- summary ----")
    print(f"params: {sum(w0[n].numel() for n in names)}")
    print(f"loss0 = {float(loss0):.7f}  (ln V = {math.log(V):.7f})")
    print("losses     =", " ".join(f"{x:.7f}" for x in losses))
    print("grad_norms =", " ".join(f"{x:.7f}" for x in norms))
    print("clip coef  =", " ".join(f"{c:.4f}" for c in coefs), f"(active in {active}/{STEPS})")
    print(f"clip = {clip}")
    for p in [os.path.join(HERE, "tiny", "model.safetensors"),
              os.path.join(HERE, "tiny", "config.json"), fx]:
        print(f"wrote {os.path.relpath(p, os.path.dirname(os.path.dirname(HERE)))}"
              f" ({os.path.getsize(p)} bytes)")


def cross_check_transformers(w0, tokens, loss0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=L,
                      num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=T,
                      rms_norm_eps=EPS, rope_theta=THETA, tie_word_embeddings=False,
                      hidden_act="silu", attention_bias=False)
    m = LlamaForCausalLM(cfg).float().eval()
    m.load_state_dict({n: t.clone() for n, t in w0.items()}, strict=False)
    inp, tgt = tokens[:, :-1].long(), tokens[:, 1:].long()
    with torch.no_grad():
        logits = m(input_ids=inp).logits
    hf = float(F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1)))
    assert abs(hf - loss0) < 1e-5, (hf, loss0)
    print(f"transformers cross-check: loss {hf:.7f} vs {loss0:.7f} ok")


if __name__ == "__main__":
    sys.exit(main())
