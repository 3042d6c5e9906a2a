"""A weight sync that fails after the engines' session started: the engine closes vLLM's session (it is never left
mid-update), the trainer's other ranks are not left in a collective, and the IPC packing buffer holds the largest
tensor. Pure logic: vLLM's AsyncLLM and the policy ranks are stand-ins recording the calls they get."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest

from skyrl_mtp.rollout.update_session import StaleWeightsError, WeightUpdateSession
from skyrl_mtp.weight_sync.schema import TensorSpec, WeightSyncError

SCHEMA = {"model.embed_tokens.weight": TensorSpec((8, 4), "float32"),
          "model.mtp_layers.0.input_proj.weight": TensorSpec((4, 8), "float32")}
MAIN_CHUNK = {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"], "shapes": [[8, 4]]}


class FakeAsyncLLM:
    """AsyncLLM's weight-transfer calls; `fail_update` makes update_weights raise, `written` is what the worker's
    abort reports (layers that had received new weights)."""

    def __init__(self, fail_update=None, written=0):
        self.calls, self.fail_update, self.written = [], fail_update, written

    async def start_weight_update(self):
        self.calls.append("start")

    async def start_draft_weight_update(self):
        self.calls.append("start_draft")

    async def update_weights(self, request):
        self.calls.append("update")
        if self.fail_update is not None:
            raise self.fail_update

    async def finish_weight_update(self):
        self.calls.append("finish")

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, *args))
        return [{"closed": "finished", "layers_written": self.written}]


def _session(engine, check=True):
    return WeightUpdateSession(engine, 0, SCHEMA, "float32", check=check, log=lambda *e: None)


def run(coro):
    return asyncio.run(coro)


def test_a_whole_sync_opens_vllms_session_at_the_first_update_and_finishes_it():
    eng = FakeAsyncLLM()
    s = _session(eng)
    s.start(draft=False)
    assert eng.calls == []                 # nothing reaches vLLM before an update has been checked
    run(s.update(MAIN_CHUNK))
    run(s.finish())
    assert eng.calls == ["start", "update", "finish"] and s.open is None and not s.stale
    s.require_whole()


def test_a_chunk_refused_before_the_session_started_leaves_vllm_untouched():
    eng = FakeAsyncLLM()
    s = _session(eng)
    s.start(draft=False)
    bad = {**MAIN_CHUNK, "shapes": [[9, 4]]}
    with pytest.raises(WeightSyncError, match=r"has shape \(9, 4\)"):
        run(s.update(bad))
    assert eng.calls == [] and s.open is None and not s.stale
    s.start(draft=False)                   # not stuck in a half-open session


@pytest.mark.parametrize("written,stale", [(0, False), (3, True)])
def test_an_update_that_fails_in_vllm_is_aborted_through_the_worker(written, stale):
    # e.g. vLLM's msgpack encoder refusing IPC handles (nothing loaded: the old weights are put back), or a chunk
    # failing in the worker after others were loaded (mixed weights: the engine refuses to generate)
    eng = FakeAsyncLLM(fail_update=TypeError("Object of type <class 'type'> is not serializable"), written=written)
    s = _session(eng)
    s.start(draft=True)
    with pytest.raises(TypeError):
        run(s.update({**MAIN_CHUNK, "names": ["model.mtp_layers.0.input_proj.weight"], "shapes": [[4, 8]]}))
    assert eng.calls == ["start_draft", "update", ("skyrl_abort_weight_update", "draft")]
    assert s.open is None and bool(s.stale) is stale
    if stale:
        assert "3 layers of the draft model had received new weights" in s.stale["draft"]
        with pytest.raises(StaleWeightsError, match="a complete sync of those parts must succeed"):
            s.require_whole()
        eng.fail_update = None             # a later complete sync of the part makes the engine whole again
        s.start(draft=True)
        run(s.update({**MAIN_CHUNK, "names": ["model.mtp_layers.0.input_proj.weight"], "shapes": [[4, 8]]}))
        run(s.finish())
    s.require_whole()


def test_the_trainer_can_abort_an_open_session_and_an_unopened_one_is_a_no_op():
    eng = FakeAsyncLLM(written=1)
    s = _session(eng)
    s.start(draft=False)
    assert run(s.abort("another engine failed")) is None and eng.calls == []   # never reached vLLM
    s.start(draft=False)
    run(s.update(MAIN_CHUNK))
    done = run(s.abort("another engine failed"))
    assert done["layers_written"] == 1 and eng.calls[-1] == ("skyrl_abort_weight_update", "main")
    assert "another engine failed" in s.stale["main"]


# ---------------------------------------------------------------------------------------------- trainer side

class Client:
    """EngineActorsClient's calls; update number `fail_at` raises."""

    def __init__(self, fail_at=None):
        self.calls, self.fail_at, self.n = [], fail_at, 0

    def init_weight_transfer_engine(self, info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, info):
        self.n += 1
        self.calls.append(f"update{self.n}")
        if self.n == self.fail_at:
            raise RuntimeError("engine 3: update failed")

    def finish_weight_update(self):
        self.calls.append("finish")

    def abort_weight_update(self):
        self.calls.append("abort")


