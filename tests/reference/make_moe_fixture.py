#!/usr/bin/env python3
"""The DeepSeekMoE checkpoint of 01 in Hugging Face transformers: the reference for the C++ test.

    scripts/torch-venv.sh && build/torch-venv/bin/python -m pip install transformers
    build/torch-venv/bin/python tests/reference/make_moe_fixture.py

(transformers 5 needs torch 2, which Debian's python3-torch (1.13) is not: hence the venv.)

tests/reference/tiny_moe/ holds a checkpoint written by 01_single_gpu (its model.safetensors and
config.json, unchanged; the command is in README.md): DeepSeek-V3's MoE block (sigmoid router, the
selection-only bias after 30 steps of updates, 4 groups of which each token keeps 2, one shared
expert, routed scaling 2.5) on the GQA attention of the dense model. Its config.json names
transformers' Glm4MoeForCausalLM, the class that computes that function (DeepseekV3ForCausalLM has
the same MoE block but multi-head latent attention). This script:

  1. loads the checkpoint with Glm4MoeForCausalLM.from_pretrained, refusing any missing,
     unexpected or mismatched tensor, and checks that every tensor arrived (transformers packs the
     experts into [E, 2F, D] and [E, D, F]; they are compared with the file's per-expert ones);
  2. runs a batch of make_fixture.py's tokens (the first whose routing margins pass 3) (eager attention, fp32, one thread, deterministic):
     the loss (mean cross-entropy over B*T tokens, no balance loss) and its gradient for every
     parameter, and each layer's router choices;
  3. checks that fp32 rounding cannot change a choice: each kept group scores at least MARGIN above
     the best dropped one, and each chosen expert's biased score at least MARGIN above the best one
     not chosen, recomputed in float64 from the router's input;
  4. writes moe_fixture.safetensors: tokens, loss0, grad.<checkpoint name> for every parameter
     (the experts unpacked to the checkpoint's names), topk.<layer> (the chosen experts, sorted).

tests/test_moe.cpp loads the same checkpoint through tinyscale's loader and asserts the loss, every
gradient and the choices.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixture import B, T, make_tokens  # noqa: E402  (the dense fixture's data, batch 0)

CKPT = os.path.join(HERE, "tiny_moe")
# Two fp32 implementations' router logits (dot products of length D = 64 of values ~1) differ by
# about D·2⁻²⁴ ≈ 4e-6 at most, their sigmoids (slope ≤ 1/4) by 1e-6: a margin ten times that.
MARGIN = 1e-5


def load():
    from transformers import Glm4MoeForCausalLM
    model, info = Glm4MoeForCausalLM.from_pretrained(CKPT, dtype=torch.float32, attn_implementation="eager",
                                                     output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"the checkpoint does not load cleanly in Glm4MoeForCausalLM: {bad}")
    return model


def file_tensors():
    from safetensors.torch import load_file
    return load_file(os.path.join(CKPT, "model.safetensors"))


def hf_to_file_names(cfg, hf):
    """transformers' parameter name -> list of (checkpoint name, slice function)."""
    E, Fe = cfg.n_routed_experts, cfg.moe_intermediate_size
    if hf.endswith("mlp.experts.gate_up_proj"):
        p = hf[: -len("gate_up_proj")]
        return [(f"{p}{j}.{w}.weight", (lambda t, j=j, s=s: t[j, s])) for j in range(E)
                for w, s in (("gate_proj", slice(0, Fe)), ("up_proj", slice(Fe, 2 * Fe)))]
    if hf.endswith("mlp.experts.down_proj"):
        p = hf[: -len("down_proj")]
        return [(f"{p}{j}.down_proj.weight", (lambda t, j=j: t[j])) for j in range(E)]
    return [(hf, lambda t: t)]


