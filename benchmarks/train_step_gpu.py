"""Train-step throughput of one Megatron policy rank on its device: tokens/s, model FLOP utilisation,
peak memory, and the share of the step the decoupled draft loss takes (SkyRL measured ~7% on
Qwen3.5-9B). Why: the number a GPU user sizes a run with, and the cost of training the MTP head.

    .venv/bin/python benchmarks/train_step_gpu.py [--hidden 2048 --layers 16 ... --json OUT]
    .venv/bin/python benchmarks/train_step_gpu.py --quick     # a tiny model, runs on CPU in seconds

The default size is a ~1B-parameter MiMo-shaped random model (random weights written as an HF
checkpoint first), bf16 with Megatron's DDP + distributed optimizer on CUDA (Transformer Engine's layer spec
where it imports); on a machine without CUDA the same code runs on CPU (fp32, torch AdamW: the CPU path), where
MFU is not reported. The draft-loss share is 1 - t(train_head=False) / t(train_head=True) on the same batches.
Each row also gives the peak the GPU memory plan predicts for that step (config/memory_plan.py: weights, grads,
optimizer, a micro-batch's activations, logits and draft loss; not the CUDA context), next to the measured
torch.cuda.max_memory_allocated, so the plan can be checked on a GPU.
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


def predicted_peak_bytes(a, hf_cfg: dict, dtype: str, flash: bool) -> dict[str, int]:
    """The memory plan's peak of one rank's train step at this shape, with and without the draft loss."""
    from skyrl_mtp.config import compose_config
    from skyrl_mtp.config.memory_plan import model_shape, policy_memory

    prompt = a.seq // 4   # random_dapo_batch: a quarter prompt, the rest response (loss positions)
    cfg = compose_config(["recipe=tiny_dapo", f"megatron.micro_batch_size={a.micro_batch}", f"megatron.dtype={dtype}",
                          f"megatron.recompute_activations={str(bool(a.recompute)).lower()}",
                          f"generator.max_model_len={a.seq}", f"data.max_prompt_length={prompt}",
                          f"generator.sampling.max_tokens={a.seq - prompt}", "trainer.mtp.num_speculative_tokens=1",
                          "megatron.mtp_loss_chunk_size=auto"])
    mem = policy_memory(model_shape(cfg, hf_cfg), cfg, flash=flash)
    static = mem.weights + mem.grads + mem.optimizer
    return {"mtp_on": static + mem.step, "mtp_off": static + mem.activations + mem.logits}


def _peak_mem_mb(cuda: bool) -> float:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
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
    with tempfile.TemporaryDirectory(prefix="train_step_gpu_") as tmp:
        ckpt = _mimo_checkpoint(Path(tmp) / "ckpt", a)
        cfg = PolicyWorkerConfig(policy_lr=1e-6, head_lr=1e-4, micro_batch_size=a.micro_batch, dtype=dtype,
                                 recompute_activations=a.recompute, export_hf=False, export_draft_head=False)
        pol = MegatronPolicy(cfg, str(ckpt), 0, 1, "127.0.0.1", free_port())
    n_params = sum(p.numel() for p in pol.policy_params)
    predicted = predicted_peak_bytes(a, _hf_cfg(a), dtype, bool(pol.transformer_engine))
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
        # 6 N per token for forward+backward of the trunk (attention's S^2 term left out, as usual)
        mfu = 6 * n_params * tps / peak if peak else None
        rows.append({"setting": setting, "step_s": step_s, "tokens_per_s": tps, "mfu": mfu,
                     "peak_mem_mb": _peak_mem_mb(dev.is_cuda), "predicted_peak_mb": predicted[setting] / 2**20,
                     "policy_loss": m["policy/loss"]})
    on, off = rows[0]["step_s"], rows[1]["step_s"]
    return {"device": gpu or "cpu", "dtype": dtype, "params": n_params, "tokens_per_step": tokens,
            "optimizer": type(pol.policy_side).__name__, "transformer_engine": bool(pol.transformer_engine),
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
          f"optimizer={res['optimizer']} tokens/step={res['tokens_per_step']}")
    print(f"{'setting':<8} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak MB':>9} {'plan MB':>9}")
    for r in res["rows"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"{r['setting']:<8} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.1f} {mfu:>6} {r['peak_mem_mb']:>9.0f} "
              f"{r['predicted_peak_mb']:>9.0f}")
    print(f"draft loss share of the step: {res['draft_loss_share']:.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
