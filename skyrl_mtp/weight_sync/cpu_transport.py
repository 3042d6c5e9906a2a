"""The CPU weight transport: vLLM's dense-NCCL protocol over a gloo group, so CI runs the GPU call sequence.

vLLM ships `nccl` and `ipc` transports only (both CUDA). This one mirrors `nccl`: the trainer side (rank 0,
in the process that holds the weights) and every engine worker (ranks `rank_offset + worker rank`) join a
stateless gloo group at `init_weight_transfer_engine`; each round the trainer declares the update
(`names`, `dtype_names`, `shapes`), the workers allocate from it and receive one broadcast per tensor, in
the source's (layer) order, loading each as it arrives through vLLM's layerwise reload.

One addition over `nccl`: before any tensor moves, every worker checks the declared update against the
checkpoint it serves (names, shapes, dtypes of the part being updated) and all ranks agree on the verdict
(an all-reduce MIN of an ok flag), so a bad push is refused on both sides, naming the tensor, and the
worker's model is untouched: its layerwise reload starts only after the check (`start_weight_update` only
records the session). Registered in both vLLM factories by `registration.register_cpu_transport`.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from skyrl_mtp.drafters.kinds import METHODS as EXTERNAL_METHODS
from skyrl_mtp.weight_sync.registration import CPU_BACKEND
from skyrl_mtp.weight_sync.schema import WeightSyncError, part_schema, read_weight_schema, validate_update

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class CPUWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class CPUWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names/dtype_names/shapes have lengths {len(self.names)}/{len(self.dtype_names)}/"
                             f"{len(self.shapes)}; they must be equal")


@dataclass
class CPUTrainerInitInfo(TrainerInitInfo):
    """`listen_socket`: rank 0's socket already bound to `master_port` (the group's store takes it over), or None
    to bind the port at init (then another process may have taken it since it was picked)."""
    backend: ClassVar[str] = CPU_BACKEND
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    listen_socket: socket.socket | None = field(default=None, repr=False, compare=False)


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
               listen_socket: socket.socket | None = None):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, "gloo",
                                                          listen_socket=listen_socket,
                                                          timeout=timedelta(seconds=timeout_s))


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def all_agree(group: Any, ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


def update_info_of(meta: list[ParamMeta]) -> CPUWeightTransferUpdateInfo:
    return CPUWeightTransferUpdateInfo(names=[m.name for m in meta],
                                       dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                       shapes=[list(m.shape) for m in meta])


class CPUWeightTransferEngine(WeightTransferEngine[CPUWeightTransferInitInfo, CPUWeightTransferUpdateInfo]):
    """Worker side (inside vLLM's CPU worker)."""

    init_info_cls = CPUWeightTransferInitInfo
    update_info_cls = CPUWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self._reloading = False
        self._schema = None

    def init_transfer_engine(self, init_info: CPUWeightTransferInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.timeout_s)

    def _part(self) -> str:
        return "main" if self.model is self._default_model else "draft"

    def _expected(self):
        if self._schema is None:
            self._schema = read_weight_schema(self.vllm_config.model_config.model)
            spec = self.vllm_config.speculative_config
            if spec is not None and spec.method in EXTERNAL_METHODS:   # the drafter's own checkpoint: "draft" part
                self._schema.update(read_weight_schema(spec.draft_model_config.model))
        return part_schema(self._schema, self._part())

    def start_weight_update(self) -> None:
        self._reloading = False   # the layerwise reload starts once the update has been checked

    def receive_weights(self, update_info: CPUWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("skyrl_cpu weight transfer not initialized; call init_weight_transfer_engine first")
        declared = {n: (tuple(s), d) for n, d, s in zip(update_info.names, update_info.dtype_names,
                                                           update_info.shapes)}
        engine_dtype = str(self.model_config.dtype).removeprefix("torch.")
        problem = None
        try:
            validate_update(declared, self._expected(), engine_dtype)
        except WeightSyncError as err:
            problem = err
        if not all_agree(self.group, problem is None):
            raise problem or WeightSyncError("weight sync refused by another rank of the transfer group; "
                                             "this worker's weights are unchanged")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True
        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                broadcast(self.group, weight)
                self.model.load_weights([(name, weight)])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))   # CPU: nothing to synchronize

    def finish_weight_update(self) -> None:
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            self._reloading = False

    def shutdown(self) -> None:
        self.group = None


class CPUTrainerWeightTransferEngine(TrainerWeightTransferEngine[CPUTrainerInitInfo]):
    """Trainer side: rank 0 of the transfer group, in the process that holds the weights."""

    init_info_cls = CPUTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = None
        self.last_bytes = 0

    @classmethod
    def trainer_init(cls, init_info: CPUTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> CPUTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("skyrl_cpu trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_init = CPUWeightTransferInitInfo(master_address=init_info.master_address,
                                                master_port=init_info.master_port, rank_offset=1,
                                                world_size=init_info.world_size, timeout_s=init_info.timeout_s)
        exe = ThreadPoolExecutor(max_workers=1)   # the workers block in the rendezvous until rank 0 joins
        try:
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker_init))
            engine.group = open_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                      init_info.timeout_s, listen_socket=init_info.listen_socket)
            future.result()
        finally:
            exe.shutdown(wait=False)   # if rank 0 failed, say so now, not after the workers' rendezvous times out
        return engine

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:   # stay in the source's collectives (TP gather)
                pass
            return
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(update_info_of(meta)))
            if not all_agree(self.group, True):
                future.result()   # raises the workers' refusal, which names the tensor
                raise WeightSyncError("weight sync refused by the engines' workers")
            sent = 0
            for _name, tensor in _checked(source, meta):
                t = tensor.detach().contiguous()
                broadcast(self.group, t)
                sent += t.numel() * t.element_size()
            future.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()
        self.last_bytes = sent

    def shutdown(self) -> None:
        self.group = None


def _checked(source: WeightSource, meta: list[ParamMeta]):
    """The source's pairs, each checked against what the workers were told to expect (they size their
    receive buffers from it)."""
    i = 0
    for name, tensor in source:
        want = meta[i] if i < len(meta) else None
        if want is None or name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise WeightSyncError(f"WeightSource iteration disagrees with its metadata at index {i}: declared "
                                  f"{want}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}")
        i += 1
        yield name, tensor
    if i != len(meta):
        raise WeightSyncError(f"WeightSource yielded {i} tensors but its metadata declared {len(meta)}")
