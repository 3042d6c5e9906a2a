"""The EAGLE-3 drafter as the checkpoint vLLM 0.32 serves with ``speculative_config={"method": "eagle3",
"model": <dir>}``, and back.

config.json: ``architectures: ["LlamaForCausalLMEagle3"]`` (vLLM's model registry maps it to
llama_eagle3.Eagle3LlamaForCausalLM), ``model_type: "llama"`` (transformers' LlamaConfig carries the fields;
vLLM wraps it in its EAGLEConfig), one layer of the target's shape, the target's RoPE, ``vocab_size`` = the
target's and no ``draft_vocab_size`` / ``d2t`` (the draft vocabulary IS the target's), and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (read by GPUModelRunner._get_eagle3_aux_layers_from_config).
model.safetensors: the module's state_dict as is (``fc.weight``, ``midlayer.*``, ``norm.weight``; vLLM prefixes
``model.`` and renames ``midlayer.`` to ``layers.0.``), without lm_head or embed_tokens, so vLLM shares the
target's (a draft weight update must therefore never send those names: they would overwrite the target's).
``skyrl_mtp_eagle3`` keeps what vLLM does not read but ``load_eagle3`` needs (the target's layer count).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from skyrl_mtp.drafters.eagle3 import Eagle3Config, Eagle3Drafter

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
OWN_KEY = "skyrl_mtp_eagle3"
# targets whose vLLM model emits the auxiliary hidden states EAGLE-3 reads (SupportsEagle3 in vLLM 0.32) among the
# families this project builds; MiMo and GLM-4.5 do not
EAGLE3_TARGETS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def is_eagle3_tensor(name: str) -> bool:
    """A tensor of the exported drafter (the weight sync's "draft" part when the engines draft with EAGLE-3); a
    target checkpoint's names all start with ``model.`` or are ``lm_head.weight``."""
    return name in ("fc.weight", "norm.weight") or name.startswith("midlayer.")


def check_eagle3_export(path: str | Path, target_hf_config: dict, key: str = "EngineConfig.draft_model_path") -> None:
    """Raise ValueError naming what does not fit when ``path`` is no EAGLE-3 export vLLM can serve beside the
    target of ``target_hf_config``."""
    where = f"{key}={str(path)!r}"
    archs = target_hf_config.get("architectures") or []
    if not set(archs) & set(EAGLE3_TARGETS):
        raise ValueError(f"{where} is invalid: the target's architectures {archs} emit no EAGLE-3 hidden states in "
                         f"vLLM; allowed targets: {list(EAGLE3_TARGETS)}")
    cfg = json.loads((Path(path) / "config.json").read_text())
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"{where} is invalid: its config.json has architectures={cfg.get('architectures')!r}; "
                         f"allowed: [{ARCHITECTURE!r}] (skyrl_mtp.drafters.eagle3_export.export_eagle3)")
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != target_hf_config.get(key):
            raise ValueError(f"{where} is invalid: its {key}={cfg.get(key)} differs from the target's "
                             f"{target_hf_config.get(key)}")
    ids = cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", [])
    n = int(target_hf_config.get("num_hidden_layers", 0))
    if len(ids) != 3 or any(not 0 <= i <= n for i in ids):
        raise ValueError(f"{where} is invalid: eagle_aux_hidden_state_layer_ids={ids}; allowed: three ids in "
                         f"0..{n} (the target's num_hidden_layers)")
    if not (Path(path) / WEIGHTS).is_file():
        raise ValueError(f"{where} is invalid: no {WEIGHTS} there")


def layer_shape_fields(cfg) -> dict:
    """The config.json fields of a drafter's decoder layers (the target's width, heads, norm, RoPE base, vocabulary
    and context; SwiGLU, no attention bias), shared by the EAGLE-3 and DFlash exports."""
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": False}


def eagle3_hf_config(cfg: Eagle3Config, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json vLLM reads for the drafter ``cfg``."""
    from skyrl_mtp.models.families.dense_common import LLAMA3_ROPE_FIXED

    rope = {} if cfg.rope_scaling_factor is None else {
        "rope_scaling": {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **LLAMA3_ROPE_FIXED}}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **layer_shape_fields(cfg),
        "num_hidden_layers": 1,
        **rope,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        OWN_KEY: {"target_num_layers": cfg.target_num_layers},
    }


def write_export(drafter: torch.nn.Module, hf_config_of, out_dir: str | Path) -> Path:
    """A drafter as vLLM loads it: ``hf_config_of(dtype)`` as config.json, the module's state_dict as
    model.safetensors, in ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    (out / "config.json").write_text(json.dumps(hf_config_of(next(iter(state.values())).dtype), indent=2))
    save_file(state, str(out / WEIGHTS))
    return out


def export_eagle3(drafter: Eagle3Drafter, cfg: Eagle3Config, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors for vLLM into ``out_dir``; returns it."""
    return write_export(drafter, lambda dtype: eagle3_hf_config(cfg, dtype), out_dir)


def config_from_export(hf_config: dict) -> Eagle3Config:
    """The Eagle3Config an exported config.json describes."""
    scaling = hf_config.get("rope_scaling")
    return Eagle3Config(
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_key_value_heads=hf_config["num_key_value_heads"],
        head_dim=hf_config["head_dim"],
        rms_norm_eps=float(hf_config["rms_norm_eps"]),
        rope_theta=float(hf_config["rope_theta"]),
        rope_scaling_factor=None if not scaling else float(scaling["factor"]),
        vocab_size=hf_config["vocab_size"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        target_num_layers=hf_config[OWN_KEY]["target_num_layers"],
        aux_layer_ids=tuple(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
    )


def load_eagle3(path: str | Path) -> tuple[Eagle3Drafter, Eagle3Config]:
    """The drafter and config ``export_eagle3`` wrote to ``path`` (weights in their saved dtype)."""
    path = Path(path)
    cfg = config_from_export(json.loads((path / "config.json").read_text()))
    state = load_file(str(path / WEIGHTS))
    drafter = Eagle3Drafter(cfg).to(next(iter(state.values())).dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter, cfg


def initial_eagle3(target_hf_config: dict, aux_layer_ids: tuple[int, ...] | None, seed: int,
                   init_path: str | Path | None = None) -> tuple[Eagle3Drafter, Eagle3Config]:
    """The drafter a run starts from, in fp32: the export at ``init_path`` (which must be a drafter of this target,
    reading ``aux_layer_ids`` when given), or a fresh one initialised from ``seed`` (the same weights on every
    process that asks: the driver's first export and the policy workers' copy agree)."""
    if init_path is None:
        cfg = Eagle3Config.from_target(target_hf_config, aux_layer_ids)
        return Eagle3Drafter(cfg, torch.Generator().manual_seed(seed)), cfg
    drafter, loaded = load_eagle3(init_path)
    want = Eagle3Config.from_target(target_hf_config, aux_layer_ids or loaded.aux_layer_ids)
    if loaded != want:
        diff = {k: (getattr(loaded, k), getattr(want, k)) for k in want.__dataclass_fields__
                if getattr(loaded, k) != getattr(want, k)}
        raise ValueError(f"the EAGLE-3 drafter at {str(init_path)!r} does not fit the target: (its value, the "
                         f"target's) = {diff}")
    return drafter.float(), want
