"""Which parameters a pipeline stage holds, under the names its Megatron model gives them.

A family's weight rules name every Megatron parameter of the whole model (``decoder.layers.{i}`` with the
global layer index i). A pipeline stage builds layers ``offset .. offset + n - 1`` and numbers them locally
(``decoder.layers.{i - offset}``), the embedding on the first stage, the final norm, output layer and MTP
block (``mtp.*``) on the last. With MTP on a last stage that is not the first, Megatron keeps a COPY of the
embedding there for the MTP block (GPTModel builds ``embedding`` when ``mtp_process``); the first stage's
embedding stays the one the policy trains and exports, and the copy follows it (``MegatronPolicy`` refreshes
it after every update; the MTP replay reads it detached).

``StageLayout`` maps global names to this stage's (None when another stage holds them) and says which stage
owns each global name: the one whose parameter is trained, streamed to the engines and exported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

EMBEDDING = "embedding.word_embeddings.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LAST_STAGE_PREFIXES = ("decoder.final_layernorm.", "output_layer.", "mtp.")


class StageLayoutError(ValueError):
    """A global parameter name this layout cannot place on a stage."""


@dataclass(frozen=True)
class StageLayout:
    pp_rank: int
    pp_size: int
    layer_offset: int        # global index of this stage's first decoder layer
    num_layers: int          # decoder layers on this stage
    layers_per_stage: int    # every stage's count (Megatron's even split)
    has_mtp: bool            # the MTP block is built on this stage (the last)

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def embedding_is_copy(self) -> bool:
        """This stage holds the MTP block's copy of the embedding, not the trained one."""
        return self.has_mtp and not self.is_first

    def owner(self, global_name: str) -> int:
        """The stage that owns (trains, streams, exports) a global parameter."""
        if global_name == EMBEDDING:
            return 0
        m = _LAYER.match(global_name)
        if m:
            return int(m.group(1)) // self.layers_per_stage
        if global_name.startswith(_LAST_STAGE_PREFIXES):
            return self.pp_size - 1
        raise StageLayoutError(f"no pipeline stage known for parameter {global_name!r}")

    def local_name(self, global_name: str) -> str | None:
        """This stage's name of a global parameter, or None if the stage does not hold it."""
        if global_name == EMBEDDING:
            return global_name if self.is_first or self.embedding_is_copy else None
        m = _LAYER.match(global_name)
        if m:
            i = int(m.group(1)) - self.layer_offset
            return f"decoder.layers.{i}.{m.group(2)}" if 0 <= i < self.num_layers else None
        if global_name.startswith("mtp."):
            return global_name if self.has_mtp else None
        return global_name if self.owner(global_name) == self.pp_rank else None


def single_stage(num_layers: int, has_mtp: bool) -> StageLayout:
    return StageLayout(0, 1, 0, num_layers, num_layers, has_mtp)


def stage_layout(config, pp_rank: int, pp_size: int, has_mtp: bool) -> StageLayout:
    """The layout Megatron builds for ``config`` (its TransformerConfig) on stage ``pp_rank``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.num_layers % pp_size:
        raise StageLayoutError(f"num_layers={config.num_layers} is not divisible by pipeline parallel size "
                               f"pp={pp_size} (the stages hold equal numbers of layers)")
    n = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)
    per = config.num_layers // pp_size
    if n != per or offset != pp_rank * per:
        raise StageLayoutError(f"megatron-core builds {n} layers from {offset} on stage {pp_rank}; this layout "
                               f"expects an even split of {config.num_layers} over {pp_size} stages")
    return StageLayout(pp_rank, pp_size, offset, n, per, has_mtp)


def stage_rules(global_rules: Mapping, layout: StageLayout) -> dict:
    """{this stage's parameter name: rule} for loading this stage from an HF checkpoint."""
    return {local: rule for name, rule in global_rules.items() if (local := layout.local_name(name)) is not None}


def owned_rules(global_rules: Mapping, layout: StageLayout) -> dict:
    """{global name: (owner stage, this stage's name or None)} in the global (layer) order: the stream every
    stage walks together to export or sync the whole model."""
    return {name: (layout.owner(name), layout.local_name(name) if layout.owner(name) == layout.pp_rank else None)
            for name in global_rules}
