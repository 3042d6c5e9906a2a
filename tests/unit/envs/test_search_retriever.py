"""BM25 retriever over HTTP (real uvicorn on 127.0.0.1) and its bounded client."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from skyrl_mtp.envs.retriever import EmptyCorpusError, RetrieverClient, RetrieverError
from skyrl_mtp.envs.retriever.server import start_retriever_in_thread
from skyrl_mtp.net import free_port

DOCS = [
    {"id": "zorbia", "contents": "Zorbia\nThe capital of Zorbia is Quenta."},
    {"id": "blorp", "contents": "Blorp\nThe capital of Blorp is Mizza. Blorp exports glass."},
    {"id": "frob", "contents": "Frob River\nThe Frob River flows through Zorbia and Blorp."},
    {"id": "kelm", "contents": "Kelm\nKelm was founded by Ardo Vint in 1203."},
]


def write_corpus(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    corpus = write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", DOCS)
    with start_retriever_in_thread(corpus, max_topk=3) as srv:
        yield srv


def post(server, body):
    return httpx.post(server.url + "/retrieve", json=body, timeout=10)


def test_ranks_the_matching_document_first(server):
    resp = post(server, {"queries": ["capital of Zorbia", "who founded Kelm", "glass exports"], "topk": 2,
                         "return_scores": True})
    assert resp.status_code == 200
    result = resp.json()["result"]
    assert [[h["document"]["id"] for h in per_q][0] for per_q in result] == ["zorbia", "kelm", "blorp"]
    assert all(len(per_q) == 2 for per_q in result)
    scores = [h["score"] for h in result[0]]
    assert scores[0] > scores[1] >= 0.0
    assert result[0][0]["document"]["contents"] == DOCS[0]["contents"]


def test_without_scores_returns_bare_documents(server):
    result = post(server, {"queries": ["Mizza"], "topk": 1, "return_scores": False}).json()["result"]
    assert result == [[{"id": "blorp", "contents": DOCS[1]["contents"]}]]


def test_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "num_documents": 4, "max_topk": 3}


@pytest.mark.parametrize("body, needle", [
    ({"queries": [], "topk": 1}, "queries"),
    ({"queries": ["x"], "topk": 0}, "topk"),
    ({"queries": ["x"], "topk": 4}, "topk"),
    ({"queries": "capital", "topk": 1}, "queries"),
    ({"queries": [3], "topk": 1}, "queries"),
    ({"queries": ["x"], "topk": "2"}, "topk"),
    ({"queries": ["  "], "topk": 1}, "queries"),
    ({"topk": 1}, "queries"),
])
def test_bad_requests_are_422_with_a_message(server, body, needle):
    resp = post(server, body)
    assert resp.status_code == 422
    assert needle in resp.text


def test_empty_corpus_is_a_startup_error(tmp_path):
    with pytest.raises(EmptyCorpusError, match="no documents"):
        start_retriever_in_thread(write_corpus(tmp_path / "empty.jsonl", []))
    with pytest.raises(EmptyCorpusError):
        start_retriever_in_thread(write_corpus(tmp_path / "blank.jsonl", [{"id": "0", "contents": "  "}]))
    with pytest.raises(ValueError, match="contents"):
        start_retriever_in_thread(write_corpus(tmp_path / "bad.jsonl", [{"id": "0", "text": "x"}]))


def test_cli_refuses_an_empty_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "empty.jsonl", [])
    proc = subprocess.run([sys.executable, "-m", "skyrl_mtp.envs.retriever", "--corpus", str(corpus),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "EmptyCorpusError" in proc.stderr and "no documents" in proc.stderr


def test_client_formats_documents(server):
    client = RetrieverClient(server.url, timeout_s=5, max_retries=0, topk=2)
    text = client.search(["capital of Zorbia"])[0]
    assert text.startswith("Doc 1(Title: Zorbia) The capital of Zorbia is Quenta.\nDoc 2(Title: ")
    assert asyncio.run(client.asearch(["Kelm founded"])) [0].startswith("Doc 1(Title: Kelm)")
    assert client.health()["num_documents"] == 4


def test_client_4xx_is_not_retried(server):
    client = RetrieverClient(server.url, timeout_s=5, max_retries=3, backoff_s=1.0, topk=10)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match="HTTP 422"):
        client.search(["x"])
    assert time.monotonic() - t0 < 1.0


def test_client_closed_port_fails_after_retries():
    client = RetrieverClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5, max_retries=2, backoff_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match="after 3 attempt"):
        client.search(["q"])
    with pytest.raises(RetrieverError, match="after 3 attempt"):
        asyncio.run(client.asearch(["q"]))
    assert time.monotonic() - t0 < 5.0


@pytest.fixture
def silent_server():
    """Accepts connections and never answers: the 'slow retriever' case."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    sock.close()


def test_client_slow_server_times_out_bounded(silent_server):
    client = RetrieverClient(silent_server, timeout_s=0.4, max_retries=1, backoff_s=0.1)
    for call in (lambda: client.search(["q"]), lambda: asyncio.run(client.asearch(["q"]))):
        t0 = time.monotonic()
        with pytest.raises(RetrieverError, match="after 2 attempt"):
            call()
        elapsed = time.monotonic() - t0
        assert 0.8 <= elapsed < 3.0, elapsed


def test_client_config_validation():
    with pytest.raises(ValueError, match="url"):
        RetrieverClient("localhost:8000")
    with pytest.raises(ValueError, match="timeout_s"):
        RetrieverClient("http://x", timeout_s=0)
    with pytest.raises(ValueError, match="max_retries"):
        RetrieverClient("http://x", max_retries=-1)
