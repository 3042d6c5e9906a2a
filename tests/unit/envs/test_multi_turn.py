"""Turn logic, masks and stop conditions of the multi-turn search generator, with a scripted engine.

The engine and retriever here are stand-ins (pure-logic unit test); the real vLLM engine is exercised in
tests/integration/searchr1/.
"""

import asyncio
from dataclasses import dataclass, field

import pytest

from skyrl_mtp.envs.multi_turn import MultiTurnSearchGenerator, RetrieverFailedError, summarize
from skyrl_mtp.envs.retriever.client import RetrieverError
from skyrl_mtp.rollout.sampling import RequestSpecCounts


@dataclass
class Sampling:  # the fields of rollout's SamplingSpec
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: list = field(default_factory=list)
    stop: list = field(default_factory=list)
    seed: int | None = None
    n: int = 1


@dataclass
class Out:
    token_ids: list
    logprobs: list
    finish_reason: str
    spec: RequestSpecCounts | None = None
    weight_versions: list | None = None


class CharTokenizer:
    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i != self.eos_token_id)


TOK = CharTokenizer()


class ScriptedEngine:
    """Answers turn k of a prompt (k = number of <information> blocks so far) with script[prompt][k],
    applying max_tokens and stop strings the way vLLM does (the token completing a stop string is kept)."""

    def __init__(self, scripts, delay_s=0.0, spec=None, versions=None):
        self.scripts, self.delay_s, self.spec = scripts, delay_s, spec or {}
        self.versions = versions   # per turn: a function of the turn's token count -> weight-version spans
        self.calls, self.in_flight, self.max_in_flight = [], 0, 0

    async def generate(self, prompts, sampling):
        assert len(prompts) == 1 and sampling.n == 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        ctx = TOK.decode(prompts[0])
        name = ctx.split("|")[0]
        script = self.scripts[name]
        text = script[min(ctx.count("<information>"), len(script) - 1)]
        self.calls.append((name, sampling))
        ids, reason = [], "length"
        for c in text:
            if len(ids) == sampling.max_tokens:
                break
            ids.append(ord(c))
            if c == "\x01":
                reason = "stop"
                break
            if any(TOK.decode(ids).endswith(s) for s in sampling.stop):
                reason = "stop"
                break
        else:
            reason = "stop" if ids and ids[-1] == 1 else "length"
        turn = min(ctx.count("<information>"), len(script) - 1)
        spans = None if self.versions is None else self.versions[turn](len(ids))
        return [Out(ids, [-0.5] * len(ids), reason, self.spec.get(turn), spans)]


class FakeRetriever:
    def __init__(self, fail=False, timed_out=False, delay_s=0.0):
        self.fail, self.timed_out, self.delay_s, self.queries = fail, timed_out, delay_s, []

    async def asearch(self, queries):
        self.queries += queries
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RetrieverError("retriever http://x/retrieve failed after 3 attempt(s)", timed_out=self.timed_out)
        return [f"Doc 1(Title: T) fact about {q}" for q in queries]


def make(scripts, retriever=None, max_turns=3, max_total_len=400, sampling=None, **kw):
    engine = ScriptedEngine(scripts, kw.pop("delay_s", 0.0), kw.pop("spec", None), kw.pop("versions", None))
    gen = MultiTurnSearchGenerator(engine, TOK, retriever or FakeRetriever(), max_turns, sampling or Sampling(),
                                   max_total_len=max_total_len, **kw)
    return gen, engine


def prompt(name):
    return TOK.encode(f"{name}|Q?")


def test_search_then_answer_masks_and_logprobs():
    turn1 = "hmm <search>capital of Zorbia</search> IGNORED"
    gen, engine = make({"a": [turn1, "<answer>Quenta</answer>\x01"]})
    batch = gen.generate_sync([prompt("a")])
    (t,) = batch.trajectories
    p = prompt("a")
    t1 = TOK.encode("hmm <search>capital of Zorbia</search>")
    info = TOK.encode("\n\n<information>Doc 1(Title: T) fact about capital of Zorbia</information>\n\n")
    t2 = TOK.encode("<answer>Quenta</answer>")
    assert t.token_ids == p + t1 + info + t2
    assert t.loss_mask == [0] * len(p) + [1] * len(t1) + [0] * len(info) + [1] * len(t2)
    assert t.logprobs == [0.0] * len(p) + [-0.5] * len(t1) + [0.0] * len(info) + [-0.5] * len(t2)
    assert (t.num_turns, t.num_searches, t.num_search_failures) == (2, 1, 0)
    assert (t.finish_reason, t.final_answer, t.queries) == ("answer", "Quenta", ["capital of Zorbia"])
    assert t.response_ids == t1 + info + t2
    for _, spec in engine.calls:
        assert spec.stop[:2] == ["</search>", "</answer>"]
    m = batch.metrics
    assert m["multi_turn/num_turns_mean"] == 2 and m["multi_turn/finish_answer_frac"] == 1.0
    assert m["multi_turn/policy_tokens_mean"] == len(t1) + len(t2)
    assert m["multi_turn/tool_tokens_mean"] == len(info)


