"""`RLTrainer`'s own logic with fake engines, policy and environment (no Ray, vLLM or Megatron).

Covered: the dynamic-sampling fallback when no group has reward spread, truncation of the kept groups to
a multiple of megatron.dp, mini-batch slicing (one policy update per trainer.policy_mini_batch_size
prompts), the stop at a non-finite loss or grad norm (named, before the sync and the checkpoint, the last
checkpoint left as it was), resume bookkeeping (step, data position and metrics after a restart), and under
auto k the head's depths and idle cadence and the syncs that leave an untrained head out.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from skyrl_mtp.algorithms.train_batch import Rollout
from skyrl_mtp.config import load_config
from skyrl_mtp.data.datasets import PromptExample
from skyrl_mtp.envs.environments import RolloutGroup
from skyrl_mtp.errors import NonFiniteMetricError
from skyrl_mtp.tracking.tracker import Tracker, read_metrics
from skyrl_mtp.trainer.run_dir import RunDir
from skyrl_mtp.trainer.run_plan import build_run_plan
from skyrl_mtp.trainer.trainer import RLTrainer


class FakeWindow:
    """`k_shares`: the k the engines' policies chose per step, as a rollout reports it (auto k); the ks run
    (`speculation_k_share_*`, exploration included) are reported drafting on every step, which the trainer
    must not read as the engines drafting. `saved`: engine seconds the drafts saved per window (summed over
    engines)."""

    def __init__(self, k_shares=(), saved=0.0):
        self.k_shares, self.saved = list(k_shares), saved

    def start(self, label): self.label = label
    def pause(self): pass
    def resume(self): pass

    def stop(self):
        return {f"rollout/{self.label}/draft_acceptance_rate": 0.5,
                **{f"rollout/{self.label}/speculation_model_k_share_{k}": s for k, s in enumerate(self.k_shares)},
                **{f"rollout/{self.label}/speculation_k_share_{k}": float(k == 1) for k in range(len(self.k_shares))},
                **({f"rollout/{self.label}/speculation_seconds_saved": self.saved} if self.k_shares else {})}


class FakeEngines:
    def __init__(self):
        self.metrics, self.synced, self.last_sync_seconds, self.actors = FakeWindow(), 0, 0.01, []
        self.head_changed: list[bool] = []



class FakeSync:
    colocate = False

    def __init__(self, engines):
        self.engines = engines

    def sync(self, head_changed=True):
        self.engines.synced += 1
        self.engines.head_changed.append(head_changed)
        return {}


class FakePolicy:
    """Records what it is asked to train on; `losses` scripts policy/loss per update (default 0.5)."""

    def __init__(self, losses=()):
        self.losses, self.updates, self.saved, self.loaded = list(losses), [], [], []
        self.head_args: list[dict] = []

    def compute_logprobs(self, batch):
        return torch.zeros(batch["input_ids"].shape)

    def train_step(self, batch, policy_loss, policy_loss_kwargs, **head):
        self.updates.append(int(batch["input_ids"].shape[0]))
        self.head_args.append(head)
        loss = self.losses.pop(0) if self.losses else 0.5
        trained = head.get("train_head", True)
        return {"policy/loss": loss, "policy/grad_norm": 1.0, "mtp/loss": 2.0,
                **({"mtp/train_seconds": self.head_seconds} if trained else {})}

    head_seconds = 0.1   # what training the head takes per update

    def export_weights(self):
        return {}

    def save_checkpoint(self, path):
        from pathlib import Path

        (Path(path) / "weights.txt").write_text(f"update {len(self.updates)}")
        self.saved.append(path)

    def load_checkpoint(self, path):
        self.loaded.append(path)


class FakeEnv:
    """Sample i of a prompt gets reward `reward(prompt_index, i)`; responses are 2 tokens."""

    summed_metrics: tuple[str, ...] = ()
    max_metrics: tuple[str, ...] = ()

    def __init__(self, reward):
        self.reward, self.generated = reward, []

    def generate(self, examples, spec, n):
        self.generated.append([e.ground_truth for e in examples])
        return [RolloutGroup(e, [Rollout([1, 2], [3, 4], [-0.5, -0.5], "stop") for _ in range(n)])
                for e in examples], {}

    def score(self, groups):
        for g in groups:
            for i, r in enumerate(g.rollouts):
                r.reward = float(self.reward(g.example.ground_truth, i))
        return {"env/scored": float(len(groups))}


class ListTracker:
    def __init__(self):
        self.rows = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


EXAMPLES = [PromptExample([{"role": "user", "content": f"q{i}"}], i) for i in range(64)]
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)


def _trainer(tmp_path, *overrides, policy=None, env=None, tracker=None, run="run"):
    cfg = load_config(["recipe=tiny_dapo", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0", "data.shuffle=false",
                       f"trainer.run_dir={tmp_path / run}", *overrides])
    plan = build_run_plan(cfg)
    rd = RunDir(plan.loop.run_dir)
    rd.create(plan.config)
    engines = FakeEngines()
    return RLTrainer(plan.loop, engines=engines, policy=policy or FakePolicy(),
                     env=env or FakeEnv(lambda p, i: i % 2), tokenizer=TOKENIZER, train_examples=EXAMPLES,
                     val_examples=[], run_dir=rd, tracker=tracker or ListTracker(), log=lambda m: None,
                     weight_sync=FakeSync(engines))


def test_mini_batches_one_update_per_slice_of_prompts(tmp_path):
    t = _trainer(tmp_path, "trainer.train_batch_size=8", "trainer.policy_mini_batch_size=3",
                 "generator.n_samples_per_prompt=4")
    m = t.train_step()
    assert t.policy.updates == [3 * 4, 3 * 4, 2 * 4]    # 8 prompts in slices of 3, 4 samples each
    assert m["train/num_updates"] == 3 and m["train/num_sequences"] == 32
    assert t.engines.synced == 1 and m["step"] == 1


def test_dynamic_sampling_falls_back_to_all_groups_when_none_has_spread(tmp_path):
    env = FakeEnv(lambda p, i: 1.0)   # every sample right: no group has reward spread
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                 "algorithm.dynamic_sampling.max_gen_rounds=3", env=env)
    m = t.train_step()
    assert len(env.generated) == 3                       # it tried every round it was allowed
    assert m["dynamic_sampling/fallback_all"] == 1.0
    assert t.policy.updates == [4 * 8]                   # trained on the first round's groups anyway
    assert m["reward/mean"] == 1.0 and m["reward/num_samples"] == 3 * 4 * 8


def test_dynamic_sampling_keeps_only_groups_with_spread(tmp_path):
    env = FakeEnv(lambda p, i: (i % 2) if p % 2 == 0 else 0.0)   # odd prompts: all-zero groups
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null", env=env)
    m = t.train_step()
    assert len(env.generated) == 2 and "dynamic_sampling/fallback_all" not in m
    assert t.policy.updates == [4 * 8]                   # 2 + 2 groups with spread over two rounds


def test_kept_groups_are_truncated_to_a_multiple_of_dp(tmp_path):
    env = FakeEnv(lambda p, i: (i % 2) if p % 4 else 0.0)   # 3 of every 4 prompts have spread
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                 "megatron.dp=2", "trainer.placement.policy_num_workers=2",
                 "algorithm.dynamic_sampling.max_gen_rounds=1", env=env)
    t.train_step()
    assert t.policy.updates == [2 * 8]                   # 3 kept groups -> 2 (a multiple of dp=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_stops_the_step_before_sync_and_checkpoint(tmp_path, bad):
    tracker_dir = tmp_path / "metrics"
    tracker = Tracker(tracker_dir, ("jsonl",))
    policy = FakePolicy(losses=[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, bad])
    t = _trainer(tmp_path, "trainer.train_batch_size=8", "trainer.policy_mini_batch_size=4",
                 "trainer.checkpoint.every_n_steps=2", "trainer.total_steps=10", policy=policy, tracker=tracker)
    for _ in range(4):
        t.train_step()                                    # checkpoints at steps 2 and 4
    ckpt = t.run_dir.latest()
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    synced = t.engines.synced
    with pytest.raises(NonFiniteMetricError) as info:
        t.train_step()                                    # step 5, mini-batch 1: the scripted non-finite loss
    msg = str(info.value)
    assert f"policy/loss={bad}" in msg and "at step 5" in msg and "mini-batch 1 of 2" in msg
    assert str(ckpt) in msg and "was not modified" in msg
    assert t.engines.synced == synced and t.step == 4    # no weight sync, the step never completed
    assert t.run_dir.latest() == ckpt
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    tracker.close()
    last = read_metrics(tracker_dir / "metrics.jsonl")[-1]
    assert last["step"] == 5 and last["policy/loss"] == str(bad) and "policy/loss" in last["nonfinite_metrics"]


def test_resume_restores_step_and_data_position(tmp_path):
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                 "trainer.checkpoint.every_n_steps=2", "trainer.total_steps=4")
    t.fit()
    env_a = t.env
    assert t.step == 4 and [p.rsplit("_", 1)[1] for p in map(str, t.policy.saved)] == ["2", "4"]
    state = json.loads((t.run_dir.latest() / "trainer_state.json").read_text())
    assert state["step"] == 4

    # a second run in the same run_dir with a larger budget: resumes at 4, draws the batches an unbroken run would
    r = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                 "trainer.checkpoint.every_n_steps=2", "trainer.total_steps=6")
    assert r.resume_if_possible() == 4 and r.step == 4
    assert r.policy.loaded == [str(r.run_dir.latest())]
    r.fit()
    assert r.step == 6
    unbroken = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                        "trainer.total_steps=6", run="unbroken")
    unbroken.fit()
    assert r.env.generated == unbroken.env.generated[len(env_a.generated):]


def test_resume_never_starts_fresh(tmp_path):
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                 "trainer.checkpoint.every_n_steps=1", "trainer.total_steps=1")
    # configured while the run dir is still empty: validation refuses resume=never on a dir that holds a run
    r = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null",
                 "trainer.resume=never")
    t.fit()
    assert r.resume_if_possible() == 0 and r.step == 0 and r.policy.loaded == []


def _clocked(t, generate_seconds=1.0, head_seconds=0.5, push_seconds=0.0):
    """The trainer's step timer on a fake clock: a rollout takes `generate_seconds`, training the head
    `head_seconds` per update, pushing a changed head to the engines `push_seconds`, the rest no time, so
    the idle head's allowance is exact."""
    now = [0.0]
    t.clock = lambda: now[0]
    t.policy.head_seconds = head_seconds
    generate, train_step, sync = t.env.generate, t.policy.train_step, t.weight_sync.sync

    def timed_sync(head_changed=True):
        row = sync(head_changed=head_changed)
        if head_changed:
            now[0] += push_seconds
            row = {**row, "sync/draft_seconds": push_seconds}
        return row

    t.weight_sync.sync = timed_sync

    def timed_generate(*a, **k):
        now[0] += generate_seconds
        return generate(*a, **k)

    def timed_train_step(*a, **k):
        row = train_step(*a, **k)
        now[0] += row.get("mtp/train_seconds", 0.0)
        return row

    t.env.generate, t.policy.train_step = timed_generate, timed_train_step
    return t


