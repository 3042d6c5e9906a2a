"""Checks of the model a run trains and serves, made at validation from its files alone (nothing is built).

A user checkpoint (`model.path`) must be one the trainer and the engines can use: a config.json that a model
family reads (the architecture found and the supported ones are named otherwise), MTP layers when the run drafts
or trains a head, a number of drafts vLLM accepts for those layers, safetensors weights, and tokenizer files
with a chat template (prompts go through it). For the checkpoint, or the tiny model when `model.path` is null,
the family must accept the policy's parallel layout (megatron.tp, pp, ep). Each check reports through the
`Checker`, so its rule also shows in docs/config.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skyrl_mtp.config.checker import Checker
from skyrl_mtp.config.drafter_knob import drafter_model_checks

# The most tokens the engines may draft per step (trainer.mtp.num_speculative_tokens, or max_speculative_tokens
# under auto). vLLM sets no bound; a draft at depth d is verified only when depths 1..d-1 were accepted, so its
# chance is a product of d acceptance rates, and every depth costs one more forward of the MTP layer per step.
MAX_SPECULATIVE_TOKENS = 16
K_RANGE = (f"an int in [1, {MAX_SPECULATIVE_TOKENS}] (deeper drafts are almost never accepted and each costs a "
           "forward of the MTP layer per engine step)")

# Files a transformers tokenizer loads from (any one of them), and where a chat template may be.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_RULE = ("a checkpoint with tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ") and a chat "
                  "template (tokenizer_config.json's 'chat_template', or a chat_template.jinja file): prompts are "
                  "encoded with it")
FAMILY_RULE = "a checkpoint whose config.json architectures a model family reads (the supported ones are listed)"
MTP_RULE = ("a checkpoint with MTP layers when trainer.mtp.enabled=true and trainer.drafter.kind=mtp (the engines "
            "draft and the policy trains with them); trainer.drafter.kind=eagle3 / dflash or trainer.mtp.enabled=false for a "
            "model without")
DRAFTER_KIND_RULE = ("mtp needs a model with MTP layers (families without them: llama, qwen3; or "
                     "model.tiny.mtp_layers=0), eagle3 and dflash a llama or qwen3 target")
WEIGHTS_RULE = "a checkpoint with *.safetensors weights"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _checkpoint_dir(c: Checker) -> Path | None:
    """model.path when it is a directory holding config.json (the cheaper checks report it otherwise)."""
    path = c.get("model.path")
    if path is None or c.reported("model.path"):
        return None
    d = Path(str(path))
    return d if (d / "config.json").is_file() else None


def read_config_json(c: Checker, d: Path) -> dict | None:
    try:
        hf = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as err:
        c.add("model.path", str(d), f"its config.json must be readable JSON ({err})")
        return None
    if not isinstance(hf, dict):
        c.add("model.path", str(d), "its config.json must be a JSON object")
        return None
    return hf


def has_chat_template(d: Path) -> bool:
    if any((d / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(tok_cfg, dict) and bool(tok_cfg.get("chat_template"))


def tokenizer_checks(c: Checker, d: Path) -> None:
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        c.add("model.path", str(d), f"has no tokenizer files (looked for {list(TOKENIZER_FILES)}); needs "
                                    + TOKENIZER_RULE)
    elif not has_chat_template(d):
        c.add("model.path", str(d), "its tokenizer has no chat template (neither tokenizer_config.json's "
                                    "'chat_template' nor chat_template.jinja); prompts are encoded with it, so add "
                                    "one to the checkpoint")


def speculative_tokens_checks(c: Checker, mtp_layers: int | None) -> None:
    """k (or auto's maximum) in range, and what vLLM accepts for a checkpoint of `mtp_layers` MTP layers (k beyond
    them reuses the layers in turn: vLLM needs k divisible by their number)."""
    knob = c.cfg.trainer.mtp
    if not knob.enabled:
        return
    key = "trainer.mtp.max_speculative_tokens" if knob.num_speculative_tokens == "auto" \
        else "trainer.mtp.num_speculative_tokens"
    c.rule("trainer.mtp.num_speculative_tokens", f"at most {MAX_SPECULATIVE_TOKENS}")
    c.rule("trainer.mtp.max_speculative_tokens", f"at most {MAX_SPECULATIVE_TOKENS}")
    k = c.get(key)
    if not _int(k) or k < 1 or c.reported(key):
        return
    if k > MAX_SPECULATIVE_TOKENS:
        c.add(key, k, K_RANGE)
    elif mtp_layers and mtp_layers > 1 and k > mtp_layers and k % mtp_layers:
        c.add(key, k, f"must be <= the checkpoint's {mtp_layers} MTP layers or a multiple of them (vLLM reuses the "
                      "layers in turn beyond them)")


def model_dir_checks(c: Checker) -> Any | None:
    """The checks of this module's docstring (model.path's existence and config.json are checked before); returns
    the model's family, None when it is unknown."""
    from skyrl_mtp.models.families import FAMILIES, checkpoint_mtp_layers

    c.rule("model.path", FAMILY_RULE)
    c.rule("model.path", MTP_RULE)
    c.rule("model.path", WEIGHTS_RULE)
    c.rule("model.path", TOKENIZER_RULE)
    d = _checkpoint_dir(c)
    if d is None:
        speculative_tokens_checks(c, None)
        if c.get("model.path") is None and not any(p.startswith("model.tiny.") for p in c.problems):
            return tiny_layout_checks(c)
        return None
    hf = read_config_json(c, d)
    if hf is None:
        return None
    family = next((f for f in FAMILIES if f.matches(hf)), None)
    if family is None:
        supported = sorted({a for f in FAMILIES for a in f.architectures})
        c.add("model.path", str(d), f"its config.json has architectures={hf.get('architectures')!r} "
                                    f"(model_type={hf.get('model_type')!r}), which no model family reads; supported "
                                    f"architectures: {supported}")
        return None
    drafter_model_checks(c, hf, family.name)
    speculative_tokens_checks(c, checkpoint_mtp_layers(hf)[1] if c.cfg.trainer.drafter.kind == "mtp" else None)
    if not any(d.glob("*.safetensors")):
        c.add("model.path", str(d), "has no *.safetensors weights (the engines and the policy load them)")
    tokenizer_checks(c, d)
    try:
        args = family.args_from_config(hf)
    except (KeyError, TypeError, ValueError) as err:
        c.add("model.path", str(d), f"its config.json lacks what a {family.name} model needs ({err!r})")
        return family
    layout_checks(c, family, args)
    return family


