"""The DFlash drafter as the checkpoint vLLM 0.32 serves with ``speculative_config={"method": "dflash",
"model": <dir>}``, and back.

config.json: ``architectures: ["DFlashDraftModel"]`` (vLLM's registry maps it to qwen3_dflash.
DFlashQwen3ForCausalLM), ``model_type: "qwen3"`` (transformers' Qwen3Config carries the fields; vLLM wraps it in
its EAGLEConfig), ``num_hidden_layers`` = the drafter's layers, the target's width / heads / vocabulary, plain RoPE,
no ``layer_types`` / ``causal`` / ``use_swa`` (so every layer attends non-causally, the DFlash default), and
``dflash_config.mask_token_id`` + ``dflash_config.target_layer_ids`` (0-based; vLLM adds 1 and captures those aux
states from the target; their count sizes ``fc``). ``block_size`` is informational (vLLM drafts
num_speculative_tokens per step, which should be block_size - 1).
model.safetensors: the module's state_dict as is (``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*``,
``norm.weight``; vLLM prefixes ``model.`` and stacks q/k/v, gate/up), without lm_head or embed_tokens, so vLLM
shares the target's (a draft weight update must therefore never send those names: they would overwrite the
target's) and the mask slots embed the target's row ``mask_token_id`` (no mask_embedding.pt is written).
``skyrl_mtp_dflash`` keeps what vLLM does not read but ``load_dflash`` needs (the target's layer count).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from skyrl_mtp.drafters.dflash import DEFAULT_BLOCK_SIZE, DFlashConfig, DFlashDrafter
from skyrl_mtp.drafters.eagle3_export import layer_shape_fields, write_export

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
OWN_KEY = "skyrl_mtp_dflash"
# targets whose vLLM model emits the auxiliary hidden states DFlash reads (SupportsEagle3 in vLLM 0.32) among the
# families this project builds; MiMo and GLM-4.5 do not
DFLASH_TARGETS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_LAYER_TENSOR = re.compile(r"layers\.\d+\.")


def is_dflash_tensor(name: str) -> bool:
    """A tensor of the exported drafter (the weight sync's "draft" part when the engines draft with DFlash); a
    target checkpoint's names all start with ``model.`` or are ``lm_head.weight``."""
    return name in ("fc.weight", "hidden_norm.weight", "norm.weight") or _LAYER_TENSOR.match(name) is not None


def check_dflash_export(path: str | Path, target_hf_config: dict, key: str = "EngineConfig.draft_model_path") -> None:
    """Raise ValueError naming what does not fit when ``path`` is no DFlash export vLLM can serve beside the
    target of ``target_hf_config``."""
    where = f"{key}={str(path)!r}"
    archs = target_hf_config.get("architectures") or []
    if not set(archs) & set(DFLASH_TARGETS):
        raise ValueError(f"{where} is invalid: the target's architectures {archs} emit no auxiliary hidden states in "
                         f"vLLM (DFlash reads them); allowed targets: {list(DFLASH_TARGETS)}")
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{where} is invalid: no config.json there")
    cfg = json.loads(config_file.read_text())
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"{where} is invalid: its config.json has architectures={cfg.get('architectures')!r}; "
                         f"allowed: [{ARCHITECTURE!r}] (skyrl_mtp.drafters.dflash_export.export_dflash)")
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != target_hf_config.get(key):
            raise ValueError(f"{where} is invalid: its {key}={cfg.get(key)} differs from the target's "
                             f"{target_hf_config.get(key)} (the drafter shares the target's embedding and lm_head)")
    dflash = cfg.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids")
    n = int(target_hf_config.get("num_hidden_layers", 0))
    if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
            or any(not isinstance(i, int) or not 0 <= i < n for i in ids)):
        raise ValueError(f"{where} is invalid: dflash_config.target_layer_ids={ids!r}; allowed: distinct 0-based "
                         f"ids in 0..{n - 1} (the target's num_hidden_layers={n})")
    mask = dflash.get("mask_token_id")
    vocab = int(target_hf_config.get("vocab_size", 0))
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise ValueError(f"{where} is invalid: dflash_config.mask_token_id={mask!r}; allowed: a token id in "
                         f"[0, {vocab}) (the target's vocab_size)")
    for key in ("layer_types", "is_causal", "sliding_window"):
        if cfg.get(key) not in (None, [], False) and not (key == "layer_types" and set(cfg[key]) == {"full_attention"}):
            raise ValueError(f"{where} is invalid: its config.json sets {key}={cfg[key]!r}; this project's drafter "
                             "attends non-causally over full context (leave it unset)")
    if any(dflash.get(key) for key in ("causal", "use_swa", "attention_sink_bias")):
        raise ValueError(f"{where} is invalid: dflash_config={dflash!r} sets causal / use_swa / attention_sink_bias, "
                         "which skyrl_mtp's DFlashDrafter does not compute")
    if not (Path(path) / WEIGHTS).is_file():
        raise ValueError(f"{where} is invalid: no {WEIGHTS} there")


def dflash_hf_config(cfg: DFlashConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json vLLM reads for the drafter ``cfg``."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        **layer_shape_fields(cfg),
        "num_hidden_layers": cfg.num_layers,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        OWN_KEY: {"target_num_layers": cfg.target_num_layers},
    }


def export_dflash(drafter: DFlashDrafter, cfg: DFlashConfig, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors for vLLM into ``out_dir``; returns it."""
    return write_export(drafter, lambda dtype: dflash_hf_config(cfg, dtype), out_dir)


def config_from_export(hf_config: dict, target_num_layers: int | None = None) -> DFlashConfig:
    """The DFlashConfig an exported config.json describes; a published drafter's config.json names no target layer
    count of ours (``OWN_KEY``): ``num_target_layers`` where it has one, else ``target_num_layers`` (the target's)."""
    dflash = hf_config["dflash_config"]
    return DFlashConfig(
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_key_value_heads=hf_config["num_key_value_heads"],
        head_dim=hf_config["head_dim"],
        rms_norm_eps=float(hf_config["rms_norm_eps"]),
        rope_theta=float(hf_config["rope_theta"]),
        vocab_size=hf_config["vocab_size"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        target_num_layers=int((hf_config.get(OWN_KEY) or {}).get("target_num_layers")
                              or hf_config.get("num_target_layers") or target_num_layers),
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        num_layers=hf_config["num_hidden_layers"],
        block_size=int(hf_config.get("block_size") or DEFAULT_BLOCK_SIZE),
        mask_token_id=dflash["mask_token_id"],
    )


def load_dflash(path: str | Path, target_num_layers: int | None = None) -> tuple[DFlashDrafter, DFlashConfig]:
    """The drafter and config ``export_dflash`` (or a published drafter's checkpoint in vLLM's layout, given its
    target's layer count) wrote to ``path`` (weights in their saved dtype)."""
    path = Path(path)
    cfg = config_from_export(json.loads((path / "config.json").read_text()), target_num_layers)
    state = load_file(str(path / WEIGHTS))
    drafter = DFlashDrafter(cfg).to(next(iter(state.values())).dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter, cfg
