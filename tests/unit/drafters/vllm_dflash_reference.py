"""vLLM's own DFlash drafter (qwen3_dflash.DFlashQwen3ForCausalLM) on the weights of an export, run with vLLM's CPU
attention backend and a real KV cache, beside skyrl_mtp's DFlashDrafter, in a process of its own (vLLM's
distributed state stays out of the pytest process).

    python vllm_dflash_reference.py WORK_DIR parity   -> one JSON line: max abs differences, draft tokens, without
                                                         and with skyrl_mtp.vllm_patches.dflash_context_norm
    python vllm_dflash_reference.py WORK_DIR reload   -> one JSON line: a layer-wise draft reload, without and with
                                                         skyrl_mtp.vllm_patches.dflash_reload

WORK_DIR gets a target config.json (a tiny Qwen3; vLLM reads only its config, the target's weights are never loaded)
and the export of a random 2-layer drafter (norm scales perturbed, so every tensor matters, the per-layer k_norm
included). The model is built and loaded as vLLM's loader does (initialize_model, load_weights from the
checkpoint's names, process_weights_after_loading). Its embed_tokens / lm_head get the random "target" tensors
(vLLM shares the target's, see SpecDecodeBaseProposer._maybe_share_*). Each proposal then runs DFlashProposer's
sequence on one request: combine_hidden_states (fc), precompute_and_store_context_kv for the NEW context rows only
(the earlier ones stay in the KV cache from the previous proposal, as in an engine), and the model's forward over
[anchor, mask x k] under a forward context whose CPU attention metadata is built by vLLM's CPUAttentionMetadataBuilder
(non-causal, seq_len = context + 1 + k), then compute_logits on the mask slots.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 512,
          "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32"}
K = 3            # num_speculative_tokens: block_size - 1
ANCHORS = (9, 11, 15, 40)   # successive proposals of one request: anchor positions (context = all before)


def make_drafter(work: Path, seed: int = 1):
    from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter
    from skyrl_mtp.drafters.dflash_export import export_dflash

    (work / "target").mkdir(parents=True, exist_ok=True)
    (work / "target" / "config.json").write_text(json.dumps(TARGET))
    cfg = DFlashConfig.from_target(TARGET, target_layer_ids=(0, 2, 3), num_layers=2, block_size=K + 1,
                                   mask_token_id=511)
    g = torch.Generator().manual_seed(seed)
    mine = DFlashDrafter(cfg, g)
    with torch.no_grad():
        for name, p in mine.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            else:   # past the small init: outputs that differ from slot to slot, so the drafts are a real check
                p.mul_(5.0)
    return cfg, mine, export_dflash(mine, cfg, work / f"drafter{seed}")


def vllm_setup(work: Path, export: Path):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    from skyrl_mtp.net import free_port

    vllm_config = EngineArgs(model=str(work / "target"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                             max_model_len=256, speculative_config={"method": "dflash", "model": str(export),
                                                                    "num_speculative_tokens": K}
                             ).create_engine_config()
    ctx = set_current_vllm_config(vllm_config)
    ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(1, 1)
    return vllm_config


def build_model(vllm_config, export: Path, embed: torch.Tensor, lm_head: torch.Tensor, prefix_free: bool = True):
    """The drafter as vLLM loads it, holding the "target's" embedding and lm_head (set before
    process_weights_after_loading: the CPU backend prepacks the lm_head for its GEMM there)."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from skyrl_mtp.drafters.dflash_export import WEIGHTS

    draft_config = vllm_config.speculative_config.draft_model_config
    if prefix_free:   # a second model in the same config registers the same attention layer names
        vllm_config.compilation_config.static_forward_context.clear()
    model = initialize_model(vllm_config=vllm_config, model_config=draft_config)
    model.load_weights(load_file(str(export / WEIGHTS)).items())
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight[:lm_head.shape[0]].copy_(lm_head)
    process_weights_after_loading(model, draft_config, torch.device("cpu"))
    return model


class Engine:
    """One request's KV cache and the forward context of DFlashProposer's single query pass."""

    def __init__(self, vllm_config, model, num_blocks: int = 4):
        self.vllm_config, self.model = vllm_config, model
        ctx = vllm_config.compilation_config.static_forward_context
        self.names = model.get_draft_kv_cache_layer_names()
        self.layers = [ctx[n] for n in self.names]
        spec = self.layers[0].get_kv_cache_spec(vllm_config)
        self.block = spec.block_size
        backend = self.layers[0].attn_backend
        # CPUAttentionBackendImpl.forward's layout: [num_blocks, kv_heads, block_size, 2 * head_size]
        shape = (num_blocks, spec.num_kv_heads, self.block, 2 * spec.head_size)
        for layer in self.layers:
            layer.kv_cache = torch.zeros(shape, dtype=spec.dtype)
        self.builder = backend.get_builder_cls()(spec, self.names, vllm_config, torch.device("cpu"))
        self.block_table = torch.arange(num_blocks, dtype=torch.int32)[None]

    def propose(self, aux_new: torch.Tensor, start: int, anchor_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows start..start+len(aux_new)-1 (new since the last proposal), anchor at the next position:
        (hidden [1 + K, H], draft tokens [K])."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        model, model_cfg = self.model, self.model.config
        anchor = start + aux_new.shape[0]
        ctx_pos = torch.arange(start, anchor)
        combined = model.combine_hidden_states(aux_new)
        model.precompute_and_store_context_kv(combined, ctx_pos, ctx_pos.clone())    # slot = position (block 0..)
        q_pos = torch.arange(anchor, anchor + K + 1)
        mask_id = model_cfg.dflash_config["mask_token_id"]
        ids = torch.tensor([anchor_id] + [mask_id] * K, dtype=torch.int32)
        seq_len = anchor + K + 1
        cad = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, K + 1], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, K + 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32), num_reqs=1, num_actual_tokens=K + 1,
            max_query_len=K + 1, max_seq_len=seq_len, block_table_tensor=self.block_table,
            slot_mapping=q_pos.clone(), causal=False)
        md = self.builder.build(0, cad)
        with set_forward_context({n: md for n in self.names}, self.vllm_config, num_tokens=K + 1,
                                 slot_mapping={n: q_pos.clone() for n in self.names}):
            hidden = model(input_ids=ids, positions=q_pos)
        logits = model.compute_logits(hidden[1:])
        return hidden, logits


