"""The tiny SearchR1 recipe end to end on CPU: a real local BM25 retriever over HTTP, multi-turn rollouts
with MTP speculative decoding in every turn, warm start with tool tokens masked, two RL steps."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_tiny_searchr1_runs_and_logs_reward_and_acceptance(tmp_path, cli):
    run = tmp_path / "s"
    proc = cli(["recipe=tiny_searchr1", f"trainer.run_dir={run}", "trainer.total_steps=2",
                "trainer.eval_every_n_steps=0", "trainer.checkpoint.every_n_steps=0", "trainer.train_batch_size=4",
                "trainer.policy_mini_batch_size=2", "trainer.progress_bar=false",
                "algorithm.dynamic_sampling.max_gen_rounds=1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "retriever: serving" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward/mean", "reward/exact_match", "reward/f1", "rollout/train/draft_acceptance_rate",
                    "rollout/train/draft_acceptance_rate_pos_1", "rollout/train/mean_acceptance_length",
                    "policy/loss", "mtp/loss", "multi_turn/num_searches_mean", "multi_turn/tool_tokens_mean"):
            assert key in r, key
        # the warm-started policy searches, so the engines drafted across more than one turn per trajectory
        assert r["multi_turn/num_searches_mean"] > 0.5
        assert r["multi_turn/num_turns_mean"] > 1.0
        assert r["rollout/train/num_drafts"] > 0
        # the tool's tokens are not trained on: fewer draft-loss tokens than response tokens
        assert r["mtp/num_tokens"] < r["train/num_sequences"] * r["rollout/response_length_mean"]