@pytest.mark.parametrize("shares,saved,trained,depths", [
    # drafting saves nothing: the allowance (1/8 of each 1 s step) first banks something at step 1, so step 2
    # trains (its cost unknown); then the 0.5 s the head took needs 4 steps' allowance: step 6; depth 1
    ((0.95, 0.05, 0.0, 0.0), 0.0, [False, True, False, False, False, True], 1),
    # drafting k=2 saves more than the head's training takes (0.5 s): every step, one depth deeper
    ((0.5, 0.0, 0.5, 0.0), 0.75, [True] * 6, 3),
    # it saves 0.25 s a step: the first saving trains it (its cost unknown), then whenever savings and the
    # allowance (0.125 s a step) since cover 0.5 s
    ((0.5, 0.0, 0.5, 0.0), 0.25, [True, False, True, True, True, False], 3),
])
def test_auto_k_trains_the_head_on_the_depths_and_steps_the_engines_need(tmp_path, shares, saved, trained, depths):
    t = _clocked(_trainer(tmp_path, "trainer.mtp.num_speculative_tokens=auto",
                          "trainer.mtp.idle_head_train_budget=0.125", "trainer.train_batch_size=4",
                          "trainer.policy_mini_batch_size=null"))
    t.engines.metrics = FakeWindow(shares, saved)
    rows = [t.train_step() for _ in range(6)]
    assert [a["train_head"] for a in t.policy.head_args] == trained
    assert {a["head_depths"] for a in t.policy.head_args} == {depths}
    assert [r["train/head_trained"] for r in rows] == [float(x) for x in trained]
    assert [r.get("train/head_seconds") for r in rows] == [0.5 if x else None for x in trained]
    assert t.engines.head_changed == trained     # a step that left the head as it was does not push it