def run_proposals(engine: Engine, mine, aux, ids, embed, lm_head) -> dict:
    from skyrl_mtp.drafters.dflash import block_hidden, propose

    worst, hits, total, theirs_all, mine_all = 0.0, 0, 0, [], []
    start = 0
    training = block_hidden(mine, aux[None], ids[None], embed, torch.tensor([ANCHORS]), block_size=K + 1)[0]
    worst_training, worst_logits = 0.0, 0.0
    for n, anchor in enumerate(ANCHORS):
        hidden, logits = engine.propose(aux[start:anchor], start, int(ids[anchor]))
        drafts = logits.argmax(-1)
        start = anchor
        with torch.no_grad():
            ours = propose(mine, aux[None, :anchor], torch.arange(anchor)[None], ids[anchor:anchor + 1],
                           torch.tensor([anchor]), embed, K)[0]
        worst = max(worst, float((hidden - ours).abs().max()))
        worst_training = max(worst_training, float((hidden - training[n]).abs().max()))
        our_logits = torch.nn.functional.linear(ours[1:], lm_head)
        worst_logits = max(worst_logits, float((logits[:, :lm_head.shape[0]] - our_logits).abs().max()))
        our_drafts = our_logits.argmax(-1)
        theirs_all.append(drafts.tolist())
        mine_all.append(our_drafts.tolist())
        hits += int((drafts == our_drafts).sum())
        total += K
    return {"hidden": worst, "hidden_vs_training_form": worst_training, "logits": worst_logits, "drafts_equal": hits, "drafts": total,
            "vllm_drafts": theirs_all, "our_drafts": mine_all, "scale": float(hidden.abs().mean())}


def inputs(cfg, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    t = max(ANCHORS) + 1
    aux = torch.randn(t, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (t,), generator=g)
    embed = 0.5 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm_head = 0.2 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    return aux, ids, embed, lm_head


def parity(work: Path) -> dict:
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from skyrl_mtp.vllm_patches import dflash_context_norm, dflash_reload

    cfg, mine, export = make_drafter(work)
    vllm_config = vllm_setup(work, export)
    aux, ids, embed, lm_head = inputs(cfg)
    model = build_model(vllm_config, export, embed, lm_head, prefix_free=False)
    res = {"architecture": type(model).__name__, "causal": model.get_draft_attn_causal(),
           "shares_target_lm_head": not model.has_own_lm_head,
           "shares_target_embed_tokens": not model.has_own_embed_tokens,
           "target_layer_ids": list(cfg.target_layer_ids),
           "aux_layer_ids": list(get_eagle3_aux_layers_from_config(vllm_config.speculative_config)),
           "fc": float((model.combine_hidden_states(aux) - mine.fc(aux)).abs().max()),
           "attention_backend": type(Engine(vllm_config, model).layers[0].impl).__name__}
    res["unpatched"] = run_proposals(Engine(vllm_config, model), mine, aux, ids, embed, lm_head)
    res["patch"] = dflash_context_norm.apply()
    res["patched"] = run_proposals(Engine(vllm_config, model), mine, aux, ids, embed, lm_head)
    res["reload_patch"] = dflash_reload.apply()    # a fresh engine with both patches (the served configuration)
    res["both_patches"] = run_proposals(Engine(vllm_config, model), mine, aux, ids, embed, lm_head)
    res["fused_kv_weight_dropped"] = model.model._fused_kv_weight is None
    return res


def reload(work: Path) -> dict:
    """A draft weight update as skyrl_mtp's CPU transport runs it (initialize_layerwise_reload, one load_weights
    call per tensor, finalize_layerwise_reload) from drafter 1's weights to drafter 2's, then a proposal; once
    without the reload patch, once with it (each on a fresh model)."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from skyrl_mtp.drafters.dflash_export import WEIGHTS
    from skyrl_mtp.vllm_patches import dflash_context_norm, dflash_reload

    dflash_context_norm.apply()
    cfg, _, first = make_drafter(work, seed=1)
    _, second_module, second = make_drafter(work, seed=2)
    vllm_config = vllm_setup(work, first)
    aux, ids, embed, lm_head = inputs(cfg)
    draft_config = vllm_config.speculative_config.draft_model_config
    res = {}
    for label in ("unpatched", "patched"):
        if label == "patched":
            res["patch"] = dflash_reload.apply()
        model = build_model(vllm_config, first, embed, lm_head)
        try:
            initialize_layerwise_reload(model)
            for name, weight in load_file(str(second / WEIGHTS)).items():
                model.load_weights([(name, weight)])
            finalize_layerwise_reload(model, draft_config)
            res[label] = run_proposals(Engine(vllm_config, model), second_module, aux, ids, embed, lm_head)
        except Exception as err:   # noqa: BLE001 - the unpatched failure is the result
            import traceback

            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)
                      if "dflash" in f.filename or "reload" in f.filename]
            res[label] = {"error": f"{type(err).__name__}: {err}"[:300], "where": frames[-3:]}
    return res


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "parity"
    with torch.no_grad():
        result = parity(Path(sys.argv[1])) if mode == "parity" else reload(Path(sys.argv[1]))
    print(json.dumps(result))
