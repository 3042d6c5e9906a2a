"""LayerHiddenCapture on the tiny dense checkpoints (llama, qwen3) built by test_dense_families' helpers: the states it
records in the policy's forward equal transformers' ``output_hidden_states`` at the same layers (vLLM aux id L <
num_layers is ``hidden_states[L]``; id num_layers is the input of ``model.norm``, while transformers'
``hidden_states[num_layers]`` is the post-norm output), every TP rank holds the same full state at TP=2, installing
it changes no bit of the logits or gradients (with and without activation recompute), and bad layer ids, split
layouts and CUDA graphs are refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from skyrl_mtp.mtp.capture import CaptureError
from skyrl_mtp.mtp.layer_capture import LayerHiddenCapture, check_layer_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))   # the dense families' test helpers
from test_dense_families import cfg_of, megatron_rank, varied  # noqa: E402,F401 (megatron_rank: a fixture)

LAYERS = 4          # ids 0..4 each a distinct place: embedding, three layer inputs, the final norm's input
IDS = (0, 1, 2, 3, 4)
# the tolerance test_megatron_logits_equal_transformers holds Megatron's log-probs to
ATOL, RTOL = 2e-5, 1e-5


def _megatron(family: str, *, tp: int = 1, tp_rank: int = 0, recompute: bool = False):
    from skyrl_mtp.models.families import family_for_config
    from skyrl_mtp.policy.megatron.hf_bridge import hf_to_megatron, load_into_model
    from skyrl_mtp.policy.megatron.model_builder import build_gpt_model

    cfg = cfg_of(family, layers=LAYERS)
    args = family_for_config(cfg).args_from_config(cfg)
    model = build_gpt_model(args, mtp_num_layers=0, tp=tp, recompute=recompute)
    load_into_model(model, hf_to_megatron(varied(family, layers=LAYERS), args, 0, tp_rank=tp_rank, tp_size=tp))
    return model, cfg


def _ids(cfg) -> torch.Tensor:
    return torch.randint(0, cfg["vocab_size"], (3, 24), generator=torch.Generator().manual_seed(7))


def _reference_states(family: str, cfg: dict, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(transformers' output_hidden_states [B, S, H] each, the input of its final norm)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    ref.load_state_dict(varied(family, layers=LAYERS))
    seen = {}
    handle = ref.model.norm.register_forward_pre_hook(lambda m, a: seen.setdefault("prenorm", a[0]))
    with torch.no_grad():
        out = ref(input_ids=ids, output_hidden_states=True)
    handle.remove()
    return out.hidden_states, seen["prenorm"]


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_captured_states_equal_transformers_hidden_states(megatron_rank, family):  # noqa: F811
    model, cfg = _megatron(family)
    model.eval()
    ids = _ids(cfg)
    cap = LayerHiddenCapture(model, (4, 0, 2, 1, 3))   # any order in: vLLM's ascending order out
    with torch.no_grad():
        model(ids, _positions(ids), None)
    got = cap.take()
    cap.remove()
    assert got.layer_ids == IDS
    assert all(s.shape == (ids.shape[1], ids.shape[0], cfg["hidden_size"]) for s in got.states)   # [S, B, H]
    hidden, prenorm = _reference_states(family, cfg, ids)
    assert len(hidden) == LAYERS + 1
    for lid, state in zip(got.layer_ids, got.states):
        want = hidden[lid] if lid < LAYERS else prenorm
        assert float(want.std()) > 0.01, lid
        torch.testing.assert_close(state.transpose(0, 1), want, atol=ATOL, rtol=RTOL, msg=f"layer id {lid}")
    # transformers' last hidden state is the final norm's OUTPUT: not what vLLM's id num_layers collects
    assert not torch.allclose(hidden[LAYERS], prenorm, atol=1e-2)
    torch.testing.assert_close(model.decoder.final_layernorm(got.states[-1]).transpose(0, 1), hidden[LAYERS],
                               atol=ATOL, rtol=RTOL)


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, grads) of one training forward + backward of a next-token loss."""
    for p in model.parameters():
        p.grad = None
    logits = model(ids, _positions(ids), None)
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    (-lp.mean()).backward()
    return logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", [False, True])
