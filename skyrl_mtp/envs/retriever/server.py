"""HTTP retriever speaking the Search-R1 API (POST /retrieve), plus a helper that serves it in a background thread.

Request:  {"queries": [str, ...], "topk": int, "return_scores": bool}
Response: {"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}
(without return_scores the per-query items are the bare documents, as in Search-R1's server).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from skyrl_mtp.data.corpus_index import BM25Index
from skyrl_mtp.net import listening_socket


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queries: list[StrictStr] = Field(min_length=1)
    topk: StrictInt = 3
    return_scores: StrictBool = True


def build_app(index: BM25Index, *, max_topk: int = 50) -> FastAPI:
    """A FastAPI app answering /retrieve from `index`; topk outside [1, max_topk] is a 422."""
    if max_topk < 1:
        raise ValueError(f"max_topk={max_topk} must be >= 1")
    app = FastAPI(title="skyrl-mtp BM25 retriever")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_documents": len(index), "max_topk": max_topk}

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest):
        if not 1 <= req.topk <= max_topk:
            raise HTTPException(status_code=422, detail=f"field 'topk'={req.topk} must be in [1, {max_topk}]")
        for i, q in enumerate(req.queries):
            if not q.strip():
                raise HTTPException(status_code=422, detail=f"field 'queries'[{i}] is blank; queries must be non-empty text")
        hits = index.search(req.queries, req.topk)
        if req.return_scores:
            result = [[{"document": {"id": h.document.id, "contents": h.document.contents}, "score": h.score}
                       for h in per_q] for per_q in hits]
        else:
            result = [[{"id": h.document.id, "contents": h.document.contents} for h in per_q] for per_q in hits]
        return JSONResponse({"result": result})

    return app


@dataclass
class RunningRetriever:
    """A retriever served by uvicorn in a daemon thread of this process; `stop()` shuts it down."""

    url: str
    port: int
    _server: object
    _thread: threading.Thread

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> RunningRetriever:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_retriever_in_thread(corpus: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
                              max_topk: int = 50, startup_timeout_s: float = 30.0) -> RunningRetriever:
    """Index `corpus` (errors, e.g. an empty corpus, raise here) and serve it on `port` (a free one if None)."""
    import uvicorn

    index = BM25Index.from_jsonl(corpus)
    app = build_app(index, max_topk=max_topk)
    sockets = None
    if not port:   # hold the port from its pick on: the server serves on this very socket
        sock = listening_socket(host)
        port, sockets = sock.getsockname()[1], [sock]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    # uvicorn (>= 0.29) skips signal handlers by itself when serving outside the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name=f"retriever-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"retriever server on {host}:{port} exited during start-up (port in use?)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"retriever server on {host}:{port} not started after {startup_timeout_s}s")
        time.sleep(0.02)
    return RunningRetriever(url=f"http://{host}:{port}", port=port, _server=server, _thread=thread)
