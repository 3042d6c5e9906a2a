"""A DFlash draft weight update through vLLM's layer-wise reload (as skyrl_mtp's CPU transport runs it: one
load_weights call per tensor between initialize_ and finalize_layerwise_reload) dies in vLLM's buffer rebuild
without the patch, and with it the next proposals equal skyrl_mtp's drafter holding the NEW weights, draft tokens
included (tests/unit/drafters/vllm_dflash_reference.py, mode "reload")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
REPO_ROOT = Path(__file__).resolve().parents[3]
REFERENCE = REPO_ROOT / "tests" / "unit" / "drafters" / "vllm_dflash_reference.py"


def test_layerwise_reload_fails_without_the_patch_and_serves_the_new_weights_with_it(tmp_path):
    proc = subprocess.run([sys.executable, str(REFERENCE), str(tmp_path), "reload"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    unpatched = res["unpatched"]
    assert "meta" in unpatched.get("error", ""), unpatched
    assert any("_build_fused_kv_buffers" in frame for frame in unpatched["where"]), unpatched
    assert res["patch"] == "patched"
    patched = res["patched"]
    assert patched["hidden"] <= 2e-5 and patched["logits"] <= 5e-5, patched
    assert patched["drafts_equal"] == patched["drafts"] == 12, patched


def test_the_check_refuses_code_it_was_not_written_against():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

    from skyrl_mtp.vllm_patches.dflash_reload import DFlashReloadPatchError, _check

    _check(DFlashQwen3Model, DFlashQwen3ForCausalLM)

    class Moved(DFlashQwen3Model):
        def _build_fused_kv_buffers(self):
            return None

    class NoRebuild(DFlashQwen3ForCausalLM):
        def load_weights(self, weights):
            return None

    with pytest.raises(DFlashReloadPatchError, match=r"_build_fused_kv_buffers no longer contains"):
        _check(Moved, DFlashQwen3ForCausalLM)
    with pytest.raises(DFlashReloadPatchError, match=r"load_weights no longer contains"):
        _check(DFlashQwen3Model, NoRebuild)
