"""What the GPU work changed on the CPU path, in one process: the policy picks its device through the seam
(CPU + gloo + torch AdamW here), activation recompute trains bitwise like no recompute, ``iter_hf_weights``
splits the export into the main model and the draft head, and the checkpoint's HF export (written tensor
by tensor from that stream) equals the whole-state-dict bridge."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.net import free_port
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron.hf_bridge import megatron_to_hf
from skyrl_mtp.policy.megatron_policy import MegatronPolicy, load_hf_weights, reproducible_metrics
from skyrl_mtp.policy.synthetic_batch import random_dapo_batch

pytestmark = pytest.mark.integration
CFG = dict(policy_lr=1e-3, head_lr=1e-3, micro_batch_size=2, seed=0)


def _batch(seed=0):
    return random_dapo_batch(torch.Generator().manual_seed(seed), 4, 16, prompt_len=4)


def test_cpu_rank_recompute_stream_export(tiny_ckpt, tmp_path):
    plain = MegatronPolicy(PolicyWorkerConfig(**CFG), str(tiny_ckpt), 0, 1, "127.0.0.1", free_port())
    recompute = MegatronPolicy(PolicyWorkerConfig(**CFG, recompute_activations=True), str(tiny_ckpt), 0, 1,
                               "127.0.0.1", free_port())
    try:
        assert (str(plain.device.device), plain.device.backend) == ("cpu", "gloo")
        assert type(plain.policy_side).__name__ == "TorchSideOptimizer"
        # megatron.recompute_activations reaches the TransformerConfig Megatron built (its blocks read it)
        assert (recompute.model.config.recompute_granularity, recompute.model.config.recompute_method,
                recompute.model.config.recompute_num_layers) == ("full", "uniform", 1)
        assert plain.model.config.recompute_granularity is None
        assert not plain.transformer_engine                    # the local spec on CPU
        assert plain.release_device_memory() == [] and plain.reclaim_device_memory() == []   # CPU: no-ops
        src = load_hf_weights(tiny_ckpt)
        first = plain.export_weights()                       # the sharded load is exact
        assert first.keys() == src.keys() and all(torch.equal(first[k], src[k]) for k in src)
        calls = {"plain": 0, "recompute": 0}
        for name, pol in (("plain", plain), ("recompute", recompute)):
            pol.model.decoder.layers[0].register_forward_hook(
                lambda *_a, _n=name: calls.__setitem__(_n, calls[_n] + 1))
        for seed in range(2):
            m1, m2 = plain.train_step(_batch(seed), "dapo", {}), recompute.train_step(_batch(seed), "dapo", {})
            assert m1.keys() == m2.keys() and reproducible_metrics(m1) == reproducible_metrics(m2)
        assert calls == {"plain": 4, "recompute": 8}          # 2 micro-batches x 2 steps; recompute: again in backward
        main, draft = dict(plain.iter_hf_weights("main")), dict(plain.iter_hf_weights("draft"))
        assert main.keys().isdisjoint(draft.keys()) and (main.keys() | draft.keys()) == src.keys()
        assert draft and all(k.startswith("model.mtp_layers.") for k in draft)
        for k, v in {**main, **dict(recompute.iter_hf_weights("main"))}.items():
            assert torch.equal(v, main[k]), k
        with pytest.raises(ValueError, match=r"which='all' is invalid; allowed: \('main', 'draft'\)"):
            plain.iter_hf_weights("all")
        ref = megatron_to_hf([{n: p.detach() for n, p in plain.model.named_parameters()}], plain.args,
                             plain.mtp_layers)
        plain.save_checkpoint(str(tmp_path / "ck"))
        saved = load_file(str(tmp_path / "ck" / "hf" / "model.safetensors"))
        assert saved.keys() == ref.keys() and all(torch.equal(saved[k], ref[k]) for k in ref)
        head = load_file(str(tmp_path / "ck" / "draft_head" / "draft_head.safetensors"))
        assert head.keys() == draft.keys() and all(torch.equal(head[k], draft[k]) for k in head)
    finally:
        for p in (plain, recompute):
            p.capture.remove()
