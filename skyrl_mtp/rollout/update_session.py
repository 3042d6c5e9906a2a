"""An engine's side of one weight update: vLLM's session opened at the first update, closed on every failure.

vLLM's GPU transports (`ipc`, `nccl`) put the model into a layerwise reload when the session starts (every
layer on the meta device until its weights arrive, `initialize_layerwise_reload`) and take it out at finish.
Read in vLLM 0.32 (v1/worker/gpu_worker.py), a failure leaves that half way in two ways:
- an update that raises inside the worker (`update_weights`' except branch) clears `_weight_update_active`
  but never finalizes the reload: layers that got nothing stay on meta, and `finish_weight_update` then
  refuses ("called without a matching start_weight_update");
- an update that fails before it reaches the worker (the engine's msgpack encoder refusing the payload, an
  RPC error) leaves the worker's session open: the next `start_weight_update` refuses ("already active").
`WeightUpdateSession` closes either through the worker extension (`skyrl_abort_weight_update`): it finishes
vLLM's open session, or finalizes the dangling reload, which puts back the previous weights of every layer
that received none. If some layer did receive weights, the model is a mix of old and new: the part is marked
stale and the engine refuses to generate until a later sync of that part completes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from skyrl_mtp.weight_sync.schema import WeightSchema, WeightSyncError, check_update_info

logger = logging.getLogger(__name__)
ABORT_RPC = "skyrl_abort_weight_update"


class StaleWeightsError(RuntimeError):
    """The engine's weights are a mix of two versions after a weight sync that failed part way."""


class WeightUpdateSession:
    """`engine`: vLLM's AsyncLLM (its weight-transfer methods and `collective_rpc`); `check`: check each update
    chunk against `schema` here (transports whose workers do not check them); `log(*event)` records the calls."""

    def __init__(self, engine: Any, engine_index: int, schema: WeightSchema, dtype: str, *, check: bool,
                 log: Callable[..., None]):
        self._engine, self.engine_index, self.schema, self.dtype = engine, engine_index, schema, dtype
        self.check, self._log = check, log
        self.open: dict[str, Any] | None = None   # {"part": "main" | "draft", "started": bool}
        self.stale: dict[str, str] = {}           # part -> why its weights are mixed

    def start(self, draft: bool) -> None:
        """Opens a session on the main model or the MTP drafter. It reaches vLLM with the first update, after
        that update has been checked, so a refused update leaves the model untouched."""
        if self.open is not None:
            raise RuntimeError(f"engine {self.engine_index}: a weight update ({self.open['part']}) is already "
                               "open; finish it first")
        self.open = {"part": "draft" if draft else "main", "started": False}

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        session = self.open
        if session is None:
            raise RuntimeError(f"engine {self.engine_index}: update_weights without start_weight_update")
        if self.check:
            try:
                for info in update_info if isinstance(update_info, list) else [update_info]:
                    check_update_info(info, self.schema, session["part"], self.dtype)
            except WeightSyncError as err:
                if session["started"]:   # earlier chunks went in: close vLLM's session properly
                    await self.abort(f"a later chunk was refused: {err}")
                self.open = None
                raise
        try:
            if not session["started"]:
                session["started"] = True   # from here on a failure may leave vLLM's session open
                if session["part"] == "draft":
                    self._log("start_draft_weight_update")
                    await self._engine.start_draft_weight_update()
                else:
                    self._log("start_weight_update")
                    await self._engine.start_weight_update()
            self._log("update_weights", session["part"])
            await self._engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        except BaseException as err:
            await self.abort(f"{type(err).__name__}: {err}")
            raise

    async def finish(self) -> None:
        session = self.open
        if session is None:
            raise RuntimeError(f"engine {self.engine_index}: finish_weight_update without start_weight_update")
        if session["started"]:
            self._log("finish_weight_update", session["part"])
            try:
                await self._engine.finish_weight_update()
            except BaseException as err:
                await self.abort(f"finish_weight_update failed: {type(err).__name__}: {err}")
                raise
            self.stale.pop(session["part"], None)   # a complete sync of the part: its weights are whole again
        self.open = None

    async def abort(self, reason: str) -> dict[str, Any] | None:
        """Close the open session whatever state vLLM's side is in (the trainer calls it when the sync failed
        on another engine or rank; `update`/`finish` call it on their own failures). Returns what the worker
        did, None when no session reached vLLM."""
        session, self.open = self.open, None
        if session is None or not session["started"]:
            return None
        part = session["part"]
        self._log("abort_weight_update", part)
        try:
            done = (await self._engine.collective_rpc(ABORT_RPC, args=(part,)))
        except Exception as err:   # noqa: BLE001 - the engine can no longer be trusted either way
            self.stale[part] = f"{reason}; closing vLLM's session failed too ({type(err).__name__}: {err})"
            logger.error("engine %d: %s", self.engine_index, self.stale[part])
            return None
        written = sum(int(d["layers_written"]) for d in done)
        if written:
            self.stale[part] = (f"{reason}; {written} layers of the {part} model had received new weights when the "
                                "sync stopped")
            logger.error("engine %d: weight sync of the %s model failed part way: %s", self.engine_index, part,
                         self.stale[part])
        return {"part": part, "workers": done, "layers_written": written}

    def require_whole(self) -> None:
        """Raise before a generate call while some part holds a mix of two weight versions."""
        if self.stale:
            parts = "; ".join(f"{p}: {why}" for p, why in sorted(self.stale.items()))
            raise StaleWeightsError(f"engine {self.engine_index}: its weights are incomplete after a failed weight "
                                    f"sync ({parts}); a complete sync of those parts must succeed before it "
                                    "generates again")
