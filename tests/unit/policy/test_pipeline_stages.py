"""Which stage holds and owns each parameter under pipeline parallelism (pure name arithmetic)."""

import pytest

from skyrl_mtp.policy.megatron.pipeline_stages import (
    EMBEDDING,
    StageLayout,
    StageLayoutError,
    owned_rules,
    single_stage,
    stage_rules,
)

GLOBAL = [EMBEDDING, *(f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(4)), "decoder.final_layernorm.weight",
          "mtp.layers.0.eh_proj.weight", "output_layer.weight"]


def _stages(pp=2, mtp=True):
    per = 4 // pp
    return [StageLayout(r, pp, r * per, per, per, mtp and r == pp - 1) for r in range(pp)]


def test_each_stage_holds_its_layers_under_local_names_and_the_last_the_rest():
    first, last = _stages()
    assert {n: first.local_name(n) for n in GLOBAL if first.local_name(n)} == {
        EMBEDDING: EMBEDDING, "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc1.weight": "decoder.layers.1.mlp.linear_fc1.weight"}
    assert {n: last.local_name(n) for n in GLOBAL if last.local_name(n)} == {
        EMBEDDING: EMBEDDING,   # the MTP block's copy
        "decoder.layers.2.mlp.linear_fc1.weight": "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.3.mlp.linear_fc1.weight": "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
        "mtp.layers.0.eh_proj.weight": "mtp.layers.0.eh_proj.weight", "output_layer.weight": "output_layer.weight"}
    assert last.embedding_is_copy and not first.embedding_is_copy


def test_every_parameter_has_one_owner_the_copy_is_not_one():
    first, last = _stages()
    assert [first.owner(n) for n in GLOBAL] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert owned_rules({n: None for n in GLOBAL}, last)[EMBEDDING] == (0, None)
    assert owned_rules({n: None for n in GLOBAL}, last)["decoder.layers.3.mlp.linear_fc1.weight"] == (
        1, "decoder.layers.1.mlp.linear_fc1.weight")
    with pytest.raises(StageLayoutError, match="no pipeline stage known"):
        first.owner("vision.patch_embed.weight")


def test_without_mtp_the_last_stage_has_no_embedding_and_one_stage_has_everything():
    _, last = _stages(mtp=False)
    assert last.local_name(EMBEDDING) is None and not last.embedding_is_copy
    one = single_stage(4, True)
    rules = {n: n for n in GLOBAL}
    assert stage_rules(rules, one) == rules
    assert all(owner == 0 and local == n for n, (owner, local) in owned_rules(rules, one).items())
