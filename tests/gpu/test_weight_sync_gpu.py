"""The GPU weight sync: vLLM's `nccl` transport from a GPU "policy" actor to a GPU engine, via the same
`PolicyEngineLink` / `WeightSender` the trainer uses (the CPU tests run the same calls over `skyrl_cpu`).

Marked `gpu` (skipped without CUDA by tests/conftest.py); needs 2 GPUs (one for the sender, one for the
engine) and a CUDA build of vLLM. Checks: after a sync the engine's weights (target and MTP drafter)
equal those of a fresh engine on the pushed checkpoint, bit for bit, and a bad push is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu


def _weights(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_sync_from_a_gpu_sender_equals_a_fresh_engine(ray_local, tmp_path):
    import ray

    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
    from skyrl_mtp.rollout.client import EngineClient
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.weight_sync.policy_link import PolicyEngineLink, PolicySenderMixin
    from skyrl_mtp.weight_sync.schema import WeightSyncError, part_names

    oracle = cached_tiny_checkpoint(tmp_path, TinyModelSpec(seed=0, head="oracle"))
    random_ckpt = cached_tiny_checkpoint(tmp_path, TinyModelSpec(seed=0, head="random"))

    @ray.remote(num_gpus=1)
    class DictPolicy(PolicySenderMixin):
        def __init__(self, weights):
            self.rank, self.weights = 0, weights

        def iter_hf_weights(self, part):
            for name in part_names(list(self.weights), part):
                yield name, self.weights[name]

    def engines(ckpt):
        return EngineClient.create(EngineConfig(model_path=str(ckpt), num_speculative_tokens=1,
                                                weight_transfer_backend="nccl", max_model_len=256),
                                   num_gpus_per_engine=1)

    fresh = engines(oracle)
    want = fresh.weight_digests()[0]
    fresh.shutdown()
    target = engines(random_ckpt)
    try:
        policy = DictPolicy.remote(_weights(oracle))
        link = PolicyEngineLink([policy], target)
        stats = link.push()
        assert stats["sync/main_bytes"] > 0 and stats["sync/draft_bytes"] > 0
        target.reset_prefix_cache()
        assert target.weight_digests()[0] == want
        bad = _weights(oracle)
        q = next(n for n in bad if n.endswith("q_proj.weight"))
        bad[q + "_renamed"] = bad.pop(q)
        link = PolicyEngineLink([DictPolicy.remote(bad)], target)
        with pytest.raises(Exception, match="_renamed") as err:
            link.push()
        assert isinstance(err.value, WeightSyncError) or "WeightSyncError" in str(err.value)
        assert target.weight_digests()[0] == want
    finally:
        target.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ipc_sync_to_a_colocated_engine_equals_a_fresh_engine(ray_local, tmp_path):
    """vLLM's `ipc` transport between a "policy" actor and an engine on the same GPU (half a GPU each, as the
    colocated recipes share them): the engine's environment allows vLLM's pickle fallback for the CUDA IPC handles,
    the packing buffer holds the largest tensor, and a push equals a fresh engine, bit for bit."""
    import ray

    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
    from skyrl_mtp.rollout.client import EngineClient
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.weight_sync.policy_link import PolicyEngineLink, PolicySenderMixin
    from skyrl_mtp.weight_sync.schema import part_names

    oracle = cached_tiny_checkpoint(tmp_path, TinyModelSpec(seed=0, head="oracle"))
    random_ckpt = cached_tiny_checkpoint(tmp_path, TinyModelSpec(seed=0, head="random"))

    @ray.remote(num_gpus=0.5)
    class DictPolicy(PolicySenderMixin):
        def __init__(self, weights):
            self.rank, self.weights = 0, weights

        def iter_hf_weights(self, part):
            for name in part_names(list(self.weights), part):
                yield name, self.weights[name]

    def engines(ckpt, backend):
        return EngineClient.create(EngineConfig(model_path=str(ckpt), num_speculative_tokens=1,
                                                weight_transfer_backend=backend, max_model_len=256,
                                                engine_kwargs={"gpu_memory_utilization": 0.3}),
                                   num_gpus_per_engine=0.5)

    fresh = engines(oracle, "nccl")
    want = fresh.weight_digests()[0]
    fresh.shutdown()
    target = engines(random_ckpt, "ipc")
    try:
        link = PolicyEngineLink([DictPolicy.remote(_weights(oracle))], target)
        stats = link.push()
        assert stats["sync/main_bytes"] > 0 and stats["sync/draft_bytes"] > 0
        target.reset_prefix_cache()
        assert target.weight_digests()[0] == want
    finally:
        target.shutdown()
