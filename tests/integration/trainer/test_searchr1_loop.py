"""The tiny SearchR1 recipe end to end on CPU: a real local BM25 retriever over HTTP, multi-turn rollouts
with MTP speculative decoding in every turn, warm start with tool tokens masked. The first run trains two steps
fully async (trainer.async_rl.mode=fully_async, max_staleness 1: the second batch starts on the first weights and
the step-1 sync updates the engines under it); the retriever-failure runs train three steps in sync mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_tiny_searchr1_runs_and_logs_reward_and_acceptance(tmp_path, cli):
    run = tmp_path / "s"
    proc = cli(["recipe=tiny_searchr1", f"trainer.run_dir={run}", "trainer.total_steps=2",
                "trainer.eval_every_n_steps=0", "trainer.checkpoint.every_n_steps=0", "trainer.train_batch_size=4",
                "trainer.policy_mini_batch_size=2", "trainer.progress_bar=false",
                "algorithm.dynamic_sampling.max_gen_rounds=1", "logger.plots=false",
                "trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=1"])
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
        # per-turn metrics: acceptance of the first turn and of the turns after a tool result, from vLLM's
        # per-request counts; they add up to the engines' own window counters
        for part in ("first_turn", "after_tool"):
            assert 0.0 <= r[f"multi_turn/{part}/draft_acceptance_rate"] <= 1.0
            assert 1.0 <= r[f"multi_turn/{part}/mean_acceptance_length"] <= 3.0
        assert r["multi_turn/first_turn/num_drafts"] + r["multi_turn/after_tool/num_drafts"] == pytest.approx(
            r["rollout/train/num_drafts"])
        assert r["multi_turn/answer_after_search_frac"] > 0.0
        assert 0.0 < r["multi_turn/retriever_latency_mean_s"] < 5.0
        assert r["multi_turn/search_failures"] == 0.0
    # fully async: batch 1 on version 0 (staleness 0); batch 2 started on version 0 and trains on version 1, its
    # tokens labelled per turn by the engines (those sampled after the step-1 sync, if any, on version 1)
    assert rows[0]["async/staleness_max"] == 0.0 and rows[0]["async/version"] == 0.0
    assert rows[1]["async/staleness_max"] == 1.0
    assert 0.0 < rows[1]["async/staleness_mean"] <= 1.0
    assert rows[1]["async/staleness_mean"] == pytest.approx(1.0 - rows[1]["async/tokens_after_update_frac"])
    print("searchr1 fully async:", [{k: r[k] for k in ("async/sync_under_requests", "async/tokens_after_update_frac")}
                                    for r in rows])


def _start_retriever(corpus, tmp_path):
    import subprocess
    import sys
    import time

    import httpx

    from skyrl_mtp.net import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "retriever.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "skyrl_mtp.envs.retriever", "--corpus", str(corpus),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            httpx.get(url + "/health", timeout=1.0)
            return proc, url
        except httpx.HTTPError:
            assert proc.poll() is None, (tmp_path / "retriever.log").read_text()
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("retriever did not start")


def _killed_run_args(on_failure: str, tmp_path: Path) -> list[str]:
    """The run's overrides, with its search task written (composes the config: Hydra's state is global, so the
    runs side by side are prepared one after the other)."""
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.data.search_task import write_search_task
    from skyrl_mtp.trainer.launch import search_task_spec
    from skyrl_mtp.trainer.run_plan import data_settings

    data = tmp_path / "data"
    args = ["recipe=tiny_searchr1", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3",
            "trainer.eval_every_n_steps=0", "trainer.checkpoint.every_n_steps=0", "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=2", "trainer.progress_bar=false", "algorithm.dynamic_sampling.max_gen_rounds=1",
            f"data.synthetic_dir={data}", "environment.search.timeout_s=2.0", "environment.search.max_retries=1",
            f"environment.search.on_failure={on_failure}", "logger.plots=false"]
    cfg = load_config(args)
    write_search_task(data, search_task_spec(dict(data_settings(cfg).synthetic_params)))
    return args


def _run_with_retriever_killed(args: list[str], tmp_path: Path):
    """Run 3 steps against an external retriever that is SIGKILLed once step 1 is logged; returns the run's exit
    status, its stderr, its metrics rows by step and the retriever's URL."""
    import os
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[3]
    retriever, url = _start_retriever(tmp_path / "data" / "corpus.jsonl", tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.Popen([sys.executable, "-m", "skyrl_mtp.main", *args, f"environment.search.retriever_url={url}"],
                           cwd=repo, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and run.poll() is None:
            if metrics.exists() and any(json.loads(line)["step"] == 1 for line in metrics.read_text().splitlines()):
                break
            time.sleep(0.5)
        retriever.kill()
        retriever.wait(10)
        out, err = run.communicate(timeout=600)
    finally:
        retriever.kill()
        run.kill()
    assert metrics.exists(), f"the run exited with {run.returncode} before it logged a step:\n{err[-4000:]}"
    rows = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    return run.returncode, err, rows, url


@pytest.fixture(scope="module")
def retriever_killed(tmp_path_factory) -> dict:
    """Both failure policies' runs, side by side (each keeps about one core busy; the warm start they share was
    cached by the run above)."""
    from concurrent.futures import ThreadPoolExecutor

    dirs = {p: tmp_path_factory.mktemp(f"killed_{p}") for p in ("score", "raise")}
    args = {p: _killed_run_args(p, d) for p, d in dirs.items()}
    with ThreadPoolExecutor(2) as pool:
        runs = {p: pool.submit(_run_with_retriever_killed, args[p], dirs[p]) for p in dirs}
        return {p: f.result() for p, f in runs.items()}


@pytest.mark.parametrize("on_failure", ["score", "raise"])
def test_retriever_killed_mid_run_follows_the_failure_policy(retriever_killed, on_failure):
    """An external retriever process is SIGKILLed once step 1 is logged: "score" finishes the run with the
    failed searches counted and scored 0; "raise" stops it with a clear error (exit status 1). No hang."""
    returncode, err, rows, url = retriever_killed[on_failure]
    assert rows[1]["multi_turn/search_failures"] == 0.0 and rows[1]["multi_turn/num_searches_mean"] > 0.5
    if on_failure == "score":
        assert returncode == 0, err[-4000:]
        assert sorted(rows) == [1, 2, 3]
        for step in (2, 3):   # every search after the kill failed: counted, scored 0
            assert rows[step]["multi_turn/search_failures"] > 0
            assert rows[step]["multi_turn/finish_search_failed_frac"] > 0.5
            assert rows[step]["reward/mean"] <= rows[step]["multi_turn/finish_answer_frac"]
    else:
        assert returncode == 1, err[-4000:]
        assert "environment.search.on_failure=raise" in err and url in err, err[-4000:]
        assert sorted(rows) == [1]
