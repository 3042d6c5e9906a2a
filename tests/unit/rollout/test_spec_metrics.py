"""SpecMetricsWindow on fake counter snapshots: deltas, paused time excluded, labels separate, misuse errors."""

from __future__ import annotations

import pytest

from skyrl_mtp.rollout.spec_metrics import (
    SpecCounters,
    SpecMetricsWindow,
    counters_from_vllm_metrics,
    sum_counters,
    summarize_window,
)


class FakeEngines:
    """Cumulative counters and a clock the test advances by hand."""

    def __init__(self):
        self.counters = SpecCounters(num_drafts=100, num_draft_tokens=200, num_accepted_tokens=150,
                                     accepted_per_pos=(90, 60), generated_tokens=1000)
        self.now = 50.0

    def generate(self, drafts, accepted_per_pos, seconds):
        k = len(accepted_per_pos)
        c = self.counters
        self.counters = c + SpecCounters(drafts, drafts * k, sum(accepted_per_pos), tuple(accepted_per_pos),
                                         drafts + sum(accepted_per_pos))
        self.now += seconds


def make():
    eng = FakeEngines()
    return eng, SpecMetricsWindow(lambda: eng.counters, 2, clock=lambda: eng.now)


def test_window_reports_deltas_not_cumulative_values():
    eng, w = make()
    w.start("train")
    eng.generate(drafts=10, accepted_per_pos=(8, 4), seconds=2.0)
    m = w.stop()
    assert m["rollout/train/num_drafts"] == 10
    assert m["rollout/train/num_draft_tokens"] == 20
    assert m["rollout/train/num_accepted_tokens"] == 12
    assert m["rollout/train/draft_acceptance_rate"] == pytest.approx(12 / 20)
    assert m["rollout/train/draft_acceptance_rate_pos_1"] == pytest.approx(0.8)
    assert m["rollout/train/draft_acceptance_rate_pos_2"] == pytest.approx(0.4)
    assert m["rollout/train/mean_acceptance_length"] == pytest.approx(1 + 12 / 10)
    assert m["rollout/train/generated_tokens"] == 22
    assert m["rollout/train/tokens_per_s"] == pytest.approx(22 / 2.0)


def test_paused_time_and_counts_are_excluded():
    eng, w = make()
    w.start("train")
    eng.generate(10, (10, 10), seconds=1.0)
    w.pause()
    eng.now += 100.0                       # reward computation, weight sync...
    eng.generate(5, (0, 0), seconds=3.0)   # anything that happens while paused does not count
    w.resume()
    eng.generate(10, (10, 10), seconds=1.0)
    m = w.stop()
    assert m["rollout/train/active_seconds"] == pytest.approx(2.0)
    assert m["rollout/train/num_drafts"] == 20
    assert m["rollout/train/draft_acceptance_rate"] == pytest.approx(1.0)
    assert m["rollout/train/tokens_per_s"] == pytest.approx(60 / 2.0)


def test_labels_are_separate_and_windows_do_not_mix():
    eng, w = make()
    w.start("train")
    eng.generate(10, (10, 0), seconds=1.0)
    with pytest.raises(RuntimeError, match="'train' is still open"):
        w.start("eval")
    train = w.stop()
    w.start("eval")
    eng.generate(4, (0, 0), seconds=1.0)
    ev = w.stop()
    assert set(train) & set(ev) == set()
    assert all(k.startswith("rollout/train/") for k in train)
    assert all(k.startswith("rollout/eval/") for k in ev)
    assert train["rollout/train/draft_acceptance_rate_pos_1"] == 1.0
    assert ev["rollout/eval/num_drafts"] == 4
    assert ev["rollout/eval/draft_acceptance_rate"] == 0.0


def test_stop_while_paused_and_misuse_errors():
    eng, w = make()
    for call in (w.pause, w.resume, w.stop):
        with pytest.raises(RuntimeError, match="no window is open"):
            call()
    with pytest.raises(ValueError, match="label"):
        w.start("")
    with pytest.raises(ValueError, match="label"):
        w.start("a/b")
    w.start("eval")
    with pytest.raises(RuntimeError, match="not paused"):
        w.resume()
    eng.generate(3, (3, 3), seconds=1.0)
    w.pause()
    with pytest.raises(RuntimeError, match="already paused"):
        w.pause()
    eng.now += 10
    m = w.stop()
    assert m["rollout/eval/active_seconds"] == pytest.approx(1.0)
    assert w.label is None


