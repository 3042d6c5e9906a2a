"""Task environments as the trainer sees them: turn prompt examples into scored rollout groups.

One interface for both recipe families, so the step loop does not care whether a rollout is one
completion (math) or a multi-turn search trajectory with tool-output tokens masked out:

    groups, gen_metrics = env.generate(examples, sampling, n_samples)
    reward_metrics = env.score(groups)        # sets every rollout's reward

Every group holds the `n_samples` rollouts of one prompt. Generation and scoring are separate
calls so the trainer can pause the acceptance-metrics window (and time the reward) in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from skyrl_mtp.algorithms.train_batch import Rollout
from skyrl_mtp.data.datasets import PromptExample
from skyrl_mtp.envs.multi_turn import MAX_METRICS, SUMMED_METRICS
from skyrl_mtp.rollout.sampling import SamplingSpec, version_spans


@dataclass
class RolloutGroup:
    example: PromptExample
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


class Environment(Protocol):
    # generate() metrics that are counts or maxima of one call: over a step's dynamic-sampling rounds
    # they are summed / maxed, every other metric is averaged (trainer.combine_round_metrics)
    summed_metrics: tuple[str, ...]
    max_metrics: tuple[str, ...]

    def generate(self, examples: list[PromptExample], sampling: SamplingSpec,
                 n_samples: int) -> tuple[list[RolloutGroup], dict[str, float]]: ...

    def score(self, groups: list[RolloutGroup]) -> dict[str, float]: ...

    def close(self) -> None: ...


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class MathEnvironment:
    """Single-turn generation scored by the math verifier (\\boxed{} or a configured pattern)."""

    summed_metrics: tuple[str, ...] = ()
    max_metrics: tuple[str, ...] = ()

    def __init__(self, client: Any, tokenizer: Any, reward: Any):
        self.client, self.tokenizer, self.reward = client, tokenizer, reward

    def generate(self, examples, sampling, n_samples):
        prompts = [encode_prompt(self.tokenizer, ex.prompt) for ex in examples]
        outs = self.client.generate_sync(prompts, _with_n(sampling, n_samples))
        groups = []
        for i, ex in enumerate(examples):
            group = RolloutGroup(ex)
            for j in range(n_samples):
                o = outs[i * n_samples + j]
                r = Rollout(prompts[i], list(o.token_ids), list(o.logprobs), o.finish_reason, group_id=i)
                if o.weight_versions is not None:   # fully_async: the policy version of each token
                    r.info["weight_versions"] = o.weight_versions
                group.rollouts.append(r)
            groups.append(group)
        return groups, {}

    def score(self, groups):
        from skyrl_mtp.envs.math_reward import reward_metrics

        flat = [r for g in groups for r in g.rollouts]
        texts = [self.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in flat]
        truths = [str(g.example.ground_truth) for g in groups for _ in g.rollouts]
        results = self.reward.score_batch(texts, truths)
        for r, res in zip(flat, results):
            r.reward = float(res.score)
        return reward_metrics(results)

    def close(self) -> None:
        self.reward.close()


class SearchEnvironment:
    """Multi-turn `<search>` / `<information>` / `<answer>` rollouts scored by exact match (F1 logged)."""

    summed_metrics, max_metrics = SUMMED_METRICS, MAX_METRICS

    def __init__(self, client: Any, tokenizer: Any, retriever: Any, max_turns: int, max_total_len: int,
                 on_failure: str = "score", stop_server: Any = None):
        self.client, self.tokenizer, self.retriever = client, tokenizer, retriever
        self.max_turns, self.max_total_len, self.on_failure = max_turns, max_total_len, on_failure
        self._server = stop_server

    def generate(self, examples, sampling, n_samples):
        import dataclasses

        from skyrl_mtp.envs.multi_turn import MultiTurnSearchGenerator

        gen = MultiTurnSearchGenerator(self.client, self.tokenizer, self.retriever, self.max_turns,
                                       dataclasses.replace(sampling, n=1), max_total_len=self.max_total_len,
                                       on_retriever_error=self.on_failure)
        prompts = [encode_prompt(self.tokenizer, ex.prompt) for ex in examples]
        batch = gen.generate_sync(prompts, n_samples)
        groups = [RolloutGroup(ex) for ex in examples]
        for t in batch.trajectories:
            finish = "length" if t.finish_reason == "length" else "stop"
            mask = list(t.loss_mask[t.prompt_len:])
            if t.finish_reason == "search_failed":
                # the retriever failed (on_failure=score): scored 0 and counted, but not trained on, so an
                # outage does not teach the policy to stop searching
                mask = [0] * len(mask)
            info = {"turns": t.num_turns, "finish": t.finish_reason}
            if t.response_versions:   # fully_async: the policy version of each token
                info["weight_versions"] = version_spans(t.response_versions)
            groups[t.prompt_index].rollouts.append(
                Rollout(t.token_ids[:t.prompt_len], list(t.response_ids), list(t.logprobs[t.prompt_len:]), finish,
                        response_loss_mask=mask, group_id=t.prompt_index, info=info))
        return groups, batch.metrics

    def score(self, groups):
        from skyrl_mtp.envs.search_reward import score_response

        em = f1 = 0.0
        flat = [(g, r) for g in groups for r in g.rollouts]
        for g, r in flat:
            policy_text = self.tokenizer.decode([t for t, m in zip(r.response_ids, r.policy_mask()) if m],
                                                skip_special_tokens=True)
            res = score_response(policy_text, g.example.ground_truth)
            r.reward = float(res.score)
            r.info["answer"] = res.answer
            em += res.exact_match
            f1 += res.f1
        n = max(len(flat), 1)
        return {"reward/mean": em / n, "reward/exact_match": em / n, "reward/f1": f1 / n}

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _with_n(sampling: SamplingSpec, n: int) -> SamplingSpec:
    import dataclasses

    return dataclasses.replace(sampling, n=n)