def test_max_turns_stops_without_a_last_search():
    retriever = FakeRetriever()
    gen, engine = make({"s": ["<search>again</search>"]}, retriever=retriever, max_turns=3)
    (t,) = gen.generate_sync([prompt("s")]).trajectories
    assert (t.num_turns, t.num_searches, t.finish_reason, t.final_answer) == (3, 2, "max_turns", None)
    assert retriever.queries == ["again", "again"]
    assert len(engine.calls) == 3
    assert t.token_ids[-len("</search>"):] == TOK.encode("</search>") and t.loss_mask[-1] == 1


def test_max_total_len_caps_turn_budget_and_stops():
    info_len = len("\n\n<information>Doc 1(Title: T) fact about q</information>\n\n")
    used = len(prompt("l")) + len("<search>q</search>") + info_len
    gen, engine = make({"l": ["<search>q</search>", "y" * 100]}, max_turns=5, max_total_len=used + 30,
                       sampling=Sampling(max_tokens=50))
    (t,) = gen.generate_sync([prompt("l")]).trajectories
    assert [spec.max_tokens for _, spec in engine.calls] == [50, 30]
    assert (t.finish_reason, t.num_turns, len(t.token_ids)) == ("length", 2, used + 30)
    assert t.loss_mask[-30:] == [1] * 30


def test_tool_output_that_does_not_fit_ends_the_trajectory():
    gen, _ = make({"f": ["<search>q</search>"]}, max_total_len=40)
    (t,) = gen.generate_sync([prompt("f")]).trajectories
    assert t.finish_reason == "length" and t.num_searches == 1
    assert t.loss_mask[len(prompt("f")):] == [1] * len("<search>q</search>")  # no tool token was appended


def test_no_action_ends_with_no_action():
    gen, _ = make({"n": ["I do not know\x01"]})
    (t,) = gen.generate_sync([prompt("n")]).trajectories
    assert (t.finish_reason, t.num_turns, t.final_answer) == ("no_action", 1, None)


def test_retriever_failure_is_scored_or_raised():
    scripts = {"r": ["<search>q</search>", "<answer>guess</answer>"]}
    gen, engine = make(scripts, retriever=FakeRetriever(fail=True, timed_out=True))
    batch = gen.generate_sync([prompt("r")])
    (t,) = batch.trajectories
    # "score": the trajectory ends at the failed search without an answer (reward 0), counted
    assert (t.num_search_failures, t.num_search_timeouts, t.finish_reason, t.final_answer) == (1, 1, "search_failed", None)
    assert len(engine.calls) == 1 and "<information>" not in TOK.decode(t.token_ids)
    assert batch.metrics["multi_turn/search_failures"] == 1.0 and batch.metrics["multi_turn/search_timeouts"] == 1.0
    assert batch.metrics["multi_turn/finish_search_failed_frac"] == 1.0
    gen, _ = make(scripts, retriever=FakeRetriever(fail=True), on_retriever_error="raise")
    with pytest.raises(RetrieverFailedError, match=r"environment.search.on_failure=raise.*'score'") as err:
        gen.generate_sync([prompt("r")])
    assert isinstance(err.value.__cause__, RetrieverError)


