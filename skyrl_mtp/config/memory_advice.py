"""What a memory plan that does not fit says: the phase over budget, its parts, and settings that would fit.

Kept apart from memory_plan.py (the arithmetic): each suggestion is the plan of a changed config, so a message
names keys the user can set and what each would need, never a guess. Every problem names a key, its value and
what is allowed (errors.py), as the config's own validation does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from skyrl_mtp.errors import problem


def fmt_bytes(b: float) -> str:
    return f"{b / 1e9:.1f} GB" if b >= 1e9 or b == 0 else f"{b / 1e6:.1f} MB"


_gb = fmt_bytes


def _with(cfg: Any, changes: dict[str, Any]) -> Any:
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in changes.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def _family_takes_tp(hf_cfg: dict, tp: int, ep: int, pp: int) -> bool:
    """Whether the checkpoint's model family trains at this tensor-parallel size (MoE families refuse tp > 1)."""
    from skyrl_mtp.models.families import ModelBuildError, family_for_config

    try:
        family = family_for_config(hf_cfg)
        family.check_parallel(family.args_from_config(hf_cfg), tp=tp, ep=ep, pp=pp)
    except ModelBuildError:
        return False
    return True


def training_fixes(cfg: Any, hf_cfg: dict, phase: str, replan: Callable[..., Any]
                   ) -> list[tuple[dict[str, Any], int]]:
    """(changes, that phase's bytes) of the policy settings that bring the training phase within budget; `replan`
    is memory_plan.memory_plan (passed in: the arithmetic imports this module, not the other way round)."""
    memory_plan = replan

    m = cfg.megatron
    candidates: list[dict[str, Any]] = []
    if str(m.layer_impl) == "local":   # the same model without the materialised attention scores
        candidates.append({"megatron.layer_impl": "sdpa"})
    if not m.recompute_activations:
        candidates.append({"megatron.recompute_activations": True})
    for rows in range(int(m.micro_batch_size) - 1, 0, -1):
        candidates.append({"megatron.micro_batch_size": rows})
        if not m.recompute_activations:
            candidates.append({"megatron.micro_batch_size": rows, "megatron.recompute_activations": True})
    if int(m.dp) % 2 == 0 and _family_takes_tp(hf_cfg, 2 * int(m.tp), int(m.ep), int(m.pp)):
        candidates.append({"megatron.tp": 2 * int(m.tp), "megatron.dp": int(m.dp) // 2})
    if str(m.layer_impl) == "local":   # each of the above with SDPA too
        candidates += [{"megatron.layer_impl": "sdpa", **c} for c in candidates[1:]]
    candidates += _drafter_fixes(cfg)
    out = []
    for changes in candidates:
        try:
            plan = memory_plan(_with(cfg, changes), hf_cfg, suggest=False)
        except (ValueError, ZeroDivisionError):   # e.g. heads not divisible by the larger TP
            continue
        if plan.phases[phase] <= plan.usable:
            out.append((changes, plan.phases[phase]))
    # one line per key set: the largest micro-batch that fits (first found), the rest as they come
    seen, kept = set(), []
    for changes, need in out:
        key = tuple(sorted(changes))
        if key not in seen:
            seen.add(key)
            kept.append((changes, need))
    return kept[:4]


def _drafter_fixes(cfg: Any) -> list[dict[str, Any]]:
    """What shrinks an external drafter's part (config/memory_drafter.py), which no policy setting does: an
    EAGLE-3 drafter's loss grows with its unrolled passes: fewer trained depths (each depth trains its own pass; the
    engines may still draft k); a DFlash drafter's with its trained blocks (fewer anchors per row), its state with
    its layers (fewer, unless it starts from an export of its own size, trainer.drafter.init)."""
    from skyrl_mtp.config.memory_drafter import DFLASH, external_drafter_kind
    from skyrl_mtp.config.mtp_knob import train_depths

    kind = external_drafter_kind(cfg)
    if kind is None:
        return []
    if kind == DFLASH:
        d = cfg.trainer.drafter
        anchors = [int(d.anchors) // 2**i for i in range(1, int(d.anchors).bit_length())]
        out: list[dict[str, Any]] = [{"trainer.drafter.anchors": a} for a in anchors]
        if d.init is None:
            out += [{"trainer.drafter.num_layers": n} for n in range(int(d.num_layers) - 1, 0, -1)]
        return out
    return [{"trainer.mtp.train_depths": d} for d in range(train_depths(cfg) - 1, 0, -1)]


def _fmt(changes: dict[str, Any]) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def training_sum(plan: Any) -> str:
    """The training phase's bytes as the sum they are: the resident policy state, the parts of the step's phase that
    peaks (named), and a sleeping engine's allowance where one shares the GPU."""
    p, e = plan.policy, plan.engine
    step, _ = p.step_peak
    parts = {"weights": p.weights, "grads": p.grads, "optimizer": p.optimizer, "drafter (fp32, AdamW)": p.drafter,
             "process overhead": p.overhead, **p.step_phases[step]}
    if plan.colocated:
        parts["sleeping engine"] = e.asleep
    total = sum(parts.values())
    return (f"peak in the {step} phase: " + " + ".join(f"{k} {_gb(v)}" for k, v in parts.items() if v)
            + f" = {_gb(total)}")


def plan_problems(plan: Any, cfg: Any, hf_cfg: dict, suggest: bool, user_util: bool,
                  replan: Callable[..., Any]) -> list[str]:
    e = plan.engine
    gb = cfg.trainer.placement.gpu_memory_gb
    budget = f"of the {_gb(plan.usable)} usable of trainer.placement.gpu_memory_gb={gb} (5% kept for fragmentation)"
    out: list[str] = []
    train_phase = "training (engines asleep)" if plan.colocated else "policy GPUs (training)"
    if plan.phases[train_phase] > plan.usable:
        parts = training_sum(plan)
        fixes = training_fixes(cfg, hf_cfg, train_phase, replan) if suggest else []
        key, value = ("trainer.placement.gpu_memory_gb", gb)
        if fixes:
            key = next(iter(fixes[0][0]))
            value = OmegaConf.select(cfg, key)
        fits = "; ".join(f"{_fmt(c)} needs {_gb(n)}" for c, n in fixes) or "none of micro-batch / recompute / TP found"
        out.append(problem(key, value, f"a training step needs {_gb(plan.phases[train_phase])} per GPU ({parts}) "
                                       f"{budget}; settings that fit: {fits}"))
    roll_phase = "rollout (engines awake)" if plan.colocated else "engine GPUs"
    if plan.phases[roll_phase] > plan.usable:
        room = plan.usable - (plan.phases[roll_phase] - e.kv_cache)
        allowed = (f"at most {room // 2**20} MiB" if room > 0 else
                   "none fits: lower generator.max_num_seqs or raise generator.tensor_parallel_size")
        what = " with grads and optimizer state in host memory" if plan.colocated else ""
        out.append(problem("generator.kv_cache_memory_mb", int(cfg.generator.kv_cache_memory_mb),
                           f"the engines need {_gb(plan.phases[roll_phase])} per GPU while awake{what} (engine "
                           f"{_gb(e.awake)} with a KV cache of {_gb(e.kv_cache)}) {budget}; allowed: {allowed}"))
    if plan.colocated and plan.phases["weight sync"] > plan.usable and plan.phases[roll_phase] <= plan.usable:
        out.append(problem("generator.kv_cache_memory_mb", int(cfg.generator.kv_cache_memory_mb),
                           f"the weight sync needs {_gb(plan.phases['weight sync'])} per GPU (IPC buffer "
                           f"{_gb(plan.ipc_buffer)}) {budget}; allowed: a smaller KV cache or a larger megatron.tp"))
    need_tokens = int(cfg.generator.max_model_len)
    if e.kv_tokens < need_tokens:
        per_token = e.kv_cache // max(e.kv_tokens, 1) if e.kv_tokens else 0
        more = f"at least {-(-need_tokens * per_token // 2**20)} MiB" if per_token else "a larger KV cache"
        out.append(problem("generator.kv_cache_memory_mb", int(cfg.generator.kv_cache_memory_mb),
                           f"the KV cache holds {e.kv_tokens} tokens per engine, fewer than one sequence of "
                           f"generator.max_model_len={need_tokens} (vLLM refuses to start); allowed: {more}"))
    gpu = plan.gpu_bytes
    if plan.gpu_memory_utilization * gpu > plan.free_at_engine_start:
        most = int(plan.free_at_engine_start / gpu * 100) / 100
        if user_util:
            out.append(problem("generator.engine_kwargs.gpu_memory_utilization", plan.gpu_memory_utilization,
                               f"vLLM starts only if that share of the GPU is free (v1/worker/utils.py request_memory), "
                               f"and {_gb(plan.free_at_engine_start)} is free when the engines start beside the policy; "
                               f"allowed: at most {most}"))
        elif not any(x.startswith("generator.kv_cache_memory_mb=") for x in out):
            out.append(problem("generator.kv_cache_memory_mb", int(cfg.generator.kv_cache_memory_mb),
                               f"the engine needs {_gb(e.awake)} per GPU but only {_gb(plan.free_at_engine_start)} is "
                               "free when it starts beside the policy (vLLM checks gpu_memory_utilization against free "
                               "memory at start); allowed: a smaller KV cache"))
    return out