def test_an_idle_head_costs_the_budgeted_share_of_the_run(tmp_path):
    # drafting saves nothing; steps take 1 s, plus the head's 0.25 s when it trains: at a budget of 1/16 it
    # trains on every 4th step after the first, 1/16 of the time spent on everything else
    t = _clocked(_trainer(tmp_path, "trainer.mtp.num_speculative_tokens=auto",
                          "trainer.mtp.idle_head_train_budget=0.0625", "trainer.train_batch_size=4",
                          "trainer.policy_mini_batch_size=null"), head_seconds=0.25)
    t.engines.metrics = FakeWindow((1.0, 0.0, 0.0, 0.0), 0.0)
    rows = [t.train_step() for _ in range(22)]
    steps = [i + 1 for i, r in enumerate(rows) if r["train/head_trained"]]
    assert steps == [2, 6, 10, 14, 18, 22], steps
    head = sum(r.get("train/head_seconds", 0.0) for r in rows[2:])   # steps 3-22: five whole cycles
    assert head / (sum(r["timing/step_s"] for r in rows[2:]) - head) == pytest.approx(0.0625)


def test_an_idle_heads_budget_counts_pushing_it_to_the_engines(tmp_path):
    # as above, but the head's 0.25 s is 0.15 s of training and 0.1 s of pushing it after: the same cadence,
    # and both together are 1/16 of the time spent on everything else
    t = _clocked(_trainer(tmp_path, "trainer.mtp.num_speculative_tokens=auto",
                          "trainer.mtp.idle_head_train_budget=0.0625", "trainer.train_batch_size=4",
                          "trainer.policy_mini_batch_size=null"), head_seconds=0.15, push_seconds=0.1)
    t.engines.metrics = FakeWindow((1.0, 0.0, 0.0, 0.0), 0.0)
    rows = [t.train_step() for _ in range(22)]
    steps = [i + 1 for i, r in enumerate(rows) if r["train/head_trained"]]
    assert steps == [2, 6, 10, 14, 18, 22], steps
    assert [r.get("train/head_cost_s") for r in rows[:6]] == [None, pytest.approx(0.25), None, None, None,
                                                              pytest.approx(0.25)]
    head = sum(r.get("train/head_cost_s", 0.0) for r in rows[2:])
    assert head / (sum(r["timing/step_s"] for r in rows[2:]) - head) == pytest.approx(0.0625)