def check_arrived(model, tensors):
    """Every file tensor reached the model, bit for bit, and nothing else is a parameter."""
    seen = set()
    named = dict(model.named_parameters())
    named.update({k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    for hf, t in named.items():
        for name, part in hf_to_file_names(model.config, hf):
            if not torch.equal(part(t.detach()), tensors[name]):
                sys.exit(f"{hf} does not hold the checkpoint's {name}")
            seen.add(name)
    missing = set(tensors) - seen
    if missing:
        sys.exit(f"checkpoint tensors the model did not take: {sorted(missing)}")
    bias = [t for k, t in named.items() if k.endswith("e_score_correction_bias")]
    print(f"{len(seen)} tensors arrived; routing bias max |b| {max(float(b.abs().max()) for b in bias):.4f}")


def routing(model, captured):
    """Per layer: the chosen experts [N, K] (sorted) and the smallest margins of the choice."""
    cfg = model.config
    E, K, G, M = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    out = []
    for layer, x in enumerate(captured):
        gate = model.model.layers[layer].mlp.gate
        s = torch.sigmoid(x.double() @ gate.weight.double().t())
        b = s + gate.e_score_correction_bias.double()
        grp = b.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)  # transformers' group score
        gs = grp.sort(dim=-1, descending=True)[0]
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter_(1, grp.topk(M, dim=-1)[1], True)
        masked = b.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        es = masked.sort(dim=-1, descending=True)[0]
        group_margin = float((gs[:, M - 1] - gs[:, M]).min()) if M < G else float("inf")
        expert_margin = float((es[:, K - 1] - es[:, K]).min())
        out.append((masked.topk(K, dim=-1)[1].sort(dim=-1)[0], group_margin, expert_margin))
    return out


def run_batch(model, tokens):
    """Loss and gradients on tokens [B, T+1]; the router inputs of every layer."""
    captured = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out: captured.append(inp[0].detach().view(-1, inp[0].shape[-1])))
        for layer in model.model.layers]
    model.zero_grad()
    logits = model(input_ids=tokens[:, :T]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    for h in hooks:
        h.remove()
    return loss.detach(), captured


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = load()
    check_arrived(model, file_tensors())
    for k, tokens in enumerate(make_tokens()):
        loss, captured = run_batch(model, tokens.long())
        with torch.no_grad():
            choices = routing(model, captured)
        worst = min(min(gm, em) for _, gm, em in choices)
        if worst >= MARGIN:
            break
        print(f"batch {k}: a routing margin is {worst:.2e} < {MARGIN}: next batch")
    else:
        sys.exit("no batch routes with margins above MARGIN")
    out = {"tokens": tokens[None].float().contiguous(), "loss0": loss.reshape(1)}
    for layer, (idx, gm, em) in enumerate(choices):
        # transformers' own choices equal the float64 recomputation (the margins make them stable).
        with torch.no_grad():
            _, _, hf_idx = model.model.layers[layer].mlp.gate(captured[layer])
        if not torch.equal(hf_idx.sort(dim=-1)[0], idx):
            sys.exit(f"layer {layer}: transformers' choices differ from the float64 recomputation")
        print(f"batch {k}, layer {layer}: smallest margin, group {gm:.2e}, expert {em:.2e}; "
              f"experts used {sorted(set(idx.flatten().tolist()))}")
        out[f"topk.{layer}"] = idx.float().contiguous()
    for hf, p in model.named_parameters():
        for name, part in hf_to_file_names(model.config, hf):
            out["grad." + name] = part(p.grad.detach()).contiguous()
    import transformers
    from safetensors.torch import save_file
    meta = {"generator": "make_moe_fixture.py", "torch": torch.__version__, "transformers": transformers.__version__}
    save_file(out, os.path.join(HERE, "moe_fixture.safetensors"), metadata=meta)
    print(f"Glm4MoeForCausalLM (transformers {transformers.__version__}, torch {torch.__version__}): "
          f"loss {float(loss):.7f} on batch {k} ({B}x{T} tokens); {len(out)} tensors written")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