def test_no_drafts_gives_zero_rates_and_unit_length():
    m = summarize_window(SpecCounters(generated_tokens=7), "train", 0, 1.0)
    assert m["rollout/train/draft_acceptance_rate"] == 0.0
    assert m["rollout/train/mean_acceptance_length"] == 1.0
    assert not any("pos_" in k for k in m)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecMetricsWindow(lambda: SpecCounters(), -1)


def test_counters_from_vllm_metric_objects_sum_over_label_sets():
    class M:
        def __init__(self, name, value=None, values=None):
            self.name, self.value, self.values = name, value, values

    ms = [M("vllm:spec_decode_num_drafts", 3), M("vllm:spec_decode_num_drafts", 2),
          M("vllm:spec_decode_num_draft_tokens", 10), M("vllm:spec_decode_num_accepted_tokens", 7),
          M("vllm:spec_decode_num_accepted_tokens_per_pos", values=[4, 3]),
          M("vllm:generation_tokens", 40), M("vllm:num_requests_running", 1)]
    c = counters_from_vllm_metrics(ms)
    assert c == SpecCounters(5, 10, 7, (4.0, 3.0), 40)
    total = sum_counters([c, SpecCounters(1, 1, 1, (1.0, 0.0, 5.0), 2)])
    assert total.accepted_per_pos == (5.0, 3.0, 5.0)
    assert total.num_drafts == 6


def test_adaptive_k_histogram_becomes_shares_of_the_window():
    before = SpecCounters(speculation_steps=10.0, speculation_k_sum=6.0, speculation_k_hist=(6.0, 2.0, 2.0))
    after = SpecCounters(speculation_steps=30.0, speculation_k_sum=16.0, speculation_k_hist=(16.0, 2.0, 12.0))
    m = summarize_window(after - before, "train", 2, 1.0)
    assert m["rollout/train/speculation_k_mean"] == pytest.approx(0.5)
    assert [m[f"rollout/train/speculation_k_share_{k}"] for k in range(3)] == pytest.approx([0.5, 0.0, 0.5])
    assert not any("model_k_share" in key or "explored" in key for key in m)   # no policy counters: none


def test_the_policys_own_choices_and_its_exploration_become_shares_of_the_window():
    before = SpecCounters(speculation_steps=10.0, speculation_k_hist=(6.0, 4.0), speculation_model_k_hist=(10.0, 0.0),
                          speculation_explored_steps=4.0)
    after = SpecCounters(speculation_steps=50.0, speculation_k_hist=(36.0, 14.0), speculation_model_k_hist=(48.0, 2.0),
                         speculation_explored_steps=16.0)
    m = summarize_window(after - before, "train", 1, 1.0)
    assert [m[f"rollout/train/speculation_k_share_{k}"] for k in range(2)] == pytest.approx([0.75, 0.25])
    assert [m[f"rollout/train/speculation_model_k_share_{k}"] for k in range(2)] == pytest.approx([0.95, 0.05])
    assert m["rollout/train/speculation_explored_share"] == pytest.approx(0.3)
    # a window of warm-up steps only: the policy chose nothing yet, all of it explored
    warm = summarize_window(SpecCounters(speculation_steps=24.0, speculation_k_hist=(6.0, 6.0, 6.0, 6.0),
                                         speculation_model_k_hist=(0.0, 0.0, 0.0, 0.0), speculation_explored_steps=24.0),
                            "train", 3, 1.0)
    assert not any("model_k_share" in key for key in warm) and warm["rollout/train/speculation_explored_share"] == 1.0


def test_what_the_drafts_saved_is_summed_over_engines_and_windowed():
    a0, b0 = SpecCounters(speculation_steps=5.0, speculation_seconds_saved=1.0), SpecCounters(
        speculation_steps=5.0, speculation_seconds_saved=-0.5)
    a1, b1 = SpecCounters(speculation_steps=25.0, speculation_seconds_saved=1.75), SpecCounters(
        speculation_steps=15.0, speculation_seconds_saved=-0.25)
    m = summarize_window(sum_counters([a1, b1]) - sum_counters([a0, b0]), "train", 3, 1.0)
    assert m["rollout/train/speculation_seconds_saved"] == pytest.approx(1.0)
    assert "rollout/train/speculation_seconds_saved" not in summarize_window(SpecCounters(), "train", 3, 1.0)


