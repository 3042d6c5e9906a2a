"""Checks of `trainer.drafter`: which drafter the engines speculate with and the policy workers train.

`kind=mtp` drafts with the model's own MTP layers (the model must have them). `kind=eagle3` / `dflash` train an
EAGLE-3 / DFlash drafter beside the policy (policy/drafter_training.py) and serve it with vLLM's method of that name,
on a target whose vLLM model emits the hidden states it reads. For every kind `trainer.mtp` says whether the engines
speculate at all and how the drafter trains (loss, weight, depths: for EAGLE-3, train_depths is its test-time-training
unroll; a DFlash drafter trains every slot of its block).
"""

from __future__ import annotations

from pathlib import Path

from skyrl_mtp.allowed import DRAFTER_KINDS
from skyrl_mtp.config.checker import Checker

LAYER_IDS_RULE = ("null (the kind's default for the target) or distinct layer ids in increasing order, in vLLM's "
                  "numbering: 0 = the embedding, L = the residual stream after decoder layer L-1 (eagle3: three; "
                  "dflash: one or more, each >= 1)")
EXTERNAL_ONLY = ("applies only with trainer.drafter.kind=eagle3 or dflash (an MTP head is the checkpoint's own); "
                 "leave it null")
DFLASH_DEFAULTS = {"num_layers": 1, "block_size": None, "anchors": 32, "mask_token_id": None}


def _layer_ids_ok(v, kind: str) -> bool:
    if v is None:
        return True
    ids = list(v) if not isinstance(v, (str, int)) else None
    if ids is None or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return False
    if ids != sorted(set(ids)) or ids[0] < (1 if kind == "dflash" else 0):
        return False
    return len(ids) == 3 if kind == "eagle3" else True


def _export_dir(v) -> bool:
    return v is not None and (Path(str(v)) / "config.json").is_file() and (Path(str(v)) / "model.safetensors").is_file()


def drafter_checks(c: Checker) -> None:
    """The keys of `trainer.drafter` and what an external drafter cannot be combined with (yet)."""
    cfg = c.cfg
    c.choice("trainer.drafter.kind", DRAFTER_KINDS)
    kind = cfg.trainer.drafter.kind
    external, dflash = kind in ("eagle3", "dflash"), kind == "dflash"
    c.check("trainer.drafter.init", lambda v: v is None, EXTERNAL_ONLY, when=not external)
    c.check("trainer.drafter.layer_ids", lambda v: v is None, EXTERNAL_ONLY, when=not external)
    c.check("trainer.drafter.layer_ids", lambda v: _layer_ids_ok(v, kind), f"must be {LAYER_IDS_RULE}", when=external)
    c.check("trainer.drafter.init", lambda v: v is None or _export_dir(v),
            f"must be null or a directory with an exported {kind} drafter (config.json and model.safetensors, e.g. "
            "a checkpoint's draft_head/)", when=external)
    for key, default in DFLASH_DEFAULTS.items():
        c.check(f"trainer.drafter.{key}", lambda v, d=default: v == d,
                "applies only with trainer.drafter.kind=dflash; leave it unset", when=not dflash)
    c.at_least("trainer.drafter.num_layers", 1)
    c.at_least("trainer.drafter.anchors", 1)
    c.check("trainer.drafter.mask_token_id", lambda v: v is None or (isinstance(v, int) and v >= 0),
            "must be null (the vocabulary's last row) or a token id >= 0")
    k = cfg.trainer.mtp.num_speculative_tokens
    c.check("trainer.drafter.block_size", lambda v: v is None or (isinstance(v, int) and isinstance(k, int) and v > k),
            f"must be null (trainer.mtp.num_speculative_tokens + 1) or an int > trainer.mtp.num_speculative_tokens "
            f"= {k} (the anchor plus a mask slot per draft)", when=dflash)
    c.check("trainer.mtp.train_depths", lambda v: v is None,
            "must be null with trainer.drafter.kind=dflash (a DFlash drafter trains every slot of its block: "
            "trainer.drafter.block_size)", when=dflash)
    c.check("trainer.mtp.loss_position_fraction", lambda v: v == 1.0,
            "must be 1.0 with trainer.drafter.kind=dflash (trainer.drafter.anchors says how many blocks train)",
            when=dflash)
    untested = f"with trainer.drafter.kind={kind} (that combination is not tested yet)"
    c.check("trainer.mtp.enabled", bool, f"must be true with trainer.drafter.kind={kind} (the drafter is trained to "
                                         "draft; for no speculation set trainer.mtp.enabled=false and kind=mtp)",
            when=external)
    c.check("megatron.mtp_num_layers", lambda v: v is None or v == 0,
            f"must be null or 0 with trainer.drafter.kind={kind} (the drafter replaces MTP layers)", when=external)
    c.check("megatron.pp", lambda v: v == 1, f"must be 1 with trainer.drafter.kind={kind} (the drafter reads hidden "
                                             "states of every pipeline stage)", when=external)
    c.check("trainer.mtp.num_speculative_tokens", lambda v: v != "auto", f"must be a fixed k {untested}",
            when=external)
    c.check("trainer.mtp.draft_sample_method", lambda v: v == "greedy", f"must be 'greedy' {untested}", when=external)
    c.check("generator.pipeline_parallel_size", lambda v: v == 1, f"must be 1 {untested}", when=external)
    c.check("generator.model_runner", lambda v: v == "v1", f"must be 'v1' {untested}", when=external)
    c.check("trainer.async_rl.mode", lambda v: v == "sync", f"must be 'sync' {untested}", when=external)


