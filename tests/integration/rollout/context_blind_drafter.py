"""A tiny checkpoint whose MTP head drafts the target's next token as if the trunk added no context.

The tiny factory's heads are either random (acceptance ~0: every draft rejected) or built for a silent trunk
(the bigram oracle: acceptance ~1, and no layer reads positions or the KV cache). Pipeline-parallel bookkeeping
bugs hide in both: with every draft rejected the accepted count never leaves its default; with a silent trunk
wrong positions change nothing. This rewrite of a random tiny checkpoint gives a trunk that matters and drafts
that are right only some of the time: embeddings scaled to dominate the residual stream (the random blocks then
perturb each next token through attention over the cache, and for Qwen3.5 the Gated DeltaNet recurrence), and an
MTP layer that passes the token's embedding straight through (silent block, identity token path), so it drafts
argmax lm_head(norm(embed(token))): accepted where the trunk's perturbation did not flip the target's choice.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EMBED_SCALE = 6.0   # tiny embeddings are drawn with std 0.02: the trunk flips about 4 in 10 of the drafts


def _silence_block(sd: dict[str, torch.Tensor], prefix: str) -> None:
    for name in list(sd):
        if name.startswith(prefix) and name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = torch.zeros_like(sd[name])


def context_blind_drafter(src: Path, out: Path) -> Path:
    """Rewrite the random tiny checkpoint `src` (MiMo or Qwen3.5 family) into `out` (returned)."""
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    files = sorted(tmp.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    arch = json.loads((tmp / "config.json").read_text())["architectures"][0]
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * EMBED_SCALE
    h = sd["model.embed_tokens.weight"].shape[1]
    eye, zero = torch.eye(h), torch.zeros(h, h)
    if arch == "MiMoForCausalLM":   # vLLM: input_proj(cat([hidden_layernorm(prev_hidden), token_layernorm(embed)]))
        _silence_block(sd, "model.mtp_layers.0.")
        sd["model.mtp_layers.0.input_proj.weight"] = torch.cat([zero, eye], dim=1)
    elif arch == "Qwen3_5ForCausalLM":   # vLLM: fc(cat([pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)]))
        _silence_block(sd, "mtp.layers.0.")
        sd["mtp.fc.weight"] = torch.cat([eye, zero], dim=1)
    else:
        raise ValueError(f"no context-blind drafter for architecture {arch!r}")
    for f in files:
        f.unlink()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"))
    tmp.rename(out)
    return out
