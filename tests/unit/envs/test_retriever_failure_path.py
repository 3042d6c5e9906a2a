"""The retriever failure path under load, with a real retriever server process on 127.0.0.1.

16 concurrent multi-turn trajectories search through the real bounded client. The engine side is a
scripted stand-in (this tests the failure policy, not vLLM). Killed mid-run: each policy of
environment.search.on_failure does what it says ("score": the failed trajectories end without an
answer, scored 0 and counted; "raise": the run stops with a clear error) and the batch ends in
bounded time. Slow retriever: every search times out, the timeouts are counted, nothing hangs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import httpx
import pytest

from skyrl_mtp.envs.multi_turn import MultiTurnSearchGenerator, RetrieverFailedError
from skyrl_mtp.envs.retriever.client import RetrieverClient
from skyrl_mtp.envs.search_reward import score_answer
from skyrl_mtp.net import free_port
from skyrl_mtp.rollout.sampling import SamplingSpec

NUM = 16
ENTITIES = [f"Zorb{chr(97 + i)}" for i in range(NUM)]


@dataclass
class Out:
    token_ids: list
    logprobs: list
    finish_reason: str
    spec: object = None


class CharTokenizer:
    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i != 1)


TOK = CharTokenizer()


class CopyingEngine:
    """Turn 1: `<search>capital of E</search>`; after an <information> block: copy the capital it names.
    Trajectory i's first turn takes i * delay_s, so the trajectories reach the retriever one after another."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def generate(self, prompts, sampling):
        ctx = TOK.decode(prompts[0])
        await asyncio.sleep(self.delay_s * ENTITIES.index(ctx.split("|")[0]) if "<information>" not in ctx else 0)
        if "<information>" not in ctx:
            text = f"<search>capital of {ctx.split('|')[0]}</search>"
        else:
            text = "<answer>" + ctx.rsplit(" is ", 1)[1].split(".")[0] + "</answer>"
        ids = TOK.encode(text)
        return [Out(ids, [-0.1] * len(ids), "stop")]


def start_process(args, url, timeout_s=60.0):
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {proc.stdout.read().decode()[-2000:]}")
        try:
            httpx.get(url + "/health", timeout=1.0)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server at {url} did not come up in {timeout_s}s")


@pytest.fixture
def retriever_proc(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"{e}\nThe capital of {e} is Cap{e}."}) + "\n"
                              for i, e in enumerate(ENTITIES)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process(["-m", "skyrl_mtp.envs.retriever", "--corpus", str(corpus), "--port", str(port)], url)
    yield proc, url
    proc.kill()
    proc.wait(10)


class KillAfter:
    """The real client; the retriever process is SIGKILLed once `after` searches have been answered. Searches past
    the first `after` wait for the kill, so exactly `after` succeed however the server's latency varies (a search
    sent before the kill could otherwise be answered from the socket after it)."""

    def __init__(self, client: RetrieverClient, proc, after: int):
        self.client, self.proc, self.after, self.calls, self.answered = client, proc, after, 0, 0
        self.killed: asyncio.Event | None = None

    async def asearch(self, queries):
        if self.killed is None:
            self.killed = asyncio.Event()
        self.calls += 1
        if self.calls > self.after:
            await self.killed.wait()
            return await self.client.asearch(queries)
        out = await self.client.asearch(queries)
        self.answered += 1
        if self.answered == self.after:
            self.proc.kill()
            self.proc.wait(10)
            self.killed.set()
        return out


def run(backend, on_error, engine_delay_s=0.05):
    sampling = SamplingSpec(temperature=1.0, max_tokens=64, seed=1)
    gen = MultiTurnSearchGenerator(CopyingEngine(engine_delay_s), TOK, backend, max_turns=3, sampling=sampling,
                                   max_total_len=400, on_retriever_error=on_error)
    started = time.monotonic()
    try:
        return gen.generate_sync([TOK.encode(f"{e}|What is the capital of {e}?") for e in ENTITIES]), started
    finally:
        run.elapsed = time.monotonic() - started


def test_healthy_retriever_every_trajectory_reads_and_copies(retriever_proc):
    _, url = retriever_proc
    batch, _ = run(RetrieverClient(url, timeout_s=5.0, max_retries=1, backoff_s=0.1, topk=1), "score")
    rewards = [score_answer(t.final_answer, [f"Cap{e}"]).score for t, e in zip(batch.trajectories, ENTITIES)]
    assert rewards == [1.0] * NUM
    assert batch.metrics["multi_turn/answer_after_search_frac"] == 1.0
    assert batch.metrics["multi_turn/search_failures"] == 0.0
    assert 0.0 < batch.metrics["multi_turn/retriever_latency_mean_s"] < 5.0


def test_killed_mid_run_with_score_policy_scores_zero_and_counts(retriever_proc):
    proc, url = retriever_proc
    client = RetrieverClient(url, timeout_s=2.0, max_retries=2, backoff_s=0.1, topk=1)
    # the trajectories search one after another: half before the kill, half after
    backend = KillAfter(client, proc, after=NUM // 2)
    batch, _ = run(backend, "score")
    assert run.elapsed < 30.0   # bounded: (max_retries + 1) attempts with backoff, not a hang
    trajs = batch.trajectories
    failed = [t for t in trajs if t.finish_reason == "search_failed"]
    ok = [t for t in trajs if t.finish_reason == "answer"]
    assert len(ok) == NUM // 2 and len(failed) == NUM - NUM // 2
    assert all(t.final_answer is None and t.num_search_failures == 1 and t.num_search_timeouts == 0 for t in failed)
    assert all(score_answer(t.final_answer, ["x"]).score == 0.0 for t in failed)
    m = batch.metrics
    assert m["multi_turn/search_failures"] == len(failed)
    assert m["multi_turn/finish_search_failed_frac"] == len(failed) / NUM
    assert m["multi_turn/answer_after_search_frac"] == len(ok) / NUM


def test_killed_mid_run_with_raise_policy_stops_with_a_clear_error(retriever_proc):
    proc, url = retriever_proc
    client = RetrieverClient(url, timeout_s=2.0, max_retries=1, backoff_s=0.1, topk=1)
    with pytest.raises(RetrieverFailedError) as err:
        run(KillAfter(client, proc, after=4), "raise")
    assert run.elapsed < 30.0
    msg = str(err.value)
    assert url in msg and "failed after 2 attempt(s)" in msg and "environment.search.on_failure=raise" in msg


SLOW_SERVER = textwrap.dedent("""
    import sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):   # /health answers at once
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')

        def do_POST(self):  # /retrieve answers only after 30 s
            time.sleep(30)
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"result": [[]]}')

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Slow).serve_forever()
""")


def test_slow_retriever_times_out_counted_and_bounded(tmp_path):
    script = tmp_path / "slow_server.py"
    script.write_text(SLOW_SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process([str(script), str(port)], url)
    try:
        client = RetrieverClient(url, timeout_s=0.5, max_retries=1, backoff_s=0.1, topk=1)
        batch, _ = run(client, "score", engine_delay_s=0.0)
    finally:
        proc.kill()
        proc.wait(10)
    # 16 concurrent searches x 2 attempts of 0.5 s each + 0.1 s backoff: about 1.1 s, far below the server's 30 s
    assert run.elapsed < 10.0
    m = batch.metrics
    assert m["multi_turn/search_timeouts"] == NUM and m["multi_turn/search_failures"] == NUM
    assert m["multi_turn/finish_search_failed_frac"] == 1.0
    assert 1.0 <= m["multi_turn/retriever_latency_mean_s"] < 5.0
