"""Per-step statistics of a MoE model's routers: tokens per expert, load balance and dropped tokens.

A forward hook on every megatron-core ``TopKRouter`` counts, during training forwards, how many tokens each
expert received (the router's ``routing_map``: global expert indices, this rank's tokens, before
dispatch) and how many of the ``tokens * topk`` assignments were dropped (megatron-core drops over capacity
when ``moe_expert_capacity_factor`` is set; dropless routing drops none). ``metrics`` sums the counts
over the data-parallel group and reports, over the trunk's MoE layers (``moe/``) and the MTP layers'
(``mtp/moe_``, counted when the draft loss replays them):
- ``tokens_per_expert_{min,mean,max}``: over experts and layers;
- ``load_max_over_mean``: the worst layer's max / mean tokens per expert (1.0 = perfectly balanced);
- ``load_cv``: the mean over layers of the coefficient of variation of tokens per expert;
- ``dropped_tokens``: assignments dropped, summed over layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RouterStats:
    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: dict[str, torch.Tensor] = {}
        self.dropped: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                self._handles.append(module.register_forward_hook(self._hook(name.removesuffix(".mlp.router"))))

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _hook(self, layer: str):
        def hook(module, args, output):
            if not module.training:
                return
            _probs, routing_map = output
            with torch.no_grad():
                per_expert = routing_map.sum(dim=0).double()
                dropped = routing_map.shape[0] * module.topk - per_expert.sum()
                self.counts[layer] = self.counts.get(layer, 0) + per_expert
                self.dropped[layer] = self.dropped.get(layer, 0) + dropped
        return hook

    def clear(self) -> None:
        self.counts, self.dropped = {}, {}

    def metrics(self, dp_group) -> dict[str, float]:
        """The step's statistics (a collective over ``dp_group`` when it has more than one rank: every rank
        must call it, with the same layers counted)."""
        layers = sorted(self.counts)
        if not layers:
            return {}
        stacked = torch.stack([self.counts[n] for n in layers])                    # [layers, experts]
        dropped = torch.stack([torch.as_tensor(self.dropped[n], dtype=torch.float64) for n in layers])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(stacked, group=dp_group)
            dist.all_reduce(dropped, group=dp_group)
        out: dict[str, float] = {}
        for prefix, is_mtp in (("moe/", False), ("mtp/moe_", True)):
            rows = [i for i, n in enumerate(layers) if n.startswith("mtp.") == is_mtp]
            if not rows:
                continue
            c = stacked[rows].cpu()
            mean = c.mean(dim=1).clamp_min(1e-12)
            out[prefix + "tokens_per_expert_min"] = float(c.min())
            out[prefix + "tokens_per_expert_mean"] = float(c.mean())
            out[prefix + "tokens_per_expert_max"] = float(c.max())
            out[prefix + "load_max_over_mean"] = float((c.max(dim=1).values / mean).max())
            out[prefix + "load_cv"] = float((c.std(dim=1, unbiased=False) / mean).mean())
            out[prefix + "dropped_tokens"] = float(dropped[rows].sum())
        self.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
