"""Multi-turn search rollouts: the policy generates until </search> or </answer>, the retriever's answer is
appended as tool tokens, and so on until an answer, max_turns or the length budget.

Each turn is an ordinary call to the same EngineClient (speculative decoding included, so acceptance metrics
count every turn). Tool-output tokens get loss_mask 0 so neither the policy loss nor the draft loss
(which masks by loss_mask) trains on them. All trajectories of a batch run as concurrent coroutines.

A retriever that cannot answer (down, or slower than its timeout after the client's retries) is handled by
`on_retriever_error`: "score" ends that trajectory with finish "search_failed" (no answer, so reward 0) and
counts it; "raise" stops the run with `RetrieverFailedError`. Either way every call is bounded in time.
Per-turn metrics: draft acceptance of the first turn vs the turns that follow a tool result (from vLLM's
per-request spec-decode counts), searches per trajectory, answer-after-search rate, retriever latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from skyrl_mtp.data.search_protocol import (
    STOP_STRINGS,
    information_block,
    parse_last_action,
    search_failure_text,
)
from skyrl_mtp.envs.retriever.client import RetrieverError
from skyrl_mtp.errors import RunStoppedError
from skyrl_mtp.rollout.sampling import token_versions

RETRIEVER_ERROR_POLICIES = ("score", "raise")
FINISH_REASONS = ("answer", "max_turns", "length", "no_action", "search_failed")
# summarize()'s counts and maxima: several calls of one step combine by sum / max, not by the mean
SUMMED_METRICS = ("multi_turn/search_failures", "multi_turn/search_timeouts")
MAX_METRICS = ("multi_turn/retriever_latency_max_s",)


class RetrieverFailedError(RunStoppedError):
    """The retriever could not answer and environment.search.on_failure=raise: the run stops."""


class SearchBackend(Protocol):
    async def asearch(self, queries: list[str]) -> list[str]: ...


@dataclass
class SearchTrajectory:
    prompt_index: int
    prompt_len: int
    token_ids: list[int]        # prompt + every policy turn + every tool output
    loss_mask: list[int]        # 1 on policy tokens only
    logprobs: list[float]       # logprob of token t at index t for policy tokens, 0.0 elsewhere
    num_turns: int
    num_searches: int
    num_search_failures: int
    finish_reason: str          # one of FINISH_REASONS
    final_answer: str | None
    queries: list[str] = field(default_factory=list)
    turn_spec: list = field(default_factory=list)          # per policy turn: RequestSpecCounts | None
    search_latencies_s: list[float] = field(default_factory=list)   # per retriever call
    num_search_timeouts: int = 0                                   # retriever calls that failed on a timeout
    # per response token, the weight version that sampled it (a tool token: that of the turn before it); None when
    # the engines label no versions (trainer.async_rl.mode=fully_async labels them)
    response_versions: list[int] | None = None

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


@dataclass
class MultiTurnBatch:
    trajectories: list[SearchTrajectory]
    metrics: dict[str, float]

    def to_tensors(self, pad_token_id: int) -> dict[str, Any]:
        """Right-padded [B, S] input_ids / attention_mask / loss_mask / logprobs (project conventions)."""
        import torch

        seq_len = max(len(t.token_ids) for t in self.trajectories)
        b = len(self.trajectories)
        out = {"input_ids": torch.full((b, seq_len), pad_token_id, dtype=torch.long),
               "attention_mask": torch.zeros(b, seq_len, dtype=torch.long),
               "loss_mask": torch.zeros(b, seq_len, dtype=torch.long),
               "logprobs": torch.zeros(b, seq_len, dtype=torch.float32)}
        for i, t in enumerate(self.trajectories):
            n = len(t.token_ids)
            out["input_ids"][i, :n] = torch.tensor(t.token_ids)
            out["attention_mask"][i, :n] = 1
            out["loss_mask"][i, :n] = torch.tensor(t.loss_mask)
            out["logprobs"][i, :n] = torch.tensor(t.logprobs)
        return out


def acceptance_metrics(counts: list, prefix: str) -> dict[str, float]:
    """Draft acceptance rate and mean acceptance length (accepted drafts + the bonus token per verify step)
    over per-request counts; {} when none of them drafted."""
    counts = [c for c in counts if c is not None]
    steps = sum(c.num_steps for c in counts)
    drafted = sum(c.num_draft_tokens for c in counts)
    if not steps or not drafted:
        return {}
    accepted = sum(c.num_accepted_tokens for c in counts)
    return {f"{prefix}/draft_acceptance_rate": accepted / drafted,
            f"{prefix}/mean_acceptance_length": 1.0 + accepted / steps,
            f"{prefix}/num_drafts": float(steps)}


def summarize(trajectories: list[SearchTrajectory]) -> dict[str, float]:
    n = max(len(trajectories), 1)
    finishes = Counter(t.finish_reason for t in trajectories)
    policy = sum(sum(t.loss_mask) for t in trajectories)
    tool = sum(len(t.token_ids) - t.prompt_len - sum(t.loss_mask) for t in trajectories)
    answered = [t for t in trajectories if t.finish_reason == "answer"]
    latencies = [x for t in trajectories for x in t.search_latencies_s]
    metrics = {
        "multi_turn/num_turns_mean": sum(t.num_turns for t in trajectories) / n,
        "multi_turn/num_searches_mean": sum(t.num_searches for t in trajectories) / n,
        "multi_turn/search_failures": float(sum(t.num_search_failures for t in trajectories)),
        "multi_turn/search_timeouts": float(sum(t.num_search_timeouts for t in trajectories)),
        "multi_turn/policy_tokens_mean": policy / n,
        "multi_turn/tool_tokens_mean": tool / n,
        # answered after reading at least one successful search / answered without any
        "multi_turn/answer_after_search_frac": sum(t.num_searches > t.num_search_failures for t in answered) / n,
        "multi_turn/answer_without_search_frac": sum(t.num_searches == 0 for t in answered) / n,
    }
    if latencies:
        metrics["multi_turn/retriever_latency_mean_s"] = sum(latencies) / len(latencies)
        metrics["multi_turn/retriever_latency_max_s"] = max(latencies)
    metrics.update({f"multi_turn/finish_{r}_frac": finishes.get(r, 0) / n for r in FINISH_REASONS})
    # the first turn reads only the prompt; every later turn starts right after a tool result
    metrics.update(acceptance_metrics([t.turn_spec[0] for t in trajectories if t.turn_spec], "multi_turn/first_turn"))
    metrics.update(acceptance_metrics([c for t in trajectories for c in t.turn_spec[1:]], "multi_turn/after_tool"))
    for turn in range(2, 1 + max((len(t.turn_spec) for t in trajectories), default=0)):   # turn 1 is first_turn
        metrics.update(acceptance_metrics([t.turn_spec[turn - 1] for t in trajectories if len(t.turn_spec) >= turn],
                                          f"multi_turn/turn_{turn}"))
    return metrics


def single_token_ids(tokenizer, texts) -> list[int]:
    """Ids of the `texts` that the tokenizer encodes as ONE token. Stopping on them as stop token ids lets
    vLLM's scheduler end the turn itself, so the request's spec-decode counts are reported (a stop STRING
    is matched after the scheduler step and the request is aborted without them)."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return [i[0] for i in ids if len(i) == 1]