def _ipc_like_send(client, barrier, chunks, is_sender):
    """The loop of vLLM's IPCTrainerWeightTransferEngine.send_weights / _send_packed: per chunk a collective of
    every rank (the handle all-gather), the sender's update call, a barrier (_post_send_sync)."""
    if is_sender:
        client.start_weight_update()
    for c in range(chunks):
        barrier.wait(timeout=5)            # _all_gather_and_merge_handles
        if is_sender:
            client.update_weights({"chunk": c})
        barrier.wait(timeout=5)            # _post_send_sync
    if is_sender:
        client.finish_weight_update()
    barrier.wait(timeout=5)


def _ranks(wire_for_sender, chunks=3):
    barrier = threading.Barrier(2)
    errors = {}

    def rank(r):
        try:
            _ipc_like_send(wire_for_sender if r == 0 else None, barrier, chunks, r == 0)
        except BaseException as err:       # noqa: BLE001
            errors[r] = err
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def test_without_deferral_a_failed_update_strands_the_other_rank():
    errors = _ranks(Client(fail_at=2))
    assert isinstance(errors[0], RuntimeError)
    assert isinstance(errors[1], threading.BrokenBarrierError)   # in a real run: a collective until NCCL's timeout


def test_the_ipc_sender_keeps_the_failure_so_every_rank_leaves_the_loop_and_the_engines_abort():
    from skyrl_mtp.weight_sync.sender import FailuresAfterStart

    client = Client(fail_at=2)
    wire = FailuresAfterStart(client)
    assert _ranks(wire) == {}
    assert client.calls == ["start", "update1", "update2", "abort"]   # no update after the failure, no finish
    assert "engine 3: update failed" in str(wire.failure)
    healthy = Client()
    wire = FailuresAfterStart(healthy)
    assert _ranks(wire) == {} and wire.failure is None
    assert healthy.calls == ["start", "update1", "update2", "update3", "finish"]


def test_every_rank_raises_the_senders_kept_failure():
    from skyrl_mtp.weight_sync import sender as sender_mod

    class Engine:   # the trainer-side engine after a failed session on the sender
        def send_weights(self):
            pass

    verdicts = []

    def agree(problem):   # the broadcast from rank 0 (policy_link._agree_over_ranks)
        verdicts.append(problem)
        return verdicts[0]

    for rank in (0, 1):
        s = object.__new__(sender_mod.WeightSender)
        s.defers_failures, s.is_sender, s.agree = True, rank == 0, agree
        s.wire = sender_mod.FailuresAfterStart(Client())
        if rank == 0:
            s.wire.failure = RuntimeError("engine 3: update failed")
        with pytest.raises(WeightSyncError, match="failed after the engines' update session started.*engine 3"):
            s._raise_deferred("main")
    assert verdicts[1] is None            # rank 1 knew nothing; it raised rank 0's verdict


# ---------------------------------------------------------------------------------------------- IPC buffer

def _mimo7b_schema():
    schema = {"model.embed_tokens.weight": TensorSpec((151680, 4096), "bfloat16"),
              "lm_head.weight": TensorSpec((151680, 4096), "bfloat16")}
    for i in range(36):
        p = f"model.layers.{i}."
        schema[p + "mlp.gate_proj.weight"] = TensorSpec((11008, 4096), "bfloat16")
        schema[p + "self_attn.q_proj.weight"] = TensorSpec((4096, 4096), "bfloat16")
    return schema


def test_the_ipc_packing_buffer_holds_a_mimo7b_embedding():
    from vllm.distributed.weight_transfer import ipc_engine, packed_tensor

    from skyrl_mtp.weight_sync.transport import (
        ipc_buffer_bytes,
        largest_tensor_bytes,
        trainer_init_info,
    )

    embedding = 151680 * 4096 * 2
    assert embedding == 1_242_562_560 > packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES   # vLLM's 1 GiB default
    assert largest_tensor_bytes(_mimo7b_schema(), "bfloat16") == embedding
    size = ipc_buffer_bytes(_mimo7b_schema(), "bfloat16")
    assert embedding <= size < embedding + 2**20 and size % 2**20 == 0
    # an fp32 engine may be sent fp32 tensors: twice the bytes
    assert ipc_buffer_bytes(_mimo7b_schema(), "float32") >= 2 * embedding
    # small models keep vLLM's default
    assert ipc_buffer_bytes({"w": TensorSpec((8, 8), "float32")}, "float32") == packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES
    info = trainer_init_info("ipc", rank=0, ipc_buffer_size=size)
    assert isinstance(info, ipc_engine.IPCTrainerInitInfo) and info.packed and info.packed_buffer_size_bytes == size
    # what vLLM does with it (read from its source): the trainer engine takes the buffer size from the init info,
    # and the packed producer refuses any tensor larger than the buffer
    assert "packed_buffer_size_bytes=init_info.packed_buffer_size_bytes" in inspect.getsource(
        ipc_engine.IPCTrainerWeightTransferEngine.trainer_init)
    assert "exceeds buffer_size_bytes" in inspect.getsource(packed_tensor.packed_ipc_producer)
    with pytest.raises(ValueError, match="ipc_buffer_size=None is invalid for the ipc transport"):
        trainer_init_info("ipc", rank=0)
