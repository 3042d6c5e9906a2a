"""Record the target's residual stream at chosen layers during the policy's own forward, for drafters that read it.

An EAGLE-3 (or DFlash) drafter is fed hidden states of the target taken between decoder layers. Training it online
with a loss decoupled from the policy needs exactly those states, from the forward the policy loss already runs (no
second forward), detached so that nothing the drafter does reaches the trunk.

Layer ids are vLLM's aux layer ids (``EagleModelMixin._maybe_add_hidden_state`` in
vllm/model_executor/models/interfaces.py, called by llama.py / qwen2.py's model forward): id 0 is the token
embedding, id L in 1..num_layers is ``hidden_states + residual`` after decoder layer L-1, i.e. the input of layer
L; id num_layers is the input of the final norm (the pre-norm output). In Megatron each layer adds its residual
itself, so id L < num_layers is the ``hidden_states`` argument of ``decoder.layers[L]`` and id num_layers the
input of ``decoder.final_layernorm``: one forward pre-hook each, recording a detached reference (no copy; nothing
in Megatron's layers writes a layer's input in place).

vLLM sorts the ids and drops repeats before collecting (``_set_aux_hidden_state_layers``) and concatenates the
states in that order (gpu_model_runner.py, ``torch.cat(aux_hidden_states, dim=-1)``), while its EAGLE-3 drafter
sizes its input projection by the configured list's length: repeated ids are refused here, and the states come
out in ascending id order whatever order the ids were given in.

Layout: each state is [S, B, H], Megatron's (sequence first), as the decoder holds it. Under tensor parallelism
with sequence parallelism off every TP rank holds the full, identical state (each layer's row-parallel output
projections all-reduce); sequence parallelism and context parallelism would leave each rank a slice of the
sequence, and pipeline parallelism would leave the states on other stages than the drafter's: all three are refused
by name, as are CUDA graphs (a graphed layer runs without its hooks).

Recording is armed by a pre-hook on the decoder and disarmed when the decoder returns, so the re-run of the layers
that activation recompute does in backward records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_mtp.mtp.capture import CaptureError


@dataclass(frozen=True)
class CapturedLayerStates:
    layer_ids: tuple[int, ...]          # vLLM aux layer ids, ascending (vLLM's concatenation order)
    states: tuple[torch.Tensor, ...]    # one detached [S, B, H] per id, in the model's dtype


def check_layer_ids(layer_ids, num_layers: int) -> tuple[int, ...]:
    """The ids, ascending, if each is an int in 0..num_layers and none repeats; a ValueError naming the first bad
    value and the allowed range otherwise."""
    allowed = (f"ints in 0..{num_layers} (vLLM's aux layer ids for a {num_layers}-layer model: 0 the embedding, L "
               f"the input of decoder layer L, {num_layers} the final norm's input), each at most once")
    try:
        ids = list(layer_ids)
    except TypeError:
        raise ValueError(f"layer_ids={layer_ids!r} is invalid; allowed: a non-empty sequence of {allowed}") from None
    if not ids:
        raise ValueError(f"layer_ids={layer_ids!r} is invalid; allowed: a non-empty sequence of {allowed}")
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= num_layers:
            raise ValueError(f"layer id {v!r} in layer_ids={layer_ids!r} is invalid; allowed: {allowed}")
    repeated = sorted({v for v in ids if ids.count(v) > 1})
    if repeated:
        raise ValueError(f"layer ids {repeated} repeat in layer_ids={layer_ids!r}; allowed: {allowed} (vLLM drops "
                         "repeats from what the target returns but not from the drafter's input width)")
    return tuple(sorted(ids))


def _refuse_unsupported(config) -> None:
    """Refuse the layouts under which a rank does not hold the captured states whole, and CUDA graphs (a graphed
    layer runs without its forward hooks)."""
    for key, allowed, ok in (("pipeline_model_parallel_size", "1", lambda v: v == 1),
                             ("context_parallel_size", "1", lambda v: v == 1),
                             ("sequence_parallel", "False", lambda v: not v),
                             ("cuda_graph_impl", "'none'", lambda v: v == "none")):
        value = getattr(config, key, None)
        if value is not None and not ok(value):
            raise CaptureError(f"{key}={value!r} is not supported by LayerHiddenCapture; allowed: {allowed} (the "
                               "hidden states are recorded by forward hooks, whole, on the rank that trains the "
                               "drafter)")


class LayerHiddenCapture:
    """Forward pre-hooks on ``model`` (a megatron-core GPTModel) that record, on each forward, the residual stream
    at ``layer_ids`` (vLLM's numbering, see the module docstring). ``take()`` hands over the last forward's states
    and forgets them; ``clear()`` forgets them (call it after a forward whose states nobody reads, so they are not
    kept alive); ``remove()`` takes the hooks off."""

    def __init__(self, model: torch.nn.Module, layer_ids):
        decoder = getattr(model, "decoder", None)
        config = getattr(model, "config", None)
        if decoder is None or config is None:
            raise CaptureError(f"{type(model).__name__} has no .decoder / .config: LayerHiddenCapture needs a "
                               "megatron-core GPTModel (unwrapped)")
        _refuse_unsupported(config)
        num_layers = int(config.num_layers)
        self.layer_ids = check_layer_ids(layer_ids, num_layers)
        by_number = {int(layer.layer_number): layer for layer in decoder.layers}   # Megatron numbers from 1
        targets = []
        for lid in self.layer_ids:
            if lid < num_layers:
                targets.append((lid, by_number[lid + 1]))
            elif getattr(decoder, "final_layernorm", None) is not None:
                targets.append((lid, decoder.final_layernorm))
            else:
                raise CaptureError(f"layer id {lid} (the final norm's input) cannot be captured: model.decoder has "
                                   "no final_layernorm")
        self._armed = False
        self._states: dict[int, torch.Tensor] = {}
        self._handles = [decoder.register_forward_pre_hook(self._arm),
                         decoder.register_forward_hook(self._disarm)]
        self._handles += [module.register_forward_pre_hook(self._recorder(lid), with_kwargs=True)
                          for lid, module in targets]

    def _arm(self, module, args):
        self._states = {}
        self._armed = True

    def _disarm(self, module, args, output):
        self._armed = False

    def _recorder(self, layer_id: int):
        def record(module, args, kwargs):
            if not self._armed:
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
            if not isinstance(hidden, torch.Tensor):
                raise CaptureError(f"{type(module).__name__} (layer id {layer_id}) was called without a hidden_states "
                                   f"tensor (positional {len(args)}, keywords {sorted(kwargs)})")
            self._states[layer_id] = hidden.detach()
        return record

    def clear(self) -> None:
        self._states = {}

    def take(self) -> CapturedLayerStates:
        missing = [lid for lid in self.layer_ids if lid not in self._states]
        if missing:
            raise CaptureError(f"layer ids {missing} were not captured in the last forward (captured: "
                               f"{sorted(self._states)})")
        out = CapturedLayerStates(self.layer_ids, tuple(self._states[lid] for lid in self.layer_ids))
        self.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._armed = False
        self.clear()
