"""vLLM's `VLLMWeightSyncClient` protocol over this project's `InferenceEngine` Ray actors.

vLLM's trainer-side engines drive the update round (init, start, update, finish) through a client; its
`RayVLLMWeightSyncClient` sends the same init info to every handle, which fits one vLLM deployment.
Here each engine actor is its own deployment, so engine e's workers take ranks
`rank_offset + e * workers_per_engine + worker rank` in the transfer group: the client shifts the
rank offset per engine. `part` selects what a round updates: "main" calls `start_weight_update`,
"draft" calls `start_draft_weight_update` (vLLM's session targeting the MTP drafter).
"""

from __future__ import annotations

from typing import Any


class EngineActorsClient:
    def __init__(self, actors: list[Any], workers_per_engine: int):
        self.actors = list(actors)
        self.workers_per_engine = int(workers_per_engine)
        self.part = "main"

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        import ray

        refs = []
        for e, actor in enumerate(self.actors):
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = int(info["rank_offset"]) + e * self.workers_per_engine
            refs.append(actor.init_weight_transfer_engine.remote(info))
        ray.get(refs)

    def start_weight_update(self) -> None:
        self._all("start_weight_update", self.part == "draft")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")

    def abort_weight_update(self) -> None:
        """Not in vLLM's protocol: every engine closes its session without finishing it (update_session.py)."""
        self._all("abort_weight_update")
