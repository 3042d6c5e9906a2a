"""Every benchmark runs once at its `--quick` size, so none of them can rot unnoticed.

Each script under benchmarks/ is run as a subprocess (as a user would run it) with `--quick --json OUT`
under a time budget, two at a time, and its JSON must carry the fields EXPECTED lists for it. A new benchmark
without an entry here fails `test_every_benchmark_has_a_quick_smoke_run`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# a --quick run takes 5-160 s on 2 cores alone; the budget leaves room for the run beside it
BUDGET_S = 600
PARALLEL_RUNS = 2
LONGEST_FIRST = ["pipeline_parallel.py", "rollout_tail.py", "draft_head_training.py", "async_modes.py", "step_time.py",
                 "rollout_spec.py",
                 "sharded_loading_memory.py", "train_step_gpu.py", "draft_loss_math.py", "draft_loss.py"]
PORT_RACE = ("EADDRINUSE", "Address already in use")
# script -> (top-level keys, keys of every row)
EXPECTED = {
    "draft_loss.py": ({"rows", "train_step_ratio_mtp_on_off", "policy_fwd_bwd_ms", "shape", "flop_floor_ratio_mtp_on_off",
                       "train_step_ratio_mtp_on_off_cheap", "flop_floor_ratio_mtp_on_off_cheap"},
                      {"loss_type", "chunked", "time_ms", "peak_mem_mb", "ratio_to_policy_fwd_bwd"}),
    "draft_loss_math.py": ({"rows"}, {"loss_type", "chunked", "time_ms", "peak_mem_mb"}),
    "draft_head_training.py": ({"rows"}, {"variant", "train_depths", "loss_type", "position_fraction", "depth_decay",
                                          "draft_sample_method", "k", "acceptance_rate", "acceptance_per_pos",
                                          "acceptance_vs_oracle"}),
    "rollout_spec.py": ({"rows"}, {"head", "k", "batch", "identical_to_no_spec", "k_mean", "tokens_per_s", "acceptance_rate", "mean_acceptance_length",
                                   "speedup_vs_no_spec", "speedup_per_rep", "speedup_median_of_rounds", "no_spec_tokens_per_s", "predicted_speedup"}),
    "rollout_tail.py": ({"rows", "model", "requests"}, {"setup", "k", "rollout_seconds", "speedup_vs_no_spec", "tail_time_share",
                                           "k_mean_large", "k_mean_small", "identical_to_no_spec"}),
    "speculation_policy.py": ({"rows", "k_max"}, {"acceptance", "explore_budget", "us_per_step", "share_of_step", "k_mean",
                                                  "k_histogram", "best_k_share", "explore_regret_share",
                                                  "choice_regret_share", "rollouts_to_follow_per_seed"}),
    "sharded_loading_memory.py": ({"rows"}, {"checkpoint", "tp", "mode", "peak_rss_mb", "delta_rss_mb", "load_s"}),
    "train_step_gpu.py": ({"rows", "device", "params", "draft_loss_share", "optimizer", "transformer_engine"},
                          {"setting", "step_s", "tokens_per_s", "mfu", "peak_mem_mb", "predicted_peak_mb"}),
    "batch_layout_memory.py": ({"rows", "recipe_shape"},
                               {"rows", "seq", "dense_mask_layout_bytes", "causal_layout_bytes", "dense_mask_mask_bytes",
                                "causal_mask_bytes", "dense_mask_peak_rss_growth_bytes", "causal_peak_rss_growth_bytes"}),
    "pipeline_parallel.py": ({"steps", "skip", "rows", "exports", "step_s", "step_s_mean", "step_ratio_pp2_over_pp1",
                              "bitwise_equal_metrics"},
                             {"metric", "steps", "bitwise_equal_steps", "first_different_step", "max_abs_diff",
                              "max_rel_diff"}),
    "async_modes.py": ({"steps", "skip", "drop_last", "repeats", "long_tail", "phases", "refused", "failed", "rows",
                        "per_step"},
                       {"setup", "baseline", "steps_per_s", "step_s", "ratio_vs_sync", "ratio_ci95", "ratio_per_repeat",
                        "timeline", "acceptance", "reward", "response_length", "generated_tokens", "staleness"}),
    "step_time.py": ({"steps", "rows", "step_ratio_spec_over_nospec", "generate_ratio_spec_over_nospec",
                      "step_ratio_ci95", "generate_ratio_ci95", "per_step", "step_ratio_speed_normalised",
                      "generate_ratio_speed_normalised", "step_ratio_speed_normalised_ci95",
                      "generate_ratio_speed_normalised_ci95"}, {"setup", "generate_s", "reward_s", "train_s", "sync_s", "step_s",
                                         "acceptance", "tokens_per_s", "step_ratio_vs_no_spec", "k_mean", "head_depths"}),
}

# scripts a test already runs as a user would, at a larger size, checking their JSON (no second smoke run)
RUN_BY_TESTS = {
    "spec_sampling_fidelity.py": "tests/integration/spec_sampling/test_spec_sampling_fidelity.py",
    # on the trace a real auto-k engine core recorded (its --quick would record one with an RL run of its own)
    "speculation_policy_trace.py": "tests/integration/rollout/test_speculation_engines.py",
}
ROW_KEYS_CHECKED_THERE = {"spec_sampling_fidelity.py": ("head", "k", "temperature", "fix", "identical_to_nospec",
                                                        "p_value", "acceptance", "expected_acceptance"),
                          "speculation_policy_trace.py": ("trace", "steps", "k_max", "explore_budget", "all_k_match",
                                                          "first_mismatch", "k_mean", "us_per_step")}


def test_every_benchmark_has_a_quick_smoke_run():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    covered = set(EXPECTED) | set(RUN_BY_TESTS)
    assert scripts == covered, f"benchmarks without a smoke entry: {scripts - covered}"
    for script, test in RUN_BY_TESTS.items():   # that test really runs the script and reads these fields
        text = (REPO / test).read_text()
        assert f'"{script}"' in text and "--json" in text, (script, test)
        missing = [k for k in ROW_KEYS_CHECKED_THERE[script] if f'"{k}"' not in text and f"'{k}'" not in text]
        assert not missing, f"{test} no longer reads {missing} of {script}'s rows"


def _run_quick(script: str, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--json", str(out)],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=BUDGET_S)
    return proc, time.perf_counter() - t0


def _run_quick_retrying_a_port_race(script: str, out: Path):
    """One --quick run; a start-up that lost a port race to the run beside it (vLLM and Ray pick a free port,
    close it and bind it later) is run once more."""
    proc, seconds = _run_quick(script, out)
    if proc.returncode != 0 and any(p in proc.stderr for p in PORT_RACE):
        proc, seconds = _run_quick(script, out)
    return proc, seconds


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Every script's --quick run, two at a time: each is a chain of process start-ups (Python imports, Ray,
    vLLM engines, Megatron) that keeps about one core busy. The longest are started first (measured order)."""
    out = tmp_path_factory.mktemp("quick")
    order = sorted(EXPECTED, key=lambda s: (LONGEST_FIRST.index(s) if s in LONGEST_FIRST else len(LONGEST_FIRST), s))
    pool = ThreadPoolExecutor(max_workers=PARALLEL_RUNS)
    runs = {s: (pool.submit(_run_quick_retrying_a_port_race, s, out / f"{s}.json"), out / f"{s}.json")
            for s in order}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_quick_runs_and_writes_its_fields(script, quick_runs):
    """The first case to run waits for the pool of every --quick run (about 4.5 minutes on 2 cores, the longest
    start first), so pytest charges that case with it; the others find their run finished."""
    future, out = quick_runs[script]
    proc, seconds = future.result()
    assert proc.returncode == 0, f"{script} --quick failed after {seconds:.0f}s:\n{proc.stderr[-4000:]}"
    top, row_keys = EXPECTED[script]
    result = json.loads(out.read_text())
    assert top <= set(result), (script, sorted(top - set(result)))
    assert result["rows"], f"{script} --quick wrote no rows"
    for row in result["rows"]:
        assert row_keys <= set(row), (script, sorted(row_keys - set(row)))
        for key in ("time_ms", "tokens_per_s", "step_s"):   # measured, not placeholders
            if key in row:
                assert row[key] > 0, (script, key, row)
    if script == "step_time.py":   # auto k: the trainer chose the head's depths from the engines' k each step
        auto = next(r for r in result["rows"] if r["setup"] == "spec_auto")
        assert 1 <= auto["head_depths"] <= 3 and 0 <= auto["k_mean"] <= 3 and 0 <= auto["head_trained_share"] <= 1, auto
        assert auto["head_cost_s"] >= 0 and (auto["head_cost_s"] > 0) == (auto["head_trained_share"] > 0), auto
        ref = [t for run in result["per_step"]["no_spec"] for t in run["policy_work"]]   # the speed meter: measured
        lo, hi = result["step_ratio_speed_normalised_ci95"]
        ratio = result["step_ratio_speed_normalised"]   # (the interval's sums run in another order: 1e-9 slack)
        assert ref and all(t > 0 for t in ref) and 0 < lo - 1e-9 <= ratio <= hi + 1e-9, result
    if script == "async_modes.py":   # sync and one step off side by side on the long-tail prompts, one measured step
        rows = {r["setup"]: r for r in result["rows"]}
        assert set(rows) == {"sync", "one_step_off"} and result["long_tail"] and not result["failed"], result
        sync, off = rows["sync"], rows["one_step_off"]
        assert sync["ratio_vs_sync"] == 1.0 and off["ratio_vs_sync"] == sync["step_s"] / off["step_s"], rows
        assert off["staleness"] == 1.0 and sync["staleness"] in (None, 0.0), rows
        for r in rows.values():   # the main thread's phases add up to the step (each logged to 4 decimals)
            t = r["timeline"]
            beside = ("step", "overlap", "engines_idle")   # background/* ran beside the step; these derive from it
            main_thread = sum(v for p, v in t.items() if not p.startswith("background/") and p not in beside)
            assert main_thread == pytest.approx(t["step"], abs=1e-3), t
        # the measured step: sync generates its own batch, one step off the next one in the background
        assert sync["timeline"]["generate"] > 0 and sync["timeline"]["background/generate"] == 0, sync
        assert off["timeline"]["generate"] == 0 and off["timeline"]["background/generate"] > 0, off
    if script == "rollout_spec.py":   # every engine its own counters: no-spec drafts nothing, the oracle's drafts all land
        assert {(r["head"], r["k"]) for r in result["rows"]} == {("oracle", 0), ("oracle", "auto"), ("eagle3", 0),
                                                                  ("eagle3", 1)}
        for row in result["rows"]:
            if row["head"] == "eagle3":   # a fresh EAGLE-3 drafter on the tiny Llama: lossless, and it drafted
                assert row["identical_to_no_spec"] and 0 < row["draft_cost_ratio"] < 1, row
                assert row["k"] == 0 or row["acceptance_rate"] is not None, row
                continue
            assert row["identical_to_no_spec"], row
            assert len(row["speedup_per_rep"]) >= 1 and all(s > 0 for s in row["speedup_per_rep"]), row
            rounds = sorted(row["speedup_per_rep"])
            assert row["speedup_median_of_rounds"] == (rounds[(len(rounds) - 1) // 2] + rounds[len(rounds) // 2]) / 2, row
            if row["k"] == 0:
                assert row["acceptance_rate"] is None and row["speedup_per_rep"] == [1.0] * len(row["speedup_per_rep"]), row
            elif row["acceptance_rate"] is not None:
                assert row["acceptance_rate"] == 1.0, row
            if row["k"] == "auto":   # the oracle's drafts all land: auto drafts once it timed the batch
                assert row["k_mean"] is not None and row["k_mean"] > 0, row
    if script == "rollout_tail.py":   # both batches, every engine lossless; auto's k while large and small
        rows = result["rows"]
        assert {r["setup"] for r in rows} == {"tail_heavy", "uniform"} and all(r["identical_to_no_spec"] for r in rows), rows
        for r in rows:
            assert 0.0 <= r["tail_time_share"] <= 1.0 and r["rollout_seconds"] > 0, r
            if r["k"] == "auto":
                assert all(m is None or 0 <= m <= 3 for m in (r["k_mean_large"], r["k_mean_small"])), r
    print(f"{script} --quick: {seconds:.1f}s")
