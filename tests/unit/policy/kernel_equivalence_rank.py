"""Body of the one spawned process of test_policy_kernels.py (megatron-core's parallel state and CPU shim stay out of
the test process): the SDPA core attention against megatron-core's local DotProductAttention, fp32, on the module
and on whole tiny models of every family, and the fused SwiGLU against the unfused MLP. Returns the largest absolute
differences it found."""

from __future__ import annotations

import time

import torch


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _core_attention_cases() -> dict[str, float]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyrl_mtp.models.families.sdpa_attention import sdpa_core_attention
    from skyrl_mtp.policy.batch_layout import packed_mask

    out = {}
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    for groups in (2, 4):   # GQA (4 heads share 2 k/v groups) and plain multi-head
        cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                                kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
                                use_cpu_initialization=True)
        kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        local, sdpa = DotProductAttention(cfg, **kw), sdpa_core_attention()(cfg, **kw)
        g = torch.Generator().manual_seed(groups)
        s, b = seg.shape[1], seg.shape[0]
        q0 = torch.randn(s, b, 4, 16, generator=g)
        k0, v0 = (torch.randn(s, b, groups, 16, generator=g) for _ in range(2))
        grad_out = torch.randn(s, b, 64, generator=g)
        for name, mask in (("causal", None), ("packed", packed_mask(seg))):
            res = []
            for module in (local, sdpa):
                q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
                y = module(q, k, v, mask)
                y.backward(grad_out)
                res.append((y, q.grad, k.grad, v.grad))
            key = f"{name}/{'gqa' if groups < 4 else 'mha'}"
            out[f"{key}/out"] = _max_diff(res[0][0], res[1][0])
            out[f"{key}/grad"] = max(_max_diff(a, c) for a, c in zip(res[0][1:], res[1][1:]))
            out[f"{key}/scale"] = float(res[0][0].detach().abs().max())
    # the local attention's raw scores live in megatron-core's global buffer until the hand-over to the engines
    from megatron.core import parallel_state

    from skyrl_mtp.policy.megatron.device import release_attention_buffer

    held = parallel_state.get_global_memory_buffer().buffer
    out["buffer/held_bytes"] = float(sum(t.numel() * t.element_size() for t in held.values()))
    out["buffer/released"] = float(release_attention_buffer())
    out["buffer/after"] = float(len(held)) + float(release_attention_buffer())
    return out


def _family_cases() -> dict[str, float]:
    from skyrl_mtp.models.families import family_for_config
    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config
    from skyrl_mtp.policy.batch_layout import prepare

    out = {}
    for family in ("mimo", "qwen3_5", "deepseek_v3", "glm4_moe"):
        t0 = time.perf_counter()
        hf = hf_config(TinyModelSpec(family=family, mtp_layers=1), None)
        fam = family_for_config(hf)
        args = fam.args_from_config(hf)
        # where the core attention sits, MTP layer included (a forward with MTP layers needs labels: compared
        # below on the trunk, whose layers are built from the same specs)
        with_mtp = fam.build_model(args, mtp_num_layers=1, dtype="float32", transformer_engine=False, sdpa=True)
        kinds = {n: type(m).__name__ for n, m in with_mtp.named_modules() if n.endswith("core_attention")}
        out[f"{family}/sdpa_modules"] = float(sum(k.startswith("SDPA") for k in kinds.values()))
        out[f"{family}/mtp_sdpa"] = float(any(n.startswith("mtp.") and k.startswith("SDPA") for n, k in kinds.items()))
        out[f"{family}/attention_layers"] = float(len(kinds))
        del with_mtp
        models = []
        for sdpa in (False, True):
            torch.manual_seed(0)
            models.append(fam.build_model(args, mtp_num_layers=0, dtype="float32", transformer_engine=False,
                                          sdpa=sdpa))
        local, sdpa = models
        sdpa.load_state_dict(local.state_dict())
        out[f"{family}/local_has_sdpa"] = float(any(type(m).__name__.startswith("SDPA") for m in local.modules()))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab_size, (2, 24), generator=g)
        batches = {"causal": {"input_ids": ids}}
        if fam.supports_packed_sequences:
            batches["packed"] = {"input_ids": ids, "segment_ids": torch.tensor([[0] * 10 + [1] * 14, [0] * 24])}
        for name, raw in batches.items():
            mb = prepare(raw)
            res = []
            for model in (local, sdpa):
                model.zero_grad(set_to_none=True)
                logits = model(mb["input_ids"], mb["position_ids"], mb["megatron_mask"])
                logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)))
                grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                res.append((logits, grads))
            out[f"{family}/{name}/logits"] = _max_diff(res[0][0], res[1][0])
            assert res[0][1].keys() == res[1][1].keys()
            out[f"{family}/{name}/grads"] = max(_max_diff(res[0][1][n], res[1][1][n]) for n in res[0][1])
            out[f"{family}/{name}/n_grads"] = float(len(res[0][1]))
            out[f"{family}/{name}/grad_scale"] = max(float(g.abs().max()) for g in res[0][1].values())
        out[f"{family}/seconds"] = time.perf_counter() - t0
    return out


def _fused_swiglu_case() -> dict[str, float]:
    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config
    from skyrl_mtp.policy.batch_layout import prepare
    from skyrl_mtp.policy.megatron.model_builder import (
        build_gpt_model,
        enable_fused_swiglu,
        model_args_from_config,
    )

    args = model_args_from_config(hf_config(TinyModelSpec(family="glm4_moe", mtp_layers=1), None))   # dense + MoE MLPs
    models = []
    for fused in (False, True):
        torch.manual_seed(0)
        models.append(build_gpt_model(args, mtp_num_layers=0, fused_swiglu=fused))
    plain, fused = models
    fused.load_state_dict(plain.state_dict())
    out = {"swiglu/switched": float(enable_fused_swiglu(fused)),
           "swiglu/plain_flag": float(any(m.config.bias_activation_fusion for m in plain.modules()
                                          if type(m).__name__ == "MLP"))}
    ids = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    mb = prepare({"input_ids": ids})
    res = []
    for model in (plain, fused):
        logits = model(mb["input_ids"], mb["position_ids"], mb["megatron_mask"])
        logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(4)))
        res.append((logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    out["swiglu/logits"] = _max_diff(res[0][0], res[1][0])
    out["swiglu/grads"] = max(_max_diff(res[0][1][n], res[1][1][n]) for n in res[0][1])
    out["swiglu/grad_scale"] = max(float(g.abs().max()) for g in res[0][1].values())
    return out


def run(_idx: int, out_path: str) -> None:
    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.megatron.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp=1, seed=0)
    try:
        res = {**_core_attention_cases(), **_family_cases(), **_fused_swiglu_case()}
    finally:
        destroy_distributed()
    torch.save(res, out_path)
