"""The RL step loop: generate -> reward -> dynamic sampling -> GRPO -> DAPO + draft loss -> sync -> log -> checkpoint.

In the async modes a producer thread (rollout_producer.py) generates the coming steps' batches while the policy
trains: one_step_off keeps it one version ahead and waits for its running batch before the sync (no weight changes
under a running request); fully_async lets it run max_staleness versions ahead and syncs under its running
requests, the engines paused.

`RLTrainer` owns the engines (an `EngineClient`), the policy (a `PolicyGroup` of Megatron
workers), an `Environment`, the run directory and the tracker. Everything it computes itself
is delegated to pure functions (advantages, overlong shaping, dynamic sampling, batch building)
so that this file reads as the loop of docs/design.md and nothing else.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from skyrl_mtp.algorithms.advantages import grpo_advantages
from skyrl_mtp.algorithms.dynamic_sampling import GroupAccumulator
from skyrl_mtp.algorithms.overlong import overlong_filter_mask, soft_overlong_penalty
from skyrl_mtp.algorithms.train_batch import build_train_batch
from skyrl_mtp.data.datasets import PromptBatchIterator, PromptExample
from skyrl_mtp.envs.environments import Environment, RolloutGroup
from skyrl_mtp.errors import EngineDiedError, NonFiniteMetricError
from skyrl_mtp.mtp.draft_depths import HeadTrainingCredit, depths_to_train
from skyrl_mtp.rollout.sampling import SamplingSpec
from skyrl_mtp.rollout.spec_metrics import SpecCounters, sum_counters, summarize_window
from skyrl_mtp.trainer.finite_guard import check_update_metrics
from skyrl_mtp.trainer.rollout_producer import (
    GeneratedBatch,
    RolloutProducer,
    load_pending,
    save_pending,
    staleness,
)
from skyrl_mtp.trainer.run_dir import RunDir, read_trainer_state
from skyrl_mtp.trainer.run_plan import LoopConfig
from skyrl_mtp.trainer.step_timer import StepTimer

FAULT_KILL_ENGINE_ENV = "SKYRL_MTP_FAULT_KILL_ENGINE_AT_STEP"


def sampling_spec(sc: Any, stop_token_ids: list[int], seed: int | None) -> SamplingSpec:
    return SamplingSpec(temperature=float(sc.temperature), top_p=float(sc.top_p), top_k=int(sc.top_k),
                        max_tokens=int(sc.max_tokens), stop=list(sc.stop), stop_token_ids=stop_token_ids, seed=seed)


def step_seed(base: int, step: int, round_: int) -> int:
    """Rollout seed of (step, generation round): a resumed run draws the same samples as an unbroken one."""
    return (base * 1_000_003 + step * 1009 + round_ * 17) % (2**31 - 1)


def mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for p in parts for k in p}
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in keys}


def combine_round_metrics(parts: list[dict[str, float]], summed: tuple[str, ...] = (),
                          maxima: tuple[str, ...] = ()) -> dict[str, float]:
    """One step's metrics from its generation rounds: counts summed, maxima maxed, the rest averaged."""
    out = mean_metrics(parts)
    for keys, reduce in ((summed, sum), (maxima, max)):
        for k in set(keys) & set(out):
            out[k] = reduce(p[k] for p in parts if k in p)
    return out


