"""trainer.async_rl.mode=one_step_off with fake engines, policy and environment (no Ray, vLLM or Megatron).

The fakes carry a policy version: the policy counts its updates, a sync copies its version to the engines, and
each generation records the version it ran on. Covered: the next batch is generated while the current step
trains (the fake generation cannot finish before that training has started), never across a sync; staleness
exactly 1 after the first step; the same prompts and seeds as a sync run; a resumed run trains the batches an
unbroken run trains (the checkpoint holds the prefetched batch); a failed step leaves no generation running; the
engine's logprobs reach the loss as behaviour logprobs only with an off-policy correction.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from skyrl_mtp.algorithms.train_batch import Rollout
from skyrl_mtp.config import load_config
from skyrl_mtp.data.datasets import PromptExample
from skyrl_mtp.envs.environments import RolloutGroup
from skyrl_mtp.errors import NonFiniteMetricError
from skyrl_mtp.trainer.rollout_producer import PENDING_FILE, load_pending
from skyrl_mtp.trainer.run_dir import RunDir
from skyrl_mtp.trainer.run_plan import build_run_plan
from skyrl_mtp.trainer.trainer import RLTrainer

WAIT_S = 10.0   # a generation that overlaps nothing waits this long for a training that never starts, then fails


class Window:
    def start(self, label): self.label = label
    def pause(self): pass
    def resume(self): pass
    def stop(self): return {f"rollout/{self.label}/draft_acceptance_rate": 0.5}


class World:
    """Engines, policy and environment sharing one record of what happened. A background generation (any but
    the first, off the main thread) can only finish while an update is in progress, and that update waits for
    it: a loop that did not overlap them would fail here after WAIT_S."""

    summed_metrics: tuple[str, ...] = ()
    max_metrics: tuple[str, ...] = ()
    colocate = False

    def __init__(self, total_steps, prefetching=True, start_version=0, losses=()):
        self.cond = threading.Condition()
        self.total_steps, self.prefetching = total_steps, prefetching
        self.background_started = self.background_seen = 0
        self.version = start_version          # policy updates applied to the weights the engines hold
        self.policy_version = start_version   # policy updates applied to the policy's weights
        self.training = False
        self.stopping = False                 # the run stops: a generation waiting for a training gives up
        self.in_flight = 0
        self.generated: list[dict] = []       # per generation: version, prompts, seed, overlapped
        self.trained: list[dict] = []         # per update: the policy's version, the batch's keys
        self.events: list[str] = []
        self.losses = list(losses)
        self.metrics = Window()
        self.actors: list = []

    # ---- engines / environment
    def generate(self, examples, spec, n):
        # a run's very first batch has nothing to overlap (the policy has nothing to train yet)
        background = self.prefetching and (bool(self.generated) or self.policy_version > 0)
        with self.cond:
            self.in_flight += 1
            record = {"version": self.version, "prompts": [e.ground_truth for e in examples], "seed": spec.seed,
                      "overlapped": False}
            self.generated.append(record)
            self.events.append(f"generate {len(self.generated)} on v{self.version}")
            self.cond.notify_all()
            if background:
                self.background_started += 1
                self.cond.notify_all()
                record["overlapped"] = self.cond.wait_for(lambda: self.training or self.stopping, timeout=WAIT_S)
        index = len(self.generated) - 1
        lp = [-0.5 - 0.01 * index, -0.25]
        groups = [RolloutGroup(e, [Rollout([1, 2], [3, 4], list(lp), "stop") for _ in range(n)]) for e in examples]
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()
        return groups, {}

    def score(self, groups):
        for g in groups:
            for i, r in enumerate(g.rollouts):
                r.reward = float(i % 2)
        return {}

    def close(self):
        pass

    # ---- policy
    def compute_logprobs(self, batch):
        return torch.full(batch["input_ids"].shape, -0.5)

    def train_step(self, batch, policy_loss, policy_loss_kwargs, **head):
        with self.cond:
            self.training = True
            self.cond.notify_all()
            prefetched = self.prefetching and self.policy_version + 1 < self.total_steps   # its prefetch runs beside it
            if prefetched:   # the events name the update after the generation it overlaps has started
                self.cond.wait_for(lambda: self.background_started > self.background_seen, timeout=WAIT_S)
            self.events.append(f"train on v{self.policy_version}")
            if prefetched:
                self.cond.wait_for(lambda: self.in_flight == 0, timeout=WAIT_S)
                self.background_seen += 1
            self.trained.append({"version": self.policy_version, "keys": sorted(batch),
                                 "behaviour": batch.get("behaviour_logprobs")})
            self.policy_version += 1
            self.training = False
        loss = self.losses.pop(0) if self.losses else 0.5
        return {"policy/loss": loss, "policy/grad_norm": 1.0}

    def save_checkpoint(self, path):
        (Path(path) / "version.txt").write_text(str(self.policy_version))

    def load_checkpoint(self, path):
        self.policy_version = int((Path(path) / "version.txt").read_text())

    # ---- weight sync
    def sync(self, head_changed=True):
        with self.cond:
            assert self.in_flight == 0, "weights changed under a running generation"
            self.version = self.policy_version
            self.events.append(f"sync v{self.version}")
        return {}


EXAMPLES = [PromptExample([{"role": "user", "content": f"q{i}"}], i) for i in range(64)]
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)


def _trainer(tmp_path, *overrides, world=None, run="run"):
    cfg = load_config(["recipe=tiny_dapo", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0",
                       "data.shuffle=false", "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=null",
                       "algorithm.dynamic_sampling.max_gen_rounds=1", f"trainer.run_dir={tmp_path / run}", *overrides])
    plan = build_run_plan(cfg)
    rd = RunDir(plan.loop.run_dir)
    rd.create(plan.config)
    w = world or World(plan.loop.total_steps, plan.loop.async_mode == "one_step_off")
    rows: list = []
    tracker = SimpleNamespace(log=lambda m, step: rows.append((step, dict(m))))
    t = RLTrainer(plan.loop, engines=w, policy=w, env=w, tokenizer=TOKENIZER, train_examples=EXAMPLES,
                  val_examples=[], run_dir=rd, tracker=tracker, log=lambda m: None, weight_sync=w)
    return t, w


def test_the_next_batch_is_generated_with_the_previous_weights_while_the_step_trains(tmp_path):
    t, w = _trainer(tmp_path, "trainer.async_rl.mode=one_step_off", "trainer.total_steps=4")
    rows = t.fit()
    # batch 1 on the initial weights before step 1; batch k+1 during step k, on the weights synced before it
    assert [g["version"] for g in w.generated] == [0, 0, 1, 2]
    assert [g["overlapped"] for g in w.generated] == [False, True, True, True]
    assert [u["version"] for u in w.trained] == [0, 1, 2, 3]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert w.events[:5] == ["generate 1 on v0", "generate 2 on v0", "train on v0", "sync v1", "generate 3 on v1"]
    # every batch is generated by the producer thread: the steps report its phases and their own waits for it
    for r in rows:
        assert r["timing/wait_rollout_s"] >= 0 and r["timing/background/generate_s"] > 0
        assert "timing/generate_s" not in r
        assert 0 <= r["timing/engines_idle_s"] <= r["timing/step_s"]
    assert not t.producer.generating


def test_same_prompts_and_seeds_as_a_sync_run(tmp_path):
    t_off, off = _trainer(tmp_path, "trainer.async_rl.mode=one_step_off", "trainer.total_steps=4", run="off")
    t_off.fit()
    t_sync, sync = _trainer(tmp_path, "trainer.total_steps=4", run="sync")
    rows = t_sync.fit()
    strip = [{k: g[k] for k in ("prompts", "seed")} for g in off.generated]
    assert strip == [{k: g[k] for k in ("prompts", "seed")} for g in sync.generated]
    assert [g["version"] for g in sync.generated] == [0, 1, 2, 3]   # sync: always on-policy
    assert not any(k.startswith("async/") for r in rows for k in r)


def test_a_resumed_run_trains_what_an_unbroken_run_trains(tmp_path):
    args = ("trainer.async_rl.mode=one_step_off", "trainer.checkpoint.every_n_steps=2", "trainer.total_steps=4")
    unbroken, wu = _trainer(tmp_path, *args, run="unbroken")
    rows_u = unbroken.fit()

    first, w1 = _trainer(tmp_path, *args)
    first.train_step()
    first.train_step()                        # checkpoint at step 2 with batch 3, generated on v1
    with w1.cond:
        w1.stopping = True
        w1.cond.notify_all()
    first.producer.close()
    ckpt = first.run_dir.latest()
    assert ckpt.name == "step_2" and (ckpt / PENDING_FILE).exists()
    [held] = load_pending(ckpt)
    assert (held.step, held.version) == (3, 1)

    w2 = World(4, start_version=2)               # fresh engines, synced with the checkpoint's weights on resume
    resumed, _ = _trainer(tmp_path, *args, world=w2)
    assert resumed.resume_if_possible() == 2 and w2.policy_version == 2
    rows_r = resumed.fit()
    assert [g["prompts"] for g in w1.generated[:3] + w2.generated] == [g["prompts"] for g in wu.generated]
    assert [g["version"] for g in w2.generated] == [2]                        # batch 4 only: batch 3 was held
    assert [r["async/staleness_max"] for r in rows_r] == [r["async/staleness_max"] for r in rows_u[2:]] == [1.0, 1.0]
    assert not (resumed.run_dir.latest() / PENDING_FILE).exists()            # the last step prefetches nothing


def test_a_failed_step_leaves_no_generation_running_and_no_sync(tmp_path):
    w = World(4, losses=[0.5, float("nan")])
    t, _ = _trainer(tmp_path, "trainer.async_rl.mode=one_step_off", "trainer.total_steps=4", world=w)
    t.train_step()
    with pytest.raises(NonFiniteMetricError):
        t.train_step()
    assert w.in_flight == 0 and not t.producer.generating and w.version == 1 and t.step == 1


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
def test_behaviour_logprobs_reach_the_loss_with_a_correction_only(tmp_path, correction):
    t, w = _trainer(tmp_path, "trainer.async_rl.mode=one_step_off", "trainer.total_steps=2",
                    f"algorithm.off_policy.correction={correction}")
    t.fit()
    for i, u in enumerate(w.trained):
        if correction == "none":
            assert "behaviour_logprobs" not in u["keys"]
            continue
        b = u["behaviour"]                    # the engine's logprobs of batch i + 1, at the response tokens
        assert b[:, 2].eq(-0.5 - 0.01 * i).all() and b[:, 3].eq(-0.25).all() and b[:, :2].eq(0).all()
    assert t.loss_kwargs.get("off_policy_correction", "none") == correction