class MultiTurnSearchGenerator:
    """`await generate(prompts, n_samples)` -> MultiTurnBatch; `sampling` is a SamplingSpec-like dataclass."""

    def __init__(self, client, tokenizer, retriever: SearchBackend, max_turns: int, sampling, *,
                 max_total_len: int = 1024, on_retriever_error: str = "score"):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an int >= 1")
        if not isinstance(max_total_len, int) or max_total_len < 2:
            raise ValueError(f"max_total_len={max_total_len!r} must be an int >= 2")
        if on_retriever_error not in RETRIEVER_ERROR_POLICIES:
            raise ValueError(f"on_retriever_error={on_retriever_error!r}; allowed: {RETRIEVER_ERROR_POLICIES}")
        if not dataclasses.is_dataclass(sampling) or not all(hasattr(sampling, f) for f in ("stop", "max_tokens", "seed", "n")):
            raise TypeError(f"sampling must be a SamplingSpec dataclass (fields stop, max_tokens, seed, n), got {sampling!r}")
        if sampling.n != 1:
            raise ValueError(f"sampling.n={sampling.n}: multi-turn rollouts sample one continuation per trajectory; "
                             "pass n_samples to generate() instead")
        if sampling.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens={sampling.max_tokens} must be >= 1 (the per-turn budget)")
        self.client, self.tokenizer, self.retriever = client, tokenizer, retriever
        self.max_turns, self.sampling = max_turns, sampling
        self.max_total_len, self.on_retriever_error = max_total_len, on_retriever_error
        self._stops = list(dict.fromkeys([*STOP_STRINGS, *(sampling.stop or [])]))
        self._stop_ids = list(dict.fromkeys([*(sampling.stop_token_ids or []), *single_token_ids(tokenizer, STOP_STRINGS)]))

    async def generate(self, prompts: list[list[int]], n_samples: int = 1) -> MultiTurnBatch:
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        if not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples={n_samples!r} must be an int >= 1")
        too_long = [i for i, p in enumerate(prompts) if len(p) >= self.max_total_len]
        if too_long:
            raise ValueError(f"prompts {too_long[:5]} have >= max_total_len={self.max_total_len} tokens")
        jobs = [(i, p) for i, p in enumerate(prompts) for _ in range(n_samples)]
        trajs = await asyncio.gather(*(self._rollout(j, i, p) for j, (i, p) in enumerate(jobs)))
        return MultiTurnBatch(list(trajs), summarize(list(trajs)))

    def generate_sync(self, prompts: list[list[int]], n_samples: int = 1) -> MultiTurnBatch:
        return asyncio.run(self.generate(prompts, n_samples))

    def _turn_sampling(self, job: int, turn: int, budget: int):
        seed = None if self.sampling.seed is None else self.sampling.seed + 7919 * job + turn
        return dataclasses.replace(self.sampling, stop=self._stops, stop_token_ids=self._stop_ids, n=1, seed=seed,
                                   max_tokens=min(self.sampling.max_tokens, budget))

    async def _search(self, query: str, traj: dict) -> str | None:
        """Documents text; the failure text for an empty query; None when the retriever failed (policy "score")."""
        if not query:
            traj["failures"] += 1
            return search_failure_text("the query was empty")
        started = time.monotonic()
        try:
            return (await self.retriever.asearch([query]))[0]
        except RetrieverError as e:
            traj["failures"] += 1
            traj["timeouts"] += bool(getattr(e, "timed_out", False))
            if self.on_retriever_error == "raise":
                raise RetrieverFailedError(
                    f"the retriever could not answer the search {query!r}: {e}. environment.search.on_failure=raise "
                    "stops the run; set it to 'score' to score such trajectories 0 and continue, or fix the retriever "
                    "(environment.search.retriever_url / timeout_s / max_retries)") from e
            return None
        finally:
            traj["latencies"].append(time.monotonic() - started)

    async def _rollout(self, job: int, prompt_index: int, prompt: list[int]) -> SearchTrajectory:
        ids, mask, lps = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
        turns = searches = 0
        queries: list[str] = []
        turn_spec: list = []
        versions: list[int] | None = []
        traj = {"failures": 0, "timeouts": 0, "latencies": []}
        answer, finish = None, None
        while finish is None:
            budget = self.max_total_len - len(ids)
            if budget <= 0:
                finish = "length"
                break
            out = (await self.client.generate([ids], self._turn_sampling(job, turns, budget)))[0]
            toks, lp = list(out.token_ids), list(out.logprobs)
            if len(lp) < len(toks):
                raise RuntimeError(f"engine returned {len(toks)} tokens but only {len(lp)} logprobs; "
                                   "multi-turn rollouts need the sampled tokens' logprobs")
            turns += 1
            turn_spec.append(getattr(out, "spec", None))
            turn_versions = token_versions(getattr(out, "weight_versions", None), len(toks))
            versions = None if versions is None or turn_versions is None else versions + turn_versions
            ids += toks
            mask += [1] * len(toks)
            lps += [float(x) for x in lp[: len(toks)]]
            action = parse_last_action(self.tokenizer.decode(toks, skip_special_tokens=False))
            if action is None:
                finish = "length" if out.finish_reason == "length" or len(ids) >= self.max_total_len else "no_action"
            elif action.kind == "answer":
                finish, answer = "answer", action.content
            elif turns >= self.max_turns:
                finish = "max_turns"
            else:
                searches += 1
                queries.append(action.content)
                docs = await self._search(action.content, traj)
                if docs is None:
                    finish = "search_failed"   # scored 0: no answer
                    break
                info = self.tokenizer.encode(information_block(docs), add_special_tokens=False)
                if len(ids) + len(info) >= self.max_total_len:
                    finish = "length"   # no room left for another policy turn after the tool output
                else:
                    ids += info
                    mask += [0] * len(info)
                    lps += [0.0] * len(info)
                    if versions is not None:   # not sampled: labelled like the turn that asked for them
                        versions += versions[-1:] * len(info)
        return SearchTrajectory(prompt_index, len(prompt), ids, mask, lps, turns, searches, traj["failures"],
                                finish, answer, queries, turn_spec, traj["latencies"], traj["timeouts"], versions)
