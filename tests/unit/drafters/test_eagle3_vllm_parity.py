"""skyrl_mtp's Eagle3Drafter computes what vLLM 0.32's own EAGLE-3 Llama drafter computes on the same checkpoint:
the export loads into vLLM's Eagle3LlamaForCausalLM by its names, and the first pass (fc, both outputs) and the
second draft (KV cache of pass 1 up to t plus its own key) agree to fp32 rounding (vllm_eagle3_reference.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
REFERENCE = Path(__file__).with_name("vllm_eagle3_reference.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_drafter_equals_vllms_eagle3_llama_module(tmp_path):
    proc = subprocess.run([sys.executable, str(REFERENCE), str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["architecture"] == "Eagle3LlamaForCausalLM"
    # no lm_head / embed_tokens in the export: vLLM uses the target's (SpecDecodeBaseProposer._maybe_share_*)
    assert res["shares_target_lm_head"] and res["shares_target_embed_tokens"]
    assert res["aux_layer_ids"] == [1, 2, 3]
    assert res["scale"] > 0.1   # the outputs compared are not ~0
    assert res["fc"] <= 1e-6
    for key in ("pass1_hidden", "pass1_next_hidden", "draft2"):
        assert res[key] <= 2e-6, (key, res)
    assert res["rope"] == {"llama3": pytest.approx(0.0, abs=1e-6), "default": pytest.approx(0.0, abs=1e-6)}
