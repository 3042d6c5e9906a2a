"""trainer.mtp.loss_depth_decay: depth d's draft loss weighs decay ** (d - 1), in the loss and its normaliser."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.mtp.draft_head import DraftLossSpec, depth_weights, draft_normaliser, draft_positions


def test_depth_weights_decay_geometrically_and_one_is_every_depth_alike():
    assert depth_weights(3, 1.0) == [1.0, 1.0, 1.0]
    assert depth_weights(3, 0.5) == [1.0, 0.5, 0.25]
    assert depth_weights(1, 0.2) == [1.0]          # the depth-1 loss is the same whatever the decay


def test_normaliser_counts_each_depths_positions_at_its_weight():
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 20)
    mask[0, 1:] = 1.0        # from the second token on: depth d reaches token d + 1 at the earliest
    mask[1, 8:18] = 1.0
    counts = [draft_positions(mask, d, None, ids)[0].numel() for d in (1, 2, 3)]
    assert counts[0] > counts[1] > counts[2] > 0     # a deeper draft has fewer positions
    assert draft_normaliser(mask, None, ids, DraftLossSpec(num_depths=3)) == sum(counts)
    assert draft_normaliser(mask, None, ids, DraftLossSpec(num_depths=3, depth_decay=0.5)) == pytest.approx(
        counts[0] + 0.5 * counts[1] + 0.25 * counts[2])
    thinned = DraftLossSpec(num_depths=2, depth_decay=0.5, position_fraction=0.5)
    sub = [draft_positions(mask, d, None, ids, 0.5)[0].numel() for d in (1, 2)]
    assert draft_normaliser(mask, None, ids, thinned) == pytest.approx(sub[0] + 0.5 * sub[1])


@pytest.mark.parametrize("value", [0, 1.5, -0.5])
def test_bad_decay_is_rejected_naming_the_key(value):
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.errors import ConfigError
    from skyrl_mtp.policy.config import PolicyConfigError, PolicyWorkerConfig

    with pytest.raises(ConfigError, match=rf"trainer\.mtp\.loss_depth_decay={value}.*\(0, 1\]"):
        load_config(["recipe=tiny_dapo", f"trainer.mtp.loss_depth_decay={value}"])
    with pytest.raises(PolicyConfigError, match="mtp_loss_depth_decay"):
        PolicyWorkerConfig(mtp_loss_depth_decay=value)
