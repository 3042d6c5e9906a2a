"""A stand-in checkpoint and data row for tests of validation: the files it reads, nothing it would load."""

from __future__ import annotations

import json
from pathlib import Path

# a row in the DAPO-Math layout (prompt + reward_model.ground_truth): docs/data.md
DAPO_ROW = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}


def stand_in_checkpoint(directory: Path, *, chat_template: bool = True, tokenizer: bool = True,
                        **config: object) -> Path:
    """The files validation reads of a checkpoint (no weights inside): the tiny MiMo's config.json with `config`
    on top, tokenizer files with or without a chat template, an empty safetensors file."""
    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**hf_config(TinyModelSpec(), None), **config}))
    (directory / "model.safetensors").touch()
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    if chat_template:
        (directory / "chat_template.jinja").write_text("{{ messages }}")
    return directory