def test_one_metrics_read_is_final_only_where_vllm_records_a_steps_stats_before_its_callers_run(monkeypatch):
    """The engine reads its counters once, instead of until they are stable, only where vLLM's output
    handler records a step's stats before anything awaits (one chunk of outputs per step); any other
    await there, a larger batch than one chunk, or a source it cannot read sends it back to polling."""
    import inspect

    pytest.importorskip("vllm")
    from vllm.v1.engine.async_llm import AsyncLLM

    from skyrl_mtp.rollout.engine import stats_recorded_with_outputs

    assert stats_recorded_with_outputs(64) == (True, "")
    ok, why = stats_recorded_with_outputs(4096)
    assert not ok and "max_num_seqs=4096" in why and "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE" in why
    real = inspect.getsource(AsyncLLM._run_output_handler)
    monkeypatch.setattr(inspect, "getsource", lambda fn: real.replace(
        "output_processor.update_scheduler_stats(", "await asyncio.to_thread(print)\n    output_processor.update_scheduler_stats("))
    ok, why = stats_recorded_with_outputs(64)
    assert not ok and "asyncio.to_thread" in why
    monkeypatch.setattr(inspect, "getsource", lambda fn: real.replace(".record(", ".log("))
    assert not stats_recorded_with_outputs(64)[0]


def test_reading_the_five_counters_alone_gives_what_vllms_whole_snapshot_gives(monkeypatch):
    """read_counters (prometheus_client's restricted registry) equals counters_from_vllm_metrics over vLLM's
    own snapshot of the same registry: two engine indices, per-position counters, and metrics it must skip."""
    pytest.importorskip("vllm")
    import prometheus_client as prom
    import vllm.v1.metrics.reader as reader

    from skyrl_mtp.rollout.spec_metrics import counters_from_vllm_metrics, read_counters

    reg = prom.CollectorRegistry()
    labels = ["model_name", "engine"]
    made = {name: prom.Counter(name, "", labels, registry=reg) for name in
            ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
             "vllm:generation_tokens", "vllm:prompt_tokens")}
    per_pos = prom.Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", labels + ["position"], registry=reg)
    prom.Histogram("vllm:e2e_request_latency_seconds", "", labels, registry=reg).labels("m", "0").observe(0.5)
    for engine, scale in (("0", 1), ("1", 3)):
        for i, name in enumerate(made):
            made[name].labels("m", engine).inc(scale * (10 + i))
        for pos, n in enumerate((7, 4, 2)[: 2 + int(engine)]):
            per_pos.labels("m", engine, str(pos)).inc(scale * n)
    monkeypatch.setattr(reader, "REGISTRY", reg)
    got = read_counters(reg)
    assert got == counters_from_vllm_metrics(reader.get_metrics_snapshot())
    assert got.num_drafts == 40 and got.generated_tokens == 52 and got.accepted_per_pos == (28, 16, 6)
    assert read_counters(prom.CollectorRegistry()) == SpecCounters()


def test_a_pause_may_complete_its_snapshot_later_with_the_same_metrics():
    """snapshot_later: the pause's read is started at the pause and completed at resume / stop; the metrics
    equal those of a window that reads at once, and the pause itself reads nothing."""
    def run(later: bool):
        eng = FakeEngines()
        reads, started = [], []

        def snapshot():
            reads.append("now")
            return eng.counters

        def snapshot_later():
            started.append(eng.counters)   # the caller guarantees the counters as they were at the pause
            held = eng.counters
            return lambda: (reads.append("later"), held)[1]

        w = SpecMetricsWindow(snapshot, 2, clock=lambda: eng.now, snapshot_later=snapshot_later if later else None)
        w.start("train")
        eng.generate(10, (8, 4), seconds=1.0)
        w.pause()
        paused_reads = list(reads)
        eng.now += 50.0
        w.resume()
        eng.generate(6, (6, 0), seconds=2.0)
        w.pause()
        eng.now += 50.0
        return w.stop(), paused_reads, reads, started

    at_once, _, reads_at_once, _ = run(False)
    m, paused_reads, reads, started = run(True)
    assert m == at_once
    assert m["rollout/train/num_drafts"] == 16 and m["rollout/train/active_seconds"] == pytest.approx(3.0)
    assert paused_reads == ["now"] and len(started) == 2          # the start read at once, the pause started one
    assert reads == ["now", "later", "now", "later"]
    assert reads_at_once == ["now", "now", "now", "now"]