class RLTrainer:
    clock: Callable[[], float] = staticmethod(time.perf_counter)   # times the step's phases

    def __init__(self, loop: LoopConfig, *, engines: Any, policy: Any, env: Environment, tokenizer: Any,
                 train_examples: list[PromptExample], val_examples: list[PromptExample], run_dir: RunDir,
                 tracker: Any, log: Callable[[str], None] = print, weight_sync: Any = None):
        self.engines, self.policy, self.env = engines, policy, env
        self.weight_sync = weight_sync   # rollout.weight_transfer.step_sync.StepSync: sync + colocation order
        self.tokenizer, self.run_dir, self.tracker, self.log = tokenizer, run_dir, tracker, log
        self.loop = loop   # every setting of the loop (the run plan's)
        self.val_examples = val_examples[: loop.eval_batch_size]
        self.data = PromptBatchIterator(train_examples, min(loop.train_batch_size, len(train_examples)),
                                        shuffle=loop.shuffle, seed=loop.seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.step = 0
        self.loss_kwargs = dict(loop.loss_kwargs)
        # auto k: whether the head trains on a step (what its drafts saved and an allowance for keeping it
        # aligned, vs what its training costs)
        self.head_credit = HeadTrainingCredit(loop.idle_head_train_budget)
        # one_step_off: the next step's batch, generated while this step trains (None in sync mode)
        # async modes: the thread generating the coming steps' batches (built at the first step, after a resume)
        self.producer: RolloutProducer | None = None
        # batches generated for the next steps, in order, held by the checkpoint resumed from
        self.pending: list[GeneratedBatch] = []
        # fully_async: the engines' counters when the current weight version's window opened, and the counts of
        # evaluations since (not part of the version's generation)
        self._version_open: SpecCounters | None = None
        self._version_excluded = SpecCounters()
        # the off-policy correction reads the engine's logprobs of the sampled tokens (the behaviour policy's)
        self.keep_behaviour_logprobs = "off_policy_correction" in self.loss_kwargs

    # ------------------------------------------------------------------ lifecycle
    def resume_if_possible(self) -> int:
        """Load the newest complete checkpoint when trainer.resume=auto; returns the step resumed from (0 = fresh)."""
        latest = self.run_dir.latest() if self.loop.resume == "auto" else None
        if latest is None:
            return 0
        state = read_trainer_state(latest)
        self.policy.load_checkpoint(str(latest))
        self.data.load_state_dict(state["data"])
        if "head_credit" in state:   # checkpoints written before it was saved start the credit afresh
            self.head_credit.load_state_dict(state["head_credit"])
        self.step = int(state["step"])
        self.pending = load_pending(latest)   # async modes: the batches generated before the checkpoint's update
        self.log(f"resumed from {latest} (step {self.step})")
        return self.step

    def sync_weights(self, head_changed: bool = True) -> dict[str, float]:
        """Policy -> engines (main model and MTP drafter) through vLLM's weight-transfer API; seconds and bytes.
        `head_changed=False` (the step did not train the head): the drafter keeps what it has."""
        if self.weight_sync is None:
            raise RuntimeError("RLTrainer has no weight_sync (a StepSync linking the policy to the engines)")
        return self.weight_sync.sync(head_changed=head_changed)

    def fit(self) -> list[dict[str, float]]:
        total = self.loop.total_steps
        history = []
        bar = None
        log = self.log
        if self.loop.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=self.step, desc="RL steps", unit="step", dynamic_ncols=True)

            def log_above_bar(msg: str) -> None:   # a message printed through the bar would break it
                with tqdm.external_write_mode():
                    log(msg)

            self.log = log_above_bar
        try:
            self._start_producer()
            while self.step < total:
                history.append(self.train_step())
                if bar is not None:
                    bar.update(1)
        finally:
            if self.producer is not None:
                self.producer.close()
            self.log = log
            if bar is not None:
                bar.close()
        return history

    # ------------------------------------------------------------------ one step
    def _generate(self, timer: StepTimer, step_index: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        """The batch of step `step_index + 1` (its seeds follow from the step, not from when it is generated)."""
        loop = self.loop
        n = loop.n_samples_per_prompt
        target = self.data.batch_size
        acc = GroupAccumulator(target_groups=target, max_rounds=loop.max_gen_rounds if loop.dynamic_sampling else 1,
                               keep_all=not loop.dynamic_sampling)
        all_groups: list[RolloutGroup] = []
        env_metrics: list[dict[str, float]] = []
        window = self.engines.metrics
        window.start("train")
        try:
            while not acc.done:
                examples = self.data.next_batch()
                spec = sampling_spec(loop.sampling, self.stop_ids, step_seed(loop.seed, step_index, acc.rounds_used))
                groups, m = self._rollout(examples, spec, n, step_index)
                window.pause()
                with timer.phase("reward"):
                    m.update(self.env.score(groups))
                    self._shape_rewards(groups)
                env_metrics.append(m)
                all_groups += groups
                acc.add_round(groups, [g.rewards for g in groups])
                if not acc.done:
                    window.resume()
        finally:
            spec_m = window.stop()   # a paused window stops with the time before its pause
        stats = acc.stats()
        kept = acc.take()
        metrics = {**combine_round_metrics(env_metrics, self.env.summed_metrics, self.env.max_metrics), **spec_m,
                   **stats}
        # reward/* describes every sampled response of the step (the policy's current quality)
        flat = [r.reward for g in all_groups for r in g.rollouts]
        metrics["reward/mean"] = sum(flat) / max(len(flat), 1)
        metrics["reward/num_samples"] = float(len(flat))
        if not kept:
            # no group with reward spread: the policy gradient is zero anyway; the head still trains on them
            kept = all_groups[:target]
            metrics["dynamic_sampling/fallback_all"] = 1.0
        dp = loop.dp
        kept = kept[: max(len(kept) // dp, 1) * dp] if len(kept) >= dp else kept
        return kept, metrics

    def _rollout(self, examples, spec, n, step_index: int, phase: str = "train"):
        import ray

        if phase == "train" and os.environ.get(FAULT_KILL_ENGINE_ENV) == str(step_index + 1):   # failure-path tests
            self.log(f"fault injection: killing inference engine 0 before step {step_index + 1}")
            ray.kill(self.engines.actors[0])
        try:
            return self.env.generate(examples, spec, n)
        except ray.exceptions.RayActorError as err:
            latest = self.run_dir.latest()
            dead = getattr(err, "actor_id", None)
            ids = [a._actor_id.hex() for a in self.engines.actors]
            which = f"inference engine {ids.index(dead)} (actor {dead})" if dead in ids else "an inference engine"
            where = (f"the rollout of step {step_index + 1}" if phase == "train" else
                     f"the eval rollout after step {step_index}")
            raise EngineDiedError(
                f"{which} died during {where} ({type(err).__name__}); the last "
                f"complete checkpoint is {latest if latest else 'none (no checkpoint written yet)'} and was not "
                "modified; rerun with trainer.resume=auto to continue from it") from err

    def _shape_rewards(self, groups: list[RolloutGroup]) -> None:
        enabled, buffer_len, penalty_factor = self.loop.overlong_punishment
        if not enabled:
            return
        flat = [r for g in groups for r in g.rollouts]
        lengths = torch.tensor([len(r.response_ids) for r in flat])
        pen = soft_overlong_penalty(lengths, self.loop.sampling.max_tokens, buffer_len, penalty_factor)
        for r, p in zip(flat, pen.tolist()):
            r.info["overlong_penalty"] = p
            r.reward += p

    def _train_batches(self, groups: list[RolloutGroup]) -> list[dict[str, torch.Tensor]]:
        loop = self.loop
        rewards = torch.tensor([[r.reward for r in g.rollouts] for g in groups], dtype=torch.float32)
        adv = grpo_advantages(rewards, norm_by_std=loop.norm_adv_by_std).flatten()
        flat = [r for g in groups for r in g.rollouts]
        masks = overlong_filter_mask([r.finish_reason for r in flat]) if loop.overlong_filtering else None
        mini = loop.mini_batch_size or len(groups)
        n = len(groups[0].rollouts)
        batches = []
        for start in range(0, len(groups), mini):
            sl = slice(start * n, min(start + mini, len(groups)) * n)
            batches.append(build_train_batch(flat[sl], adv[sl], self.pad_id,
                                             None if masks is None else masks[sl]))
        return batches

    def _start_producer(self) -> None:
        """Async modes: start generating (fully_async: the engines' weights labelled with their version first)."""
        mode = self.loop.async_mode
        if mode == "sync" or self.producer is not None:
            return
        if mode == "fully_async":
            self.engines.resume_generation(self.step)
            if self.loop.num_speculative_tokens:   # the acceptance window of the version the engines hold opens
                self._version_open = self._engine_counters()
        self.producer = RolloutProducer(self._background_batch, next_index=self.step + len(self.pending),
                                        stop_index=self.loop.total_steps, version=self.step,
                                        max_staleness=self.loop.max_staleness if mode == "fully_async" else 1,
                                        ready=self.pending)
        self.pending = []
        self.producer.start()

    def _take_batch(self, timer: StepTimer) -> GeneratedBatch:
        """This step's batch: the producer's (async modes), or one held by the checkpoint resumed from, else
        generated now with the engines' current weights."""
        if self.producer is not None:
            with timer.phase("wait_rollout"):
                batch = self.producer.take()
        elif self.pending:
            batch = self.pending.pop(0)
        else:
            with timer.phase("generate"):
                groups, metrics = self._generate(timer, self.step)
            return GeneratedBatch(self.step + 1, self.step, groups, metrics)
        if batch.step != self.step + 1:
            raise RuntimeError(f"the batch generated ahead is for step {batch.step}, not step {self.step + 1}")
        return batch

    def _background_batch(self, step_index: int, version: int) -> GeneratedBatch:
        timer = StepTimer(self.clock)
        with timer.phase("generate"):
            groups, metrics = self._generate(timer, step_index)
        return GeneratedBatch(step_index + 1, version, groups, metrics, dict(timer.totals))

    def train_step(self) -> dict[str, float]:
        self._start_producer()   # async modes, first step of this process
        timer = StepTimer(self.clock)
        busy_before = self.producer.busy_seconds() if self.producer is not None else 0.0
        batch = self._take_batch(timer)
        groups, metrics = batch.groups, batch.metrics
        if self.producer is not None:
            mean, worst, newer = staleness([r for g in groups for r in g.rollouts], self.step, batch.version)
            metrics.update({"async/staleness_mean": mean, "async/staleness_max": worst,
                            **{f"timing/background/{k}_s": round(v, 4) for k, v in batch.seconds.items()}})
            if self.loop.async_mode == "fully_async":
                metrics["async/tokens_after_update_frac"] = newer
        try:
            metrics = self._train_on(groups, metrics, timer)
        except BaseException:
            if self.producer is not None:
                self.producer.close()   # its running batch finishes (no request left behind the error)
            raise
        if self.producer is not None:   # the part of the step in which the engines had nothing to generate
            busy = self.producer.busy_seconds() - busy_before
            metrics["timing/engines_idle_s"] = round(max(metrics["timing/step_s"] - busy, 0.0), 4)
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self.tracker.log(numeric, step=self.step)
        return {"step": self.step, **numeric}

    def _train_on(self, groups: list[RolloutGroup], metrics: dict[str, float], timer: StepTimer) -> dict[str, float]:
        if self.weight_sync is not None and self.weight_sync.colocate:
            with timer.phase("engine_sleep"):
                self.weight_sync.release_engines()   # colocated: the policy gets the GPUs back
        batches = self._train_batches(groups)
        with timer.phase("old_logprobs"):
            diffs, n_tok = 0.0, 0.0
            for b in batches:
                b["old_logprobs"] = self.policy.compute_logprobs(
                    {k: b[k] for k in ("input_ids", "attention_mask", "loss_mask")})
                mask = b["loss_mask"] > 0
                diffs += float((b["old_logprobs"] - b["rollout_logprobs"]).abs()[mask].sum())
                n_tok += float(mask.sum())
                behaviour = b.pop("rollout_logprobs")
                if self.keep_behaviour_logprobs:
                    b["behaviour_logprobs"] = behaviour
        metrics["rollout/logprob_abs_diff"] = diffs / max(n_tok, 1.0)
        metrics["rollout/response_length_mean"] = sum(
            len(r.response_ids) for g in groups for r in g.rollouts) / max(sum(len(g.rollouts) for g in groups), 1)
        head = {}
        if self.loop.head_max_depths is not None:   # auto k: train the depths the engines drafted, and one more
            # what the engines' policies chose, not the steps they spent exploring other ks: those are a
            # small, steady share that would otherwise make the head train depths the engines do not use
            shares = [metrics.get(f"rollout/train/speculation_model_k_share_{k}", 0.0)
                      for k in range(self.loop.head_max_depths + 1)]
            head["head_depths"] = depths_to_train(shares, self.loop.head_max_depths)
            # engines run side by side: the rollout's wall time shrank by about one engine's saving
            self.head_credit.add(metrics.get("rollout/train/speculation_seconds_saved", 0.0) / self.loop.num_engines)
            metrics["train/head_credit_s"] = self.head_credit.credit
            head["train_head"] = self.head_credit.due()
            metrics["train/head_depths"] = float(head["head_depths"])
            metrics["train/head_trained"] = float(head["train_head"])
        with timer.phase("train"):
            parts = []
            for i, b in enumerate(batches):
                parts.append(self.policy.train_step(b, policy_loss="dapo", policy_loss_kwargs=self.loss_kwargs,
                                                    **head))
                self._stop_if_not_finite(parts[-1], f"mini-batch {i + 1} of {len(batches)}", metrics, timer)
        metrics.update(mean_metrics(parts))
        if any("mtp/train_seconds" in p for p in parts):   # the step's whole head training, every mini-batch
            metrics["train/head_seconds"] = sum(p.get("mtp/train_seconds", 0.0) for p in parts)
        metrics["train/num_sequences"] = float(sum(b["input_ids"].shape[0] for b in batches))
        metrics["train/num_updates"] = float(len(batches))
        with self.producer.held() if self.producer is not None else nullcontext():   # no batch starts in here
            if self.loop.async_mode == "one_step_off":
                with timer.phase("wait_rollout"):   # the next batch is finished before the sync: no weight
                    self.producer.wait_idle()       # changes under a running request
            return self._sync_and_log(metrics, timer, head)

    def _sync_and_log(self, metrics: dict[str, float], timer: StepTimer, head: dict[str, Any]) -> dict[str, float]:
        """The step's sync, evaluation and checkpoint (async modes: with the producer held)."""
        with timer.phase("sync"):
            if self.loop.async_mode == "fully_async":
                metrics.update(self._sync_in_flight(head.get("train_head", True), timer))
            else:
                metrics.update(self.sync_weights(head_changed=head.get("train_head", True)))
        if "train_head" in head:
            # what keeping the head costs: its training, and pushing it to the engines (a step that leaves the
            # head as it was pushes the main model only); the allowance is a share of the step without that
            head_cost = 0.0
            if head["train_head"]:
                head_cost = metrics["train/head_seconds"] + metrics.get("sync/draft_seconds", 0.0)
                metrics["train/head_cost_s"] = head_cost
                self.head_credit.trained(head_cost)
            self.head_credit.allow(sum(timer.totals.values()) - head_cost)
        self.step += 1
        loop = self.loop
        if self.producer is not None:
            self.producer.set_version(self.step)
        evaluating = bool(loop.eval_every_n_steps) and (self.step % loop.eval_every_n_steps == 0
                                                        or self.step == loop.total_steps)
        every = loop.checkpoint_every_n_steps
        checkpointing = bool(every) and (self.step % every == 0 or self.step == loop.total_steps)
        if self.producer is not None and (evaluating or checkpointing):
            with timer.phase("wait_rollout"):   # eval alone on the engines; no half-generated batch saved
                self.producer.wait_idle()
        if evaluating:
            with timer.phase("eval"):
                before = self._engine_counters() if self._version_open is not None else None
                metrics.update(self.evaluate())
                if before is not None:
                    self._version_excluded = self._version_excluded + (self._engine_counters() - before)
        if checkpointing:
            with timer.phase("checkpoint"):
                self.save_checkpoint()
        metrics.update(timer.metrics())
        return metrics

    def _engine_counters(self) -> SpecCounters:
        return sum_counters(self.engines.per_engine_counters())

    def _sync_in_flight(self, head_changed: bool, timer: StepTimer) -> dict[str, float]:
        """fully_async: sync under the producer's running batch, if any: its requests are paused (kept), the
        target and the drafter updated in the same pause, the weights labelled with the new version, the
        requests resumed on them. Also closes the acceptance window of the version being replaced."""
        out: dict[str, float] = {}
        paused = self.producer.generating
        if paused:
            with timer.phase("pause"):
                self.engines.pause_generation()
        try:
            if self.loop.num_speculative_tokens:
                out.update(self._close_version_window())
            out.update(self.sync_weights(head_changed=head_changed))
        finally:
            self.engines.resume_generation(self.step + 1)
        out["async/sync_under_requests"] = float(paused)
        return out

    def _close_version_window(self) -> dict[str, float]:
        """Acceptance of the drafts made on the weights being replaced (version `self.step`), evaluations left
        out: the engines are paused or idle, so their counters are final for that version."""
        now = self._engine_counters()
        opened, self._version_open = self._version_open or now, now
        excluded, self._version_excluded = self._version_excluded, SpecCounters()
        window = summarize_window(now - opened - excluded, "version", self.loop.num_speculative_tokens, 0.0)
        keep = ("draft_acceptance_rate", "mean_acceptance_length", "num_draft_tokens", "generated_tokens")
        out = {f"async/version_{k}": window[f"rollout/version/{k}"] for k in keep}
        out["async/version"] = float(self.step)
        return out

    def _stop_if_not_finite(self, update: dict[str, float], where: str, metrics: dict[str, float],
                            timer: StepTimer) -> None:
        """Stop before the weight sync and checkpoint of this step if an update's loss or grad norm is not
        finite; the step's metrics so far (the non-finite ones included) are logged first."""
        step = self.step + 1
        try:
            check_update_metrics(update, step, where, self.run_dir.latest())
        except NonFiniteMetricError:
            row = {**metrics, **update, **timer.metrics()}
            self.tracker.log({k: float(v) for k, v in row.items() if isinstance(v, (int, float))}, step=step)
            raise

    def evaluate(self) -> dict[str, float]:
        if not self.val_examples:
            return {}
        spec = sampling_spec(self.loop.eval_sampling, self.stop_ids, step_seed(self.loop.seed, 0, 99))
        window = self.engines.metrics
        window.start("eval")
        try:
            groups, m = self._rollout(self.val_examples, spec, 1, self.step, phase="eval")
            window.pause()
            m.update(self.env.score(groups))
        finally:
            spec_m = window.stop()
        return {**{f"eval/{k}": v for k, v in m.items()}, **spec_m}

    def save_checkpoint(self) -> None:
        staging = self.run_dir.staging_dir(self.step)
        self.policy.save_checkpoint(str(staging))
        pending = self.producer.ready_batches() if self.producer is not None else self.pending
        if pending:   # async modes: the next steps' batches, generated before this update
            save_pending(staging, pending)
        state = {"step": self.step, "data": self.data.state_dict(), "head_credit": self.head_credit.state_dict()}
        path = self.run_dir.commit(staging, self.step, state, self.loop.keep_last)
        self.log(f"checkpoint: {path}")
