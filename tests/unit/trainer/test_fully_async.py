"""trainer.async_rl.mode=fully_async with fake engines, policy and environment (no Ray, vLLM or Megatron).

The fake engines label every token with the weight version that sampled it (as vLLM's weight-version spans do) and
refuse a weight change under a running generation unless they are paused. A batch started one version behind the
policy that will train it does not finish until a sync has happened under it, so with max_staleness=1 every sync but
the last is an in-flight update; with max_staleness=0 the run is sync's, step for step.
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
from skyrl_mtp.rollout.sampling import token_versions, version_spans
from skyrl_mtp.rollout.spec_metrics import SpecCounters
from skyrl_mtp.trainer.rollout_producer import GeneratedBatch, RolloutProducer, load_pending, staleness
from skyrl_mtp.trainer.run_dir import RunDir
from skyrl_mtp.trainer.run_plan import build_run_plan
from skyrl_mtp.trainer.trainer import RLTrainer

WAIT_S = 10.0


def _r(n, spans=None):
    r = Rollout([1], list(range(n)), [-0.1] * n, "stop")
    if spans is not None:
        r.info["weight_versions"] = spans
    return r


def test_staleness_weights_each_token_by_the_version_that_sampled_it():
    rollouts = [_r(4, [(2, 0, 1), (3, 1, 4)]), _r(2), _r(0)]   # the 2-token one is wholly on the start version 2
    mean, worst, newer = staleness(rollouts, trained_version=3, start_version=2)
    assert (mean, worst, newer) == pytest.approx(((1 * 1 + 0 * 3 + 1 * 2) / 6, 1.0, 3 / 6))
    assert staleness([_r(3)], 5, 5) == (0.0, 0.0, 0.0)


def test_staleness_counts_the_trained_tokens_only():
    r = _r(4, [(1, 0, 2), (3, 2, 4)])
    r.response_loss_mask = [1, 0, 0, 1]   # a multi-turn rollout: tool tokens in the middle
    assert staleness([r], trained_version=3, start_version=1) == (1.0, 2.0, 0.5)


def test_token_versions_and_spans_are_inverse():
    spans = [(2, 0, 3), (3, 3, 4), (2, 4, 6)]
    assert token_versions(spans, 6) == [2, 2, 2, 3, 2, 2] and version_spans(token_versions(spans, 6)) == spans
    assert token_versions(None, 5) is None and version_spans([]) == []
    with pytest.raises(ValueError, match="cover 6 tokens, the output has 7"):
        token_versions(spans, 7)


@pytest.mark.parametrize("spans,words", [([(1, 0, 2)], "do not cover"), ([(1, 0, 1), (2, 2, 3)], "do not cover"),
                                         ([(4, 0, 3)], "newer than the policy")])
def test_staleness_refuses_spans_that_cannot_be(spans, words):
    with pytest.raises(ValueError, match=words):
        staleness([_r(3, spans)], trained_version=3, start_version=1)


def test_the_producer_starts_a_batch_only_within_the_staleness_bound_and_hands_them_out_in_order():
    started = []
    gate = threading.Event()

    def gen(index, version):
        started.append((index, version))
        if index == 2:
            gate.wait(WAIT_S)
        return GeneratedBatch(index + 1, version, [], {})

    p = RolloutProducer(gen, next_index=0, stop_index=4, version=0, max_staleness=1)
    p.start()
    assert [p.take().step, p.take().step] == [1, 2]       # index 0 and 1 start on version 0 (1 - 0 <= 1)
    assert started == [(0, 0), (1, 0)]                    # index 2 waits for version 1
    with p.held():
        p.set_version(1)
        assert started == [(0, 0), (1, 0)]                # held: nothing starts
    gate.set()
    assert p.take().step == 3 and started[2] == (2, 1)
    p.set_version(2)
    assert p.take().step == 4
    p.close()
    assert started == [(0, 0), (1, 0), (2, 1), (3, 2)]


def test_the_producers_error_is_raised_to_the_trainer():
    def gen(index, version):
        raise RuntimeError("engine 0 died")

    p = RolloutProducer(gen, next_index=0, stop_index=2, version=0, max_staleness=1)
    p.start()
    with pytest.raises(RuntimeError, match="engine 0 died"):
        p.take()
    p.close()


class Window:
    def start(self, label): self.label = label
    def pause(self): pass
    def resume(self): pass
    def stop(self): return {}


class World:
    """Engines (labelled weights, pause/resume, counters), policy and environment sharing one record."""

    summed_metrics: tuple[str, ...] = ()
    max_metrics: tuple[str, ...] = ()
    colocate = False

    def __init__(self, start_version=0):
        self.cond = threading.Condition()
        self.version = start_version          # what the engines hold
        self.label: int | None = None          # the engines' weight label
        self.policy_version = start_version
        self.paused = False
        self.stopping = False                  # a generation waiting for a sync gives up (the run stops)
        self.in_flight = 0
        self.syncs_under_requests = 0
        self.generated: list[dict] = []
        self.trained: list[int] = []
        self.drafted = 0.0
        self.metrics = Window()
        self.actors: list = []

    # ---- engines
    def generate(self, examples, spec, n):
        with self.cond:
            self.in_flight += 1
            start = self.label if self.label is not None else self.version   # sync mode labels nothing
            record = {"version": start, "prompts": [e.ground_truth for e in examples], "seed": spec.seed}
            self.generated.append(record)
            self.drafted += 10.0
            self.cond.notify_all()
            # a batch started behind the policy that will train it finishes only after a sync under it
            behind = len(self.generated) - 1 > start
            if behind:
                assert self.cond.wait_for(lambda: self.label != start or self.stopping, timeout=WAIT_S), \
                    "no sync under the batch"
            end = self.label if self.label is not None else self.version
        spans = [(start, 0, 1), (end, 1, 2)] if end != start else [(start, 0, 2)]
        groups = []
        for e in examples:
            rs = [Rollout([1, 2], [3, 4], [-0.5, -0.25], "stop", info={"weight_versions": spans}) for _ in range(n)]
            groups.append(RolloutGroup(e, rs))
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()
        return groups, {}

    def pause_generation(self):
        with self.cond:
            self.paused = True

    def resume_generation(self, version):
        with self.cond:
            self.label, self.paused = version, False
            self.cond.notify_all()

    def per_engine_counters(self):
        with self.cond:
            return [SpecCounters(num_drafts=self.drafted / 2, num_draft_tokens=self.drafted,
                                 num_accepted_tokens=self.drafted / 2)]

    def score(self, groups):
        for g in groups:
            for i, r in enumerate(g.rollouts):
                r.reward = float(i % 2)
        return {}

    # ---- policy
    def compute_logprobs(self, batch):
        return torch.full(batch["input_ids"].shape, -0.5)

    def train_step(self, batch, policy_loss, policy_loss_kwargs, **head):
        with self.cond:
            self.trained.append(self.policy_version)
            self.policy_version += 1
        return {"policy/loss": 0.5, "policy/grad_norm": 1.0}

    def save_checkpoint(self, path):
        (Path(path) / "version.txt").write_text(str(self.policy_version))

    def load_checkpoint(self, path):
        self.policy_version = int((Path(path) / "version.txt").read_text())

    # ---- weight sync
    def sync(self, head_changed=True):
        with self.cond:
            assert self.paused or self.in_flight == 0, "weights changed under a running, unpaused generation"
            self.syncs_under_requests += self.in_flight > 0
            self.version = self.policy_version
        return {}


EXAMPLES = [PromptExample([{"role": "user", "content": f"q{i}"}], i) for i in range(64)]
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)


def _trainer(tmp_path, *overrides, world=None, run="run"):
    cfg = load_config(["recipe=tiny_dapo", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0",
                       "data.shuffle=false", "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=null",
                       "algorithm.dynamic_sampling.max_gen_rounds=1", f"trainer.run_dir={tmp_path / run}",
                       "trainer.total_steps=4", *overrides])
    plan = build_run_plan(cfg)
    rd = RunDir(plan.loop.run_dir)
    rd.create(plan.config)
    w = world or World()
    rows: list = []
    tracker = SimpleNamespace(log=lambda m, step: rows.append(dict(m)))
    t = RLTrainer(plan.loop, engines=w, policy=w, env=w, tokenizer=TOKENIZER, train_examples=EXAMPLES,
                  val_examples=[], run_dir=rd, tracker=tracker, log=lambda m: None, weight_sync=w)
    return t, w, rows


def test_max_staleness_0_runs_syncs_schedule(tmp_path):
    t_s, sync, rows_s = _trainer(tmp_path, run="sync")
    t_s.fit()
    t_f, fully, rows_f = _trainer(tmp_path, "trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=0",
                                  run="fully")
    t_f.fit()
    assert [(g["prompts"], g["seed"]) for g in fully.generated] == [(g["prompts"], g["seed"]) for g in sync.generated]
    assert [g["version"] for g in fully.generated] == [0, 1, 2, 3]
    assert fully.syncs_under_requests == 0
    assert [r["async/staleness_max"] for r in rows_f] == [0.0] * 4
    assert [r["async/sync_under_requests"] for r in rows_f] == [0.0] * 4


def test_max_staleness_1_syncs_under_the_running_batch_and_labels_each_token(tmp_path):
    t, w, rows = _trainer(tmp_path, "trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=1")
    t.fit()
    assert [g["version"] for g in w.generated] == [0, 0, 1, 2]     # each batch starts one version behind
    assert w.syncs_under_requests == 3                             # the last step's sync has nothing under it
    assert [r["async/sync_under_requests"] for r in rows] == [1.0, 1.0, 1.0, 0.0]
    # batch 2..4: first token on the old version (staleness 1), second on the new one (0)
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 0.5, 0.5, 0.5]
    assert [r["async/tokens_after_update_frac"] for r in rows] == [0.0, 0.5, 0.5, 0.5]
    assert w.trained == [0, 1, 2, 3] and w.label == 4
    # one acceptance window per weight version, closed at the sync that replaces it; together they hold every draft
    assert [r["async/version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert sum(r["async/version_num_draft_tokens"] for r in rows) == w.drafted
    assert all(r["async/version_draft_acceptance_rate"] == 0.5 for r in rows if r["async/version_num_draft_tokens"])


def test_a_checkpoint_holds_the_batches_generated_ahead_and_a_resume_trains_them_first(tmp_path):
    args = ("trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=1",
            "trainer.checkpoint.every_n_steps=2")
    unbroken, wu, _ = _trainer(tmp_path, *args, run="unbroken")
    unbroken.fit()
    first, w1, _ = _trainer(tmp_path, *args)
    first.train_step()
    first.train_step()                     # checkpoint at step 2, with batch 3 (started on v1) generated
    with w1.cond:
        w1.stopping = True
        w1.cond.notify_all()
    first.producer.close()
    ckpt = first.run_dir.latest()
    [held] = load_pending(ckpt)
    assert ckpt.name == "step_2" and (held.step, held.version) == (3, 1)

    w2 = World(start_version=2)           # fresh engines, synced with the checkpoint's weights on resume
    resumed, _, _ = _trainer(tmp_path, *args, world=w2)
    assert resumed.resume_if_possible() == 2
    resumed.fit()
    assert [g["prompts"] for g in w1.generated[:3] + w2.generated] == [g["prompts"] for g in wu.generated]
    assert [g["version"] for g in w2.generated] == [2]                  # batch 4 only: batch 3 was held
    assert w2.trained == [2, 3] and load_pending(resumed.run_dir.latest()) == []
