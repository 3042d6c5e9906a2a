"""Train-step throughput of one Megatron policy rank on its device: tokens/s, model FLOP utilisation,
peak memory, and the share of the step the decoupled draft loss takes (SkyRL measured ~7% on
Qwen3.5-9B). Why: the number a GPU user sizes a run with, and the cost of training the MTP head.

MFU counts 6N over the non-embedding parameters (the output layer's GEMM included) plus causal attention's
FLOPs (6 x layers x S x heads x head_dim per token); HFU adds the forward that full recompute runs again.

    .venv/bin/python benchmarks/train_step_gpu.py [--hidden 2048 --layers 16 ... --json OUT]
    .venv/bin/python benchmarks/train_step_gpu.py --quick     # a tiny model, runs on CPU in seconds

The default size is a ~1B-parameter MiMo-shaped random model (random weights written as an HF
checkpoint first), bf16 with Megatron's DDP + distributed optimizer on CUDA (--layer-impl: sdpa by default there,
local or transformer_engine; torch's fused AdamW unless --foreach-adam); on a machine without CUDA the same code runs
on CPU (fp32, torch AdamW: the CPU path, the local layers), where MFU is not reported. The draft-loss share is
1 - t(train_head=False) / t(train_head=True) on the same batches. Each row also gives the peak the GPU memory plan
predicts for that step and the phase it peaks in (config/memory_plan.py; not the CUDA context), next to the measured
torch.cuda.max_memory_allocated (and max_memory_reserved), so the plan can be checked on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

QUICK = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512, batch=4, seq=64,
             micro_batch=2, steps=2, warmup=1)
# bf16 dense tensor-core peak, FLOP/s (vendor sheet, SXM parts)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _hf_cfg(a) -> dict:
    return {"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": a.hidden,
            "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
            "head_dim": a.hidden // a.heads, "intermediate_size": a.intermediate, "vocab_size": a.vocab,
            "max_position_embeddings": max(4096, a.seq), "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "hidden_act": "silu",
            "torch_dtype": "float32"}


def _mimo_checkpoint(out: Path, a) -> Path:
    import torch
    from safetensors.torch import save_file

    head_dim = a.hidden // a.heads
    cfg = _hf_cfg(a)
    g = torch.Generator().manual_seed(0)
    q, kv = a.heads * head_dim, a.kv_heads * head_dim

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    def block(p):
        return {p + "self_attn.q_proj.weight": r(q, a.hidden), p + "self_attn.q_proj.bias": r(q),
                p + "self_attn.k_proj.weight": r(kv, a.hidden), p + "self_attn.k_proj.bias": r(kv),
                p + "self_attn.v_proj.weight": r(kv, a.hidden), p + "self_attn.v_proj.bias": r(kv),
                p + "self_attn.o_proj.weight": r(a.hidden, q), p + "mlp.gate_proj.weight": r(a.intermediate, a.hidden),
                p + "mlp.up_proj.weight": r(a.intermediate, a.hidden),
                p + "mlp.down_proj.weight": r(a.hidden, a.intermediate),
                p + "input_layernorm.weight": torch.ones(a.hidden),
                p + "post_attention_layernorm.weight": torch.ones(a.hidden)}

    sd = {"model.embed_tokens.weight": r(a.vocab, a.hidden), "model.norm.weight": torch.ones(a.hidden),
          "lm_head.weight": r(a.vocab, a.hidden)}
    for i in range(a.layers):
        sd.update(block(f"model.layers.{i}."))
    p = "model.mtp_layers.0."
    sd.update(block(p))
    sd.update({p + n: torch.ones(a.hidden) for n in ("token_layernorm.weight", "hidden_layernorm.weight",
                                                      "final_layernorm.weight")})
    sd[p + "input_proj.weight"] = r(a.hidden, 2 * a.hidden)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(sd, str(out / "model.safetensors"))
    return out


def predicted_peak_bytes(a, hf_cfg: dict, dtype: str, layer_impl: str, fused_adam: bool) -> dict[str, int]:
    """The memory plan's peak of one rank's train step at this shape (what torch's allocator hands out: no CUDA
    context), with and without the draft loss, and the phase that peaks."""
    from skyrl_mtp.config import compose_config
    from skyrl_mtp.config.memory_plan import model_shape, policy_memory

    prompt = a.seq // 4   # random_dapo_batch: a quarter prompt, the rest response (loss positions)
    cfg = compose_config(["recipe=tiny_dapo", f"megatron.micro_batch_size={a.micro_batch}", f"megatron.dtype={dtype}",
                          f"megatron.recompute_activations={str(bool(a.recompute)).lower()}",
                          f"generator.max_model_len={a.seq}", f"data.max_prompt_length={prompt}",
                          f"generator.sampling.max_tokens={a.seq - prompt}", "trainer.mtp.num_speculative_tokens=1",
                          "megatron.mtp_loss_chunk_size=auto", f"megatron.layer_impl={layer_impl}"])
    mem = policy_memory(model_shape(cfg, hf_cfg), cfg, flash=layer_impl != "local", fused_adam=fused_adam)
    static = mem.weights + mem.grads + mem.optimizer
    phases = {k: sum(v.values()) for k, v in mem.step_phases.items()}
    off = max((k for k in phases if k != "draft loss"), key=phases.__getitem__)
    return {"mtp_on": static + mem.step, "mtp_off": static + mem.step_without_draft_loss,
            "phase_mtp_on": mem.step_peak[0], "phase_mtp_off": off}


def model_flops_per_token(a) -> dict[str, float]:
    """FLOPs per trained token of the policy (forward + backward = 3 x forward), its MTP head aside:
    - model: 6 N with N the non-embedding parameters (the decoder layers; the output layer's GEMM counted, the
      embedding lookup not), plus causal attention's two GEMMs, QK^T and PV: 2 x 2 x S x (heads x head_dim) per layer
      forward, halved by the causal mask (the usual 6N + 6 x L x S x H_attn);
    - hardware: what the GPU executes, with full recompute one more forward of every decoder layer (4 x forward)."""
    h, d = a.hidden, a.hidden // a.heads
    attn_w = 2 * h * a.heads * d + 2 * h * a.kv_heads * d      # q, o and k, v projections
    layer = attn_w + 3 * h * a.intermediate                    # + SwiGLU (gate, up, down)
    out_layer = a.vocab * h
    layer_fwd = 2 * layer + 2 * a.seq * a.heads * d            # GEMMs + causal attention (2 x 2 x S x H / 2)
    fwd = a.layers * layer_fwd + 2 * out_layer
    hw = fwd * 3 + (a.layers * layer_fwd if a.recompute else 0)
    return {"model": 3 * fwd, "hardware": hw, "six_n_embed": 6 * (a.layers * layer + 2 * out_layer)}


def _peak_mem_mb(cuda: bool, reserved: bool = False) -> float:
    import torch

    if cuda:
        return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / 2**20
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def run(a) -> dict:
    import torch

    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron.device import rank_device
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy
    from skyrl_mtp.policy.synthetic_batch import random_dapo_batch

    dev = rank_device()
    dtype = a.dtype or ("bfloat16" if dev.is_cuda else "float32")
    layer_impl = a.layer_impl or ("sdpa" if dev.is_cuda else "local")
    with tempfile.TemporaryDirectory(prefix="train_step_gpu_") as tmp:
        ckpt = _mimo_checkpoint(Path(tmp) / "ckpt", a)
        cfg = PolicyWorkerConfig(policy_lr=1e-6, head_lr=1e-4, micro_batch_size=a.micro_batch, dtype=dtype,
                                 recompute_activations=a.recompute, export_hf=False, export_draft_head=False,
                                 layer_impl=layer_impl, fused_adam=not a.foreach_adam)
        pol = MegatronPolicy(cfg, str(ckpt), 0, 1, "127.0.0.1", free_port())
    n_params = sum(p.numel() for p in pol.policy_params)
    # the policy side's optimizer steps fused: TE's FusedAdam, or torch's AdamW with its fused flag (both paths)
    fused = bool(pol.transformer_engine) or all(g.get("fused") for g in pol.policy_side.torch_optimizer.param_groups)
    predicted = predicted_peak_bytes(a, _hf_cfg(a), dtype, layer_impl, fused)
    flops = model_flops_per_token(a)
    batch = random_dapo_batch(torch.Generator().manual_seed(0), a.batch, a.seq, vocab=a.vocab)
    tokens = a.batch * a.seq
    gpu = torch.cuda.get_device_name(0) if dev.is_cuda else None
    peak = next((v for k, v in PEAK_FLOPS.items() if gpu and k in gpu), None)
    rows = []
    for setting, head in (("mtp_on", True), ("mtp_off", False)):
        for _ in range(a.warmup):
            pol.train_step(batch, "dapo", {}, train_head=head)
        _reset_peak(dev.is_cuda)
        if dev.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            m = pol.train_step(batch, "dapo", {}, train_head=head)
        if dev.is_cuda:
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / a.steps
        tps = tokens / step_s
        # model FLOPs utilisation (non-embedding 6N + attention) and hardware FLOPs utilisation (with recompute's
        # extra forward); mfu_6n_embed: the 6N-with-embedding figure of earlier reports, for comparison
        mfu = flops["model"] * tps / peak if peak else None
        hfu = flops["hardware"] * tps / peak if peak else None
        rows.append({"setting": setting, "step_s": step_s, "tokens_per_s": tps, "mfu": mfu, "hfu": hfu,
                     "mfu_6n_embed": flops["six_n_embed"] * tps / peak if peak else None,
                     "peak_mem_mb": _peak_mem_mb(dev.is_cuda),
                     "peak_reserved_mb": _peak_mem_mb(dev.is_cuda, reserved=True) if dev.is_cuda else None,
                     "predicted_peak_mb": predicted[setting] / 2**20, "predicted_phase": predicted[f"phase_{setting}"],
                     "policy_loss": m["policy/loss"]})
    on, off = rows[0]["step_s"], rows[1]["step_s"]
    return {"device": gpu or "cpu", "dtype": dtype, "params": n_params, "tokens_per_step": tokens,
            "optimizer": type(pol.policy_side).__name__, "transformer_engine": bool(pol.transformer_engine),
            "layer_impl": layer_impl, "fused_adam": fused, "recompute": bool(a.recompute),
            "fused_swiglu": bool(cfg.fused_swiglu and dev.is_cuda),
            "draft_loss_share": 1.0 - off / on, "rows": rows,
            "shape": {k: getattr(a, k) for k in QUICK}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--recompute", action="store_true", help="Megatron full activation recompute")
    ap.add_argument("--layer-impl", dest="layer_impl", choices=("local", "sdpa", "transformer_engine"), default=None,
                    help="megatron.layer_impl (default: sdpa on CUDA, local on CPU)")
    ap.add_argument("--foreach-adam", dest="foreach_adam", action="store_true",
                    help="torch's foreach AdamW as megatron-core builds it (default: the fused kernel on GPUs)")
    ap.add_argument("--quick", action="store_true", help="tiny model, a couple of steps (runs on CPU)")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    if a.quick:
        defaults = ap.parse_args([])
        for k, v in QUICK.items():
            if getattr(a, k) == getattr(defaults, k):
                setattr(a, k, v)
    res = run(a)
    print(f"device={res['device']} dtype={res['dtype']} params={res['params'] / 1e6:.1f}M "
          f"optimizer={res['optimizer']} layer_impl={res['layer_impl']} fused_adam={res['fused_adam']} "
          f"fused_swiglu={res['fused_swiglu']} "
          f"recompute={res['recompute']} tokens/step={res['tokens_per_step']}")
    print(f"{'setting':<8} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'HFU':>6} {'peak MiB':>9} {'reserved':>9} "
          f"{'plan MiB':>9}  plan's peak phase")

    def pct(v):
        return f"{v:.1%}" if v is not None else "n/a"

    for r in res["rows"]:
        reserved = f"{r['peak_reserved_mb']:.0f}" if r["peak_reserved_mb"] is not None else "n/a"
        print(f"{r['setting']:<8} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.1f} {pct(r['mfu']):>6} {pct(r['hfu']):>6} "
              f"{r['peak_mem_mb']:>9.0f} {reserved:>9} {r['predicted_peak_mb']:>9.0f}  {r['predicted_phase']}")
    print(f"draft loss share of the step: {res['draft_loss_share']:.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
