"""vLLM's own EAGLE-3 Llama drafter (llama_eagle3.Eagle3LlamaForCausalLM) on the weights of an export, beside
skyrl_mtp's Eagle3Drafter, in a process of its own (vLLM's distributed state stays out of the pytest process).

    python vllm_eagle3_reference.py WORK_DIR      -> prints one JSON line of max abs differences

WORK_DIR gets a target config.json (a tiny Llama 3 with RoPE scaling; vLLM reads only its config, the target's
weights are never loaded) and the export of a random drafter (norm scales perturbed, so every tensor matters).
The model is built and loaded as vLLM's loader does (initialize_model, load_weights from the checkpoint's
names, process_weights_after_loading: the CPU backend repacks the linear weights). vLLM's attention kernel needs
an engine's KV cache and forward context; it is replaced by plain attention with the KV-cache semantics of
SpecDecodeBaseProposer.propose (pass 1: causal over the verified tokens; draft 2 from index t: keys 0..t of
pass 1 plus its own), so everything else (fc, norms, q/k/v over 2H, RoPE, o_proj, MLP, the two outputs) is
vLLM's code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192},
          "vocab_size": 512, "max_position_embeddings": 65536, "tie_word_embeddings": False,
          "torch_dtype": "float32"}


class KVCacheAttention(torch.nn.Module):
    """Stands in for vLLM's Attention: ``upto=None`` is a causal first pass (its K/V kept); ``upto=t`` is the
    second draft from index t (one query, keys 0..t of the first pass and its own)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None
        self.upto: int | None = None

    def forward(self, q, k, v):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        group = self.heads // self.kv_heads
        k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(group, 0)
        v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(group, 0)
        if self.upto is None:
            self.kept = (k, v)
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        else:
            keys = torch.cat([self.kept[0][:, :self.upto + 1], k], 1)
            values = torch.cat([self.kept[1][:, :self.upto + 1], v], 1)
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None])[0]
        return out.transpose(0, 1).reshape(t, self.heads * self.head_dim)


def main(work: Path) -> dict:
    from safetensors.torch import load_file

    from skyrl_mtp.drafters.eagle3 import Eagle3Cache, Eagle3Config, Eagle3Drafter
    from skyrl_mtp.drafters.eagle3_export import WEIGHTS, export_eagle3

    (work / "target").mkdir(parents=True, exist_ok=True)
    (work / "target" / "config.json").write_text(json.dumps(TARGET))
    cfg = Eagle3Config.from_target(TARGET)
    g = torch.Generator().manual_seed(1)
    mine = Eagle3Drafter(cfg, g)
    with torch.no_grad():
        for name, p in mine.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    export = export_eagle3(mine, cfg, work / "drafter")

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from skyrl_mtp.net import free_port

    vllm_config = EngineArgs(model=str(work / "target"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                             max_model_len=256, speculative_config={"method": "eagle3", "model": str(export),
                                                                    "num_speculative_tokens": 2}).create_engine_config()
    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=vllm_config, model_config=draft_config)
        model.load_weights(load_file(str(export / WEIGHTS)).items())
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
        attn = KVCacheAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        model.model.layers[0].self_attn.attn = attn

        t, h = 12, cfg.hidden_size
        aux = torch.randn(t, 3 * h, generator=g)
        embeds = 0.05 * torch.randn(t, h, generator=g)
        embeds2 = 0.05 * torch.randn(t, h, generator=g)
        positions = torch.arange(100, 100 + t)   # past the first positions: RoPE frequencies matter
        with torch.no_grad():
            combined = model.combine_hidden_states(aux)
            fc = float((combined - mine.fc(aux)).abs().max())
            hidden, prenorm = model(input_ids=None, positions=positions, hidden_states=combined, inputs_embeds=embeds)
            cache = Eagle3Cache()
            first = mine(embeds[None], aux[None], positions[None], cache)
            second = mine(embeds2[None], first.next_hidden, positions[None] + 1, cache)
            draft2 = 0.0
            for i in range(t):
                attn.upto = i
                h2, p2 = model(input_ids=None, positions=positions[i:i + 1] + 1, hidden_states=prenorm[i:i + 1],
                               inputs_embeds=embeds2[i:i + 1])
                draft2 = max(draft2, float((h2[0] - second.hidden[0, i]).abs().max()),
                             float((p2[0] - second.next_hidden[0, i]).abs().max()))
        rope = {}
        for theta, scaling in ((500000.0, TARGET["rope_scaling"]), (1000000.0, None)):
            params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
            theirs = get_rope(cfg.head_dim, max_position=4096, rope_parameters=params, is_neox_style=True)
            ours = Eagle3Config.from_target({**TARGET, "rope_theta": theta, "rope_scaling": scaling}).inverse_frequencies()
            angles = torch.arange(4096.0)[:, None] * ours
            cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
            rope["llama3" if scaling else "default"] = float((theirs.cos_sin_cache - cos_sin).abs().max())
    return {
        "architecture": type(model).__name__,
        "shares_target_lm_head": not model.has_own_lm_head,
        "shares_target_embed_tokens": not model.has_own_embed_tokens,
        "aux_layer_ids": list(vllm_config.speculative_config.draft_model_config.hf_config.eagle_config[
            "eagle_aux_hidden_state_layer_ids"]),
        "fc": fc,
        "pass1_hidden": float((hidden - first.hidden[0]).abs().max()),
        "pass1_next_hidden": float((prenorm - first.next_hidden[0]).abs().max()),
        "draft2": draft2,
        "rope": rope,
        "scale": float(hidden.abs().mean()),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
