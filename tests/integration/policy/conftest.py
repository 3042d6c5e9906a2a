"""Checkpoints of the Megatron policy integration tests, all built by the tiny checkpoint factory.

``tiny_ckpt`` (top-level conftest) is the default: untied lm_head, one MTP layer. The variants here
differ in exactly one property each. ``tiny_varied_ckpt`` redraws the factory's zero q/k/v biases and
unit norm scales, so that a mapping that swaps or drops any of them changes the logits (parity tests),
and scales the lm_head by 8: the factory's init gives a nearly flat next-token distribution (entropy
~6.2 nats of log 512 = 6.24) whose arg-max a draft head can hardly learn; ×8 gives a peaked policy.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_tied_ckpt(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tied"), TinyModelSpec(seed=1, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_no_mtp_ckpt(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_no_mtp"), TinyModelSpec(seed=2, mtp_layers=0))


@pytest.fixture(scope="session")
def tiny_llama_ckpt(tmp_path_factory) -> Path:
    """A target without MTP layers, for the EAGLE-3 drafter (2 layers: aux ids (0, 1, 2))."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), TinyModelSpec(seed=0, family="llama"))


@pytest.fixture(scope="session")
def tiny_varied_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_varied")
    for f in tiny_ckpt.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    g = torch.Generator().manual_seed(123)
    sd = load_file(str(tiny_ckpt / "model.safetensors"))
    for k, t in sd.items():
        if k.endswith(".bias"):
            sd[k] = torch.randn(t.shape, generator=g) * 0.1
        elif k.endswith("norm.weight"):
            sd[k] = 1.0 + torch.randn(t.shape, generator=g) * 0.2
    sd["lm_head.weight"] = sd["lm_head.weight"] * 8.0
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return out
