"""The GPU weight-sync transport: NcclWeightSender broadcasting to engine-side receivers over NCCL.

Marked `gpu` (skipped without CUDA by tests/conftest.py). The broadcast itself needs one GPU per
rank, so those tests also skip below 2 (or 3) visible GPUs; on a single-GPU machine only the
metadata test runs. Receivers here do what the engine's worker extension does
(`skyrl_receive_weights_nccl`): allocate from the broadcast plan, receive in plan order.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from skyrl_mtp.rollout.weight_sync import (
    NcclWeightSender,
    broadcast_plan,
    describe_tensors,
    nccl_group_layout,
    torch_dtype,
    validate_update,
)

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _weights(device: str) -> dict[str, torch.Tensor]:
    """The same named tensors in every process (seeded), mixed dtypes and shapes like a real update."""
    g = torch.Generator().manual_seed(1234)
    return {
        "model.embed_tokens.weight": torch.randn(512, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g),
        "model.mtp_layers.0.input_proj.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(512, 64, generator=g).to(torch.bfloat16),
    } if device == "cpu" else {k: v.to(device) for k, v in _weights("cpu").items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sender(port: int, world_size: int, out: mp.Queue) -> None:
    try:
        torch.cuda.set_device(0)
        sender = NcclWeightSender("127.0.0.1", port, world_size, device=0)
        sender.send(_weights("cuda:0"))
        out.put(("sender", 0, "ok"))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put(("sender", 0, f"{type(err).__name__}: {err}"))


def _receiver(rank: int, port: int, world_size: int, plan: list, out: mp.Queue) -> None:
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=world_size)
        comm = PyNcclCommunicator(group, device=device)
        stream = torch.cuda.current_stream(device)
        got = {}
        for name, shape, dtype in plan:
            t = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
            comm.broadcast(t, src=0, stream=stream)
            stream.synchronize()
            got[name] = t.cpu()
        expected = _weights("cpu")
        bad = [n for n in expected if not torch.equal(got[n], expected[n])]
        out.put(("receiver", rank, "ok" if not bad else f"mismatch in {bad}"))
    except Exception as err:  # noqa: BLE001
        out.put(("receiver", rank, f"{type(err).__name__}: {err}"))


def test_plan_of_cuda_bf16_tensors_matches_the_engine_schema():
    from skyrl_mtp.rollout.weight_sync import TensorSpec

    tensors = _weights("cuda:0")
    plan = broadcast_plan(tensors)
    assert [p[0] for p in plan] == list(tensors)
    assert plan[0] == ("model.embed_tokens.weight", [512, 64], "bfloat16")
    assert plan[2] == ("model.layers.0.self_attn.q_proj.bias", [64], "float32")
    schema = {n: TensorSpec(tuple(t.shape), "bfloat16" if t.dtype == torch.bfloat16 else "float32")
              for n, t in tensors.items()}
    validate_update(describe_tensors(tensors), schema, "bfloat16")


@pytest.mark.parametrize("engine_tp_sizes", [[1], [1, 1], [2]], ids=["1engine_tp1", "2engines_tp1", "1engine_tp2"])
def test_nccl_broadcast_reaches_every_engine_rank_bit_exact(engine_tp_sizes):
    layout = nccl_group_layout(engine_tp_sizes)
    if _gpus() < layout.world_size:
        pytest.skip(f"needs {layout.world_size} GPUs (1 sender + {sum(engine_tp_sizes)} engine ranks), "
                    f"{_gpus()} visible")
    plan = broadcast_plan(_weights("cpu"))
    port = _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(port, layout.world_size, out))]
    procs += [ctx.Process(target=_receiver, args=(rank, port, layout.world_size, plan, out))
              for rank in range(1, layout.world_size)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == sorted([("sender", 0, "ok")] + [("receiver", r, "ok") for r in range(1, layout.world_size)])