def tiny_layout_checks(c: Checker) -> Any:
    """The tiny model's family against the layout (its config.json as it would be built; nothing is built)."""
    from dataclasses import fields

    from skyrl_mtp.models.families import family_for_config
    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config

    names = {f.name for f in fields(TinyModelSpec)}
    spec = TinyModelSpec(**{k: v for k, v in dict(c.cfg.model.tiny).items() if k in names})
    hf = hf_config(spec, None)
    family = family_for_config(hf)
    c.rule("trainer.drafter.kind", DRAFTER_KIND_RULE)
    drafter_model_checks(c, hf, family.name)
    layout_checks(c, family, family.args_from_config(hf))
    return family


def layout_checks(c: Checker, family: Any, args: Any) -> None:
    """megatron.tp, pp and ep, each against the family's rules with the others at 1 (the key at fault is named)."""
    from skyrl_mtp.models.families import ModelBuildError

    keys = ("megatron.tp", "megatron.pp", "megatron.ep")
    for key in keys:
        c.rule(key, "a layout the model's family accepts (MoE families: tp=1, pp=1, ep dividing the experts; "
                    "dense families: ep=1)")
    for key in keys:
        value = c.get(key)
        if not _int(value) or value < 1 or c.reported(key):
            continue
        layout = {"tp": 1, "pp": 1, "ep": 1, key.split(".")[1]: value}
        try:
            family.check_parallel(args, **layout)
        except ModelBuildError as err:
            msg = str(err)
            if msg.startswith(f"{key}={value}"):
                msg = msg[len(f"{key}={value}"):].lstrip(" :")
            c.add(key, value, msg if family.name in msg else f"not with a {family.name} model: {msg}")
