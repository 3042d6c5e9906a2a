"""Checks of `trainer.drafter`: which drafter the engines speculate with and the policy workers train.

`kind=mtp` drafts with the model's own MTP layers (the model must have them). `kind=eagle3` trains an EAGLE-3
drafter beside the policy (policy/drafter_training.py) and serves it with vLLM's `method: eagle3`, on a target whose
vLLM model emits the hidden states it reads. For either kind `trainer.mtp` says whether the engines speculate at all
and how the drafter trains (loss, weight, depths: for EAGLE-3, train_depths is its test-time-training unroll).
"""

from __future__ import annotations

from pathlib import Path

from skyrl_mtp.allowed import DRAFTER_KINDS
from skyrl_mtp.config.checker import Checker

LAYER_IDS_RULE = ("null (vLLM's default for the target) or three distinct layer ids in increasing order, in vLLM's "
                  "numbering: 0 = the embedding, L = the residual stream after decoder layer L-1")
EAGLE3_ONLY = "applies only with trainer.drafter.kind=eagle3 (an MTP head is the checkpoint's own); leave it null"


def _layer_ids_ok(v) -> bool:
    if v is None:
        return True
    ids = list(v) if not isinstance(v, (str, int)) else None
    return (ids is not None and len(ids) == 3 and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            and ids == sorted(set(ids)) and ids[0] >= 0)


def _export_dir(v) -> bool:
    return v is not None and (Path(str(v)) / "config.json").is_file() and (Path(str(v)) / "model.safetensors").is_file()


def drafter_checks(c: Checker) -> None:
    """The keys of `trainer.drafter` and what an EAGLE-3 drafter cannot be combined with (yet)."""
    cfg = c.cfg
    c.choice("trainer.drafter.kind", DRAFTER_KINDS)
    eagle = cfg.trainer.drafter.kind == "eagle3"
    c.check("trainer.drafter.init", lambda v: v is None, EAGLE3_ONLY, when=not eagle)
    c.check("trainer.drafter.layer_ids", lambda v: v is None, EAGLE3_ONLY, when=not eagle)
    c.check("trainer.drafter.layer_ids", _layer_ids_ok, f"must be {LAYER_IDS_RULE}", when=eagle)
    c.check("trainer.drafter.init", lambda v: v is None or _export_dir(v),
            "must be null or a directory with an exported EAGLE-3 drafter (config.json and model.safetensors, e.g. "
            "a checkpoint's draft_head/)", when=eagle)
    untested = "with trainer.drafter.kind=eagle3 (that combination is not tested yet)"
    c.check("trainer.mtp.enabled", bool, "must be true with trainer.drafter.kind=eagle3 (the drafter is trained to "
                                         "draft; for no speculation set trainer.mtp.enabled=false and kind=mtp)",
            when=eagle)
    c.check("megatron.mtp_num_layers", lambda v: v is None or v == 0,
            "must be null or 0 with trainer.drafter.kind=eagle3 (the drafter replaces MTP layers)", when=eagle)
    c.check("megatron.pp", lambda v: v == 1, "must be 1 with trainer.drafter.kind=eagle3 (the drafter reads hidden "
                                             "states of every pipeline stage)", when=eagle)
    c.check("trainer.mtp.num_speculative_tokens", lambda v: v != "auto", f"must be a fixed k {untested}",
            when=eagle)
    c.check("trainer.mtp.draft_sample_method", lambda v: v == "greedy", f"must be 'greedy' {untested}", when=eagle)
    c.check("generator.pipeline_parallel_size", lambda v: v == 1, f"must be 1 {untested}", when=eagle)
    c.check("generator.model_runner", lambda v: v == "v1", f"must be 'v1' {untested}", when=eagle)
    c.check("trainer.async_rl.mode", lambda v: v == "sync", f"must be 'sync' {untested}", when=eagle)


def drafter_model_checks(c: Checker, hf: dict, family_name: str) -> None:
    """The model against `trainer.drafter.kind`: kind=mtp needs MTP layers (when the engines speculate), kind=eagle3
    a target vLLM captures hidden states of and layer ids within its layers."""
    from skyrl_mtp.drafters.eagle3 import default_aux_layer_ids
    from skyrl_mtp.drafters.eagle3_export import EAGLE3_TARGETS
    from skyrl_mtp.errors import ConfigError
    from skyrl_mtp.models.families import checkpoint_mtp_layers

    cfg = c.cfg
    if not cfg.trainer.mtp.enabled or c.reported("trainer.drafter.kind"):
        return
    kind = cfg.trainer.drafter.kind
    where = (f"the tiny {family_name} model (model.tiny)" if cfg.model.path is None
             else f"the {family_name} model at model.path")
    if kind == "mtp":
        key, n_mtp = checkpoint_mtp_layers(hf)
        if n_mtp < 1:
            c.add("trainer.drafter.kind", kind, f"cannot draft with {where}: it has no MTP layers ({key}={n_mtp}); "
                                                f"allowed: 'eagle3' (targets {list(EAGLE3_TARGETS)}), or "
                                                "trainer.mtp.enabled=false (no speculation)")
        return
    archs = list(hf.get("architectures") or [])
    if not set(archs) & set(EAGLE3_TARGETS):
        c.add("trainer.drafter.kind", kind, f"must be 'mtp' with {where}: vLLM captures EAGLE-3's hidden states only "
                                            f"of {list(EAGLE3_TARGETS)} among the families here")
        return
    init = cfg.trainer.drafter.init
    if init is not None and not c.reported("trainer.drafter.init"):
        from skyrl_mtp.drafters.eagle3_export import check_eagle3_export

        try:
            check_eagle3_export(init, hf)
        except (OSError, ValueError) as err:
            c.add("trainer.drafter.init", init, f"must be an EAGLE-3 export for {where}: "
                                                f"{str(err).split(' is invalid: ', 1)[-1]}")
    n = int(hf.get("num_hidden_layers", 0))
    ids = cfg.trainer.drafter.layer_ids
    if ids is None:
        try:
            default_aux_layer_ids(n)
        except ConfigError:
            c.add("trainer.drafter.kind", kind, f"needs a target of at least 2 decoder layers ({where} has {n})")
    elif not c.reported("trainer.drafter.layer_ids") and max(ids) > n:
        c.add("trainer.drafter.layer_ids", list(ids), f"must lie within 0..{n} for {where} ({n} decoder layers; "
                                                      f"{LAYER_IDS_RULE})")
