"""docs/config.md is the reference skyrl_mtp.config.reference makes from the schema and the validation that runs."""

from __future__ import annotations

import difflib

import pytest

from skyrl_mtp.config import ConfigError, load_config
from skyrl_mtp.config.reference import (
    COMMAND,
    DOC_PATH,
    all_keys,
    field_comments,
    render,
    sections,
    validation_rules,
)


def test_docs_config_md_is_current():
    want = render()
    have = DOC_PATH.read_text() if DOC_PATH.exists() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                 "docs/config.md", "generated", n=0))[:40])
        pytest.fail(f"docs/config.md is stale: refresh it with `{COMMAND}`\n{diff}")


def test_every_key_has_a_meaning():
    missing = [k.path for k in all_keys() if not k.meaning]
    assert not missing, f"keys without a comment at their field in skyrl_mtp/config/schema.py: {missing}"


def test_every_rule_names_a_key_or_a_section_of_the_schema():
    keys = {k.path for k in all_keys()} | {s.path for s in sections()}
    assert set(validation_rules()) <= keys, sorted(set(validation_rules()) - keys)


def test_field_comments_read_above_and_after_the_field():
    source = (
        "class A:\n"
        "    x: int = 1\n"
        "    # the y\n"
        "    # in two lines\n"
        "    y: int = 2  # and after\n"
        "\n"
        "    # not z's: a blank line parts them\n"
        "\n"
        "    z: int = 3\n"
    )
    assert field_comments(source) == {("A", "x"): "", ("A", "y"): "the y in two lines and after", ("A", "z"): ""}


@pytest.mark.parametrize("override", [
    "generator.sampling.top_p=1.5",
    "trainer.mtp.loss_type=kl",
    "trainer.mtp.explore_budget=0.9",
    "trainer.mtp.loss_depth_decay=0",
    "megatron.pp=0",
    "megatron.mtp_loss_chunk_size=-1",
    "generator.pipeline_parallel_size=0",
    "generator.n_samples_per_prompt=1",
    "trainer.policy_mini_batch_size=9",
    "data.synthetic_search_relations=[capital,capital]",
    "environment.search.on_failure=ignore",
    "logger.backends=[console,tensorboard]",
])
def test_the_reference_shows_the_text_of_the_error(override):
    """A bad value's error ends with one of the texts the reference lists as allowed for that key
    (texts that name another key's value agree at the defaults, which these overrides keep)."""
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=tiny_dapo", "trainer.train_batch_size=8", override])
    (line,) = info.value.problems
    key, rest = line.split("=", 1)
    allowed = rest.split(" is invalid: ", 1)[1]
    assert allowed in validation_rules()[key]