def test_a_failed_later_snapshot_closes_the_window():
    eng = FakeEngines()

    def snapshot_later():
        def fail():
            raise RuntimeError("engine died")
        return fail

    w = SpecMetricsWindow(lambda: eng.counters, 2, clock=lambda: eng.now, snapshot_later=snapshot_later)
    w.start("train")
    w.pause()
    with pytest.raises(RuntimeError, match="engine died"):
        w.stop()
    assert w.label is None
    w.start("eval")   # not stuck open


class CountingClient:
    """EngineClient's read bookkeeping over fake engines: counters change only when a generate call is
    dispatched; `starts` / `finishes` count the Ray reads the client starts and completes."""

    def __new__(cls):
        from types import SimpleNamespace

        from skyrl_mtp.rollout.client import EngineClient

        class Fake(EngineClient):
            def _start_engine_reads(self):
                self.starts += 1
                return ["ref"]

            def _finish_engine_reads(self, refs):
                assert refs == ["ref"]
                self.finishes += 1
                return self.engine_counters

        engine = SimpleNamespace(generate=SimpleNamespace(remote=None))
        cfg = SimpleNamespace(num_speculative_tokens=2, max_model_len=64)
        client = Fake(cfg, [engine], [{"schema": None, "vocab_size": 32}])
        client.starts = client.finishes = 0
        client.engine_counters = SpecCounters(num_drafts=0)

        def generate(prompts, sampling, idx):
            client.engine_counters = client.engine_counters + SpecCounters(num_drafts=10, num_draft_tokens=20,
                                                                           generated_tokens=30)
            return "gen-ref"

        engine.generate.remote = generate
        return client


def _generation(client, *, release=True):
    from skyrl_mtp.rollout.sampling import SamplingSpec

    sampling, calls = client._dispatch([[1, 2]], SamplingSpec(max_tokens=4))
    if release:
        client._release(calls, sampling.n)
    return calls


def test_the_client_reads_counters_beside_the_rewards_and_reuses_a_read_until_the_next_dispatch():
    c = CountingClient()
    w = c.metrics
    w.start("train")
    assert (c.starts, c.finishes) == (1, 1)
    _generation(c)
    w.pause()
    assert (c.starts, c.finishes) == (2, 1)      # started, not waited for: the rewards run meanwhile
    w.resume()
    assert (c.starts, c.finishes) == (2, 2)      # completed; the reopening reuses it
    _generation(c)
    w.pause()
    m = w.stop()
    assert (c.starts, c.finishes) == (3, 3)
    assert m["rollout/train/num_drafts"] == 20 and m["rollout/train/generated_tokens"] == 60
    w.start("eval")                              # nothing generated since: no read
    assert (c.starts, c.finishes) == (3, 3)
    _generation(c)
    assert w.stop()["rollout/eval/num_drafts"] == 10
    assert (c.starts, c.finishes) == (4, 4)      # a stop that is not paused reads at once


def test_a_dispatch_while_paused_waits_for_the_pauses_read_first():
    c = CountingClient()
    w = c.metrics
    w.start("train")
    _generation(c)
    w.pause()
    assert c.finishes == 1
    _generation(c)                               # generated while paused: not counted
    assert c.finishes == 2                       # the pause's read completed before that dispatch
    w.resume()
    _generation(c)
    m = w.stop()
    assert m["rollout/train/num_drafts"] == 20
    assert (c.starts, c.finishes) == (4, 4)      # the resume read again: something was generated since


def test_reads_with_a_generate_call_in_flight_are_taken_at_once_and_not_reused():
    c = CountingClient()
    w = c.metrics
    w.start("train")
    calls = _generation(c, release=False)
    w.pause()                                    # in flight: read at once
    assert (c.starts, c.finishes) == (2, 2)
    w.resume()                                   # not reused: the call in flight may still change the counters
    assert (c.starts, c.finishes) == (3, 3)
    c._release(calls, 1)
    w.stop()
    assert (c.starts, c.finishes) == (4, 4)