def test_capture_changes_no_bit_of_logits_or_grads(megatron_rank, recompute):  # noqa: F811
    model, cfg = _megatron("qwen3", recompute=recompute)
    model.train()
    ids = _ids(cfg)
    logits, grads = _step(model, ids)
    cap = LayerHiddenCapture(model, IDS)
    logits_cap, grads_cap = _step(model, ids)
    assert torch.equal(logits_cap, logits)
    assert grads_cap.keys() == grads.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():
        assert torch.equal(grads_cap[name], g), name
    # the forward's states were recorded; the layers recompute re-ran in backward recorded nothing
    model.eval()
    with torch.no_grad():
        model(ids, _positions(ids), None)
    eval_states = cap.take().states
    model.train()
    _step(model, ids)
    train_states = cap.take()
    assert all(not s.requires_grad for s in train_states.states)
    for lid, a, b in zip(IDS, train_states.states, eval_states):
        assert torch.equal(a, b), lid
    loss = model(ids, _positions(ids), None).float().sum()
    cap.take()
    loss.backward()
    with pytest.raises(CaptureError, match=r"layer ids \[0, 1, 2, 3, 4\] were not captured"):
        cap.take()
    cap.remove()
    model(ids, _positions(ids), None)
    with pytest.raises(CaptureError, match="were not captured"):
        cap.take()


def _tp_rank(rank: int, port: int, family: str, out: str) -> None:
    torch.set_num_threads(1)
    from skyrl_mtp.policy.megatron.parallel_state import destroy_distributed, init_distributed

    init_distributed(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, tp=2, seed=0)
    model, cfg = _megatron(family, tp=2, tp_rank=rank)
    cap = LayerHiddenCapture(model.eval(), IDS)
    with torch.no_grad():
        model(_ids(cfg), _positions(_ids(cfg)), None)
    torch.save(cap.take().states, f"{out}.{rank}")
    destroy_distributed()


def test_every_tp_rank_holds_the_full_state(tmp_path):
    import torch.multiprocessing as mp

    from skyrl_mtp.net import free_port

    out = str(tmp_path / "states")
    mp.spawn(_tp_rank, args=(free_port(), "llama", out), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (torch.load(f"{out}.{r}") for r in (0, 1))
    cfg = cfg_of("llama", layers=LAYERS)
    hidden, prenorm = _reference_states("llama", cfg, _ids(cfg))
    for lid, a, b in zip(IDS, r0, r1):
        assert a.shape == (24, 3, cfg["hidden_size"]), lid
        assert torch.equal(a, b), lid   # replicated, not sharded: the same bits on both ranks
        torch.testing.assert_close(a.transpose(0, 1), hidden[lid] if lid < LAYERS else prenorm, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("ids, match", [
    ((2, 5), r"layer id 5 in layer_ids=\(2, 5\) is invalid; allowed: ints in 0\.\.4 "),
    ((-1, 2), r"layer id -1 in layer_ids=\(-1, 2\) is invalid; allowed: ints in 0\.\.4 "),
    ((1.0,), r"layer id 1\.0 in layer_ids=\(1\.0,\) is invalid; allowed: ints in 0\.\.4"),
    ((True, 2), r"layer id True in layer_ids=\(True, 2\) is invalid"),
    ((), r"layer_ids=\(\) is invalid; allowed: a non-empty sequence of ints in 0\.\.4"),
    (3, r"layer_ids=3 is invalid; allowed: a non-empty sequence of ints in 0\.\.4"),
    ((2, 3, 2), r"layer ids \[2\] repeat in layer_ids=\(2, 3, 2\); allowed: ints in 0\.\.4"),
])
def test_bad_layer_ids_are_refused_with_the_allowed_range(ids, match):
    with pytest.raises(ValueError, match=match):
        check_layer_ids(ids, 4)


def test_check_layer_ids_sorts_like_vllm():
    assert check_layer_ids([3, 0, 4], 4) == (0, 3, 4)
    assert check_layer_ids(range(5), 4) == IDS


def test_capture_refuses_bad_ids_and_split_states_on_a_real_model(megatron_rank):  # noqa: F811
    model, _ = _megatron("llama")
    with pytest.raises(ValueError, match=r"layer id 5 in layer_ids=\[1, 5\] is invalid; allowed: ints in 0\.\.4"):
        LayerHiddenCapture(model, [1, 5])
    for key, value, allowed in (("sequence_parallel", True, "False"), ("context_parallel_size", 2, "1"),
                                ("pipeline_model_parallel_size", 2, "1"), ("cuda_graph_impl", "local", "'none'")):
        old = getattr(model.config, key)
        setattr(model.config, key, value)
        try:
            with pytest.raises(CaptureError, match=rf"{key}={value!r} is not supported by LayerHiddenCapture; "
                                                   rf"allowed: {allowed}"):
                LayerHiddenCapture(model, [1])
        finally:
            setattr(model.config, key, old)
    with pytest.raises(CaptureError, match="needs a megatron-core GPTModel"):
        LayerHiddenCapture(model.decoder.layers[0], [0])