def test_per_turn_acceptance_and_search_metrics():
    first, after = RequestSpecCounts(10, 20, 5), RequestSpecCounts(4, 8, 6)
    scripts = {"a": ["<search>q</search>", "<answer>x</answer>"], "b": ["<answer>y</answer>"]}
    gen, _ = make(scripts, retriever=FakeRetriever(delay_s=0.05), spec={0: first, 1: after})
    batch = gen.generate_sync([prompt("a"), prompt("b")])
    a, b = batch.trajectories
    assert a.turn_spec == [first, after] and b.turn_spec == [first]
    m = batch.metrics
    assert m["multi_turn/first_turn/draft_acceptance_rate"] == pytest.approx(10 / 40)
    assert m["multi_turn/first_turn/mean_acceptance_length"] == pytest.approx(1 + 10 / 20)
    assert m["multi_turn/after_tool/draft_acceptance_rate"] == pytest.approx(6 / 8)
    assert m["multi_turn/after_tool/mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert m["multi_turn/turn_2/draft_acceptance_rate"] == pytest.approx(6 / 8) and "multi_turn/turn_3/num_drafts" not in m
    assert not any(k.startswith("multi_turn/turn_1/") for k in m)   # turn 1 is first_turn, logged once
    assert m["multi_turn/answer_after_search_frac"] == 0.5 and m["multi_turn/answer_without_search_frac"] == 0.5
    assert m["multi_turn/num_searches_mean"] == 0.5
    assert 0.05 <= m["multi_turn/retriever_latency_mean_s"] == m["multi_turn/retriever_latency_max_s"] < 1.0


def test_no_spec_counts_means_no_acceptance_keys():
    gen, _ = make({"a": ["<answer>x</answer>"]})
    m = gen.generate_sync([prompt("a")]).metrics
    assert not [k for k in m if "acceptance" in k] and "multi_turn/retriever_latency_mean_s" not in m
    assert summarize([])["multi_turn/num_turns_mean"] == 0.0


def test_empty_query_is_a_failure_without_calling_the_retriever():
    retriever = FakeRetriever()
    gen, _ = make({"e": ["<search>  </search>", "<answer>a</answer>"]}, retriever=retriever)
    (t,) = gen.generate_sync([prompt("e")]).trajectories
    assert retriever.queries == [] and t.num_search_failures == 1 and "query was empty" in TOK.decode(t.token_ids)


def test_trajectories_advance_concurrently_with_distinct_seeds():
    scripts = {k: ["<search>q</search>", "<answer>a</answer>"] for k in "abcd"}
    gen, engine = make(scripts, sampling=Sampling(seed=5), delay_s=0.05)
    batch = asyncio.run(gen.generate([prompt(k) for k in "abcd"], n_samples=2))
    assert len(batch.trajectories) == 8
    assert [t.prompt_index for t in batch.trajectories] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert engine.max_in_flight == 8
    seeds = [spec.seed for _, spec in engine.calls]
    assert len(set(seeds)) == 16


def test_to_tensors_right_pads():
    gen, _ = make({"a": ["<answer>x</answer>"], "bb": ["<search>q</search>", "<answer>yy</answer>"]})
    batch = gen.generate_sync([prompt("a"), prompt("bb")])
    t = batch.to_tensors(pad_token_id=0)
    lens = [len(x.token_ids) for x in batch.trajectories]
    assert t["input_ids"].shape == (2, max(lens))
    assert t["attention_mask"].sum(1).tolist() == lens
    assert t["loss_mask"].sum(1).tolist() == [sum(x.loss_mask) for x in batch.trajectories]
    assert t["input_ids"][0, lens[0]:].eq(0).all() and t["logprobs"][0, lens[0]:].eq(0).all()


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_turns": 0}, "max_turns"),
    ({"sampling": Sampling(n=2)}, "sampling.n"),
    ({"sampling": Sampling(max_tokens=0)}, "max_tokens"),
    ({"on_retriever_error": "ignore"}, "on_retriever_error"),
    ({"max_total_len": 1}, "max_total_len"),
])
def test_bad_config_is_rejected(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        make({}, **kwargs)


def test_bad_prompts_are_rejected():
    gen, _ = make({}, max_total_len=10)
    with pytest.raises(ValueError, match="max_total_len"):
        gen.generate_sync([list(range(2, 20))])
    with pytest.raises(ValueError, match="n_samples"):
        gen.generate_sync([[2]], n_samples=0)


def test_single_token_tool_tags_become_stop_token_ids():
    """</search> and </answer> as ONE token each (the tiny tokenizer's tool tokens) are passed as stop token ids,
    so vLLM's scheduler ends the turn and reports the request's spec-decode counts; multi-token tags stay strings."""

    class ToolTokenizer(CharTokenizer):
        special = {"</search>": 900, "</answer>": 901}

        def encode(self, text, add_special_tokens=False):
            return [self.special[text]] if text in self.special else super().encode(text)

    engine = ScriptedEngine({"a": ["<answer>x</answer>"]})
    gen = MultiTurnSearchGenerator(engine, ToolTokenizer(), FakeRetriever(), 3, Sampling(stop_token_ids=[1]))
    gen.generate_sync([prompt("a")])
    (_, spec), = engine.calls
    assert spec.stop_token_ids == [1, 900, 901] and spec.stop[:2] == ["</search>", "</answer>"]
    _, engine = make({"a": ["<answer>x</answer>"]})
    _.generate_sync([prompt("a")])
    assert engine.calls[0][1].stop_token_ids == []


def test_a_trajectory_across_a_weight_update_keeps_each_tokens_version():
    """fully_async: the first turn was paused by a weight update after 3 tokens (versions 4 then 5); the tool
    output is labelled like the turn before it; the second turn ran wholly on version 5."""
    turn1 = "hmm <search>q</search>"
    versions = [lambda n: [(4, 0, 3), (5, 3, n)], lambda n: [(5, 0, n)]]
    gen, _ = make({"a": [turn1, "<answer>x</answer>\x01"]}, versions=versions)
    (t,) = gen.generate_sync([prompt("a")]).trajectories
    t1, t2 = len(TOK.encode(turn1)), len(TOK.encode("<answer>x</answer>"))
    info = len(t.response_ids) - t1 - t2
    assert t.response_versions == [4] * 3 + [5] * (t1 - 3) + [5] * info + [5] * t2
    from skyrl_mtp.rollout.sampling import version_spans
    assert version_spans(t.response_versions) == [(4, 0, 3), (5, 3, t1 + info + t2)]
    gen, _ = make({"a": [turn1, "<answer>x</answer>\x01"]}, versions=[lambda n: [(4, 0, n)], lambda n: None])
    assert gen.generate_sync([prompt("a")]).trajectories[0].response_versions is None   # a turn without labels