def drafter_model_checks(c: Checker, hf: dict, family_name: str) -> None:
    """The model against `trainer.drafter.kind`: kind=mtp needs MTP layers (when the engines speculate), kind=eagle3 /
    dflash a target vLLM captures hidden states of, layer ids within its layers and (dflash) a mask token in its
    vocabulary."""
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
                                                f"allowed: 'eagle3' or 'dflash' (targets {list(EAGLE3_TARGETS)}), or "
                                                "trainer.mtp.enabled=false (no speculation)")
        return
    archs = list(hf.get("architectures") or [])
    if not set(archs) & set(EAGLE3_TARGETS):
        c.add("trainer.drafter.kind", kind, f"must be 'mtp' with {where}: vLLM captures the hidden states {kind} "
                                            f"reads only of {list(EAGLE3_TARGETS)} among the families here")
        return
    init = cfg.trainer.drafter.init
    if init is not None and not c.reported("trainer.drafter.init"):
        from skyrl_mtp.drafters.kinds import drafter_kind

        try:
            drafter_kind(kind).check_export(init, hf, "trainer.drafter.init")
        except (OSError, ValueError) as err:
            c.add("trainer.drafter.init", init, f"must be an {kind} export for {where}: "
                                                f"{str(err).split(' is invalid: ', 1)[-1]}")
    n = int(hf.get("num_hidden_layers", 0))
    ids = cfg.trainer.drafter.layer_ids
    if ids is None and kind == "eagle3":
        try:
            default_aux_layer_ids(n)
        except ConfigError:
            c.add("trainer.drafter.kind", kind, f"needs a target of at least 2 decoder layers ({where} has {n})")
    elif ids is not None and not c.reported("trainer.drafter.layer_ids") and max(ids) > n:
        c.add("trainer.drafter.layer_ids", list(ids), f"must lie within 0..{n} for {where} ({n} decoder layers; "
                                                      f"{LAYER_IDS_RULE})")
    mask = cfg.trainer.drafter.mask_token_id
    vocab = int(hf.get("vocab_size", 0))
    if kind == "dflash" and mask is not None and not c.reported("trainer.drafter.mask_token_id") and mask >= vocab:
        c.add("trainer.drafter.mask_token_id", mask, f"must be a token id below the vocabulary size {vocab} of "
                                                     f"{where} (its embedding row marks the slots to fill)")