def test_a_resumed_run_trains_the_head_on_the_steps_an_unbroken_one_does(tmp_path):
    args = ("trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.idle_head_train_budget=0.125",
            "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null", "trainer.checkpoint.every_n_steps=3")
    t = _clocked(_trainer(tmp_path, *args, "trainer.total_steps=3"))
    t.engines.metrics = FakeWindow((0.5, 0.0, 0.5, 0.0), 0.25)
    t.fit()
    state = json.loads((t.run_dir.latest() / "trainer_state.json").read_text())
    assert state["head_credit"] == {"credit": pytest.approx(0.375), "head_seconds": pytest.approx(0.5)}
    r = _clocked(_trainer(tmp_path, *args, "trainer.total_steps=6"))
    r.engines.metrics = FakeWindow((0.5, 0.0, 0.5, 0.0), 0.25)
    assert r.resume_if_possible() == 3
    r.fit()
    # as in the unbroken run above: a fresh credit (its cost unknown) would train on step 4's saving, spend it
    # all, and skip step 5
    assert [a["train_head"] for a in t.policy.head_args + r.policy.head_args] == [True, False, True, True, True, False]


def test_fixed_k_trains_and_pushes_the_head_every_step(tmp_path):
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=null")
    t.engines.metrics = FakeWindow((0.95, 0.05, 0.0))
    for _ in range(3):
        t.train_step()
    assert t.policy.head_args == [{}] * 3 and t.engines.head_changed == [True] * 3


def test_the_step_logs_what_training_the_head_took_over_all_its_mini_batches(tmp_path):
    # fixed k: the head trains on every update; the per-update mean (mtp/train_seconds) is not the step's cost
    t = _trainer(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=2")
    row = t.train_step()
    assert row["train/num_updates"] == 2.0
    assert row["mtp/train_seconds"] == pytest.approx(0.1) and row["train/head_seconds"] == pytest.approx(0.2)
