"""Client of a Search-R1-API retriever (ours or the user's, e.g. e5 + FAISS) with bounded time and retries.

Every call ends within about (max_retries + 1) * timeout_s + the backoff sum: connection errors, timeouts and
5xx answers are retried, 4xx answers are not; whatever cannot be answered becomes a RetrieverError.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from skyrl_mtp.data.search_protocol import format_documents


class RetrieverError(RuntimeError):
    """The retriever could not answer (down, slow, or a bad answer) within the configured time and retries.

    `timed_out` is True when the last attempt failed because the retriever did not answer within timeout_s.
    """

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class RetrieverClientConfig:
    url: str
    timeout_s: float = 5.0
    max_retries: int = 2
    backoff_s: float = 0.5
    topk: int = 3

    def __post_init__(self):
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"retriever url={self.url!r} must start with http:// or https://")
        if not self.timeout_s > 0:
            raise ValueError(f"retriever timeout_s={self.timeout_s} must be > 0")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"retriever max_retries={self.max_retries!r} must be an int >= 0")
        if self.backoff_s < 0:
            raise ValueError(f"retriever backoff_s={self.backoff_s} must be >= 0")
        if not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"retriever topk={self.topk!r} must be an int >= 1")


def _endpoint(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/retrieve") else url + "/retrieve"


def _contents(item: dict) -> str:
    doc = item.get("document", item) if isinstance(item, dict) else None
    if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
        raise RetrieverError(f"retriever answered an item without document 'contents': {str(item)[:200]!r}")
    return doc["contents"]


def _parse_result(payload: object, num_queries: int) -> list[list[str]]:
    result = payload.get("result") if isinstance(payload, dict) else None
    if not isinstance(result, list) or len(result) != num_queries:
        raise RetrieverError(f"retriever answer must hold 'result' with {num_queries} lists, got {str(payload)[:200]!r}")
    return [[_contents(item) for item in per_q] for per_q in result]


class RetrieverClient:
    """`search(queries) -> formatted text per query` (sync) and `asearch` (async), both bounded."""

    def __init__(self, url: str, timeout_s: float = 5.0, max_retries: int = 2, backoff_s: float = 0.5, topk: int = 3):
        self.cfg = RetrieverClientConfig(url, timeout_s, max_retries, backoff_s, topk)
        self.endpoint = _endpoint(url)

    def _body(self, queries: list[str], topk: int | None) -> dict:
        if not queries or not all(isinstance(q, str) for q in queries):
            raise ValueError(f"queries must be a non-empty list of strings, got {queries!r}")
        return {"queries": list(queries), "topk": topk or self.cfg.topk, "return_scores": True}

    def _error(self, attempts: int, started: float, last: str, timed_out: bool = False) -> RetrieverError:
        return RetrieverError(f"retriever {self.endpoint} failed after {attempts} attempt(s) in "
                              f"{time.monotonic() - started:.1f}s (timeout_s={self.cfg.timeout_s}): {last}",
                              timed_out=timed_out)

    @staticmethod
    def _check(resp: httpx.Response) -> str | None:
        """None if usable; a message for a retryable failure; raises for a non-retryable 4xx."""
        if resp.status_code >= 500:
            return f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code >= 400:
            raise RetrieverError(f"retriever rejected the request with HTTP {resp.status_code}: {resp.text[:300]}")
        return None

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[str]]:
        """Document contents per query, best first."""
        body, started, last, timed_out = self._body(queries, topk), time.monotonic(), "", False
        with httpx.Client(timeout=self.cfg.timeout_s) as http:
            for attempt in range(self.cfg.max_retries + 1):
                if attempt:
                    time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
                try:
                    resp = http.post(self.endpoint, json=body)
                except httpx.HTTPError as e:
                    last, timed_out = f"{type(e).__name__}: {e}", isinstance(e, httpx.TimeoutException)
                    continue
                if (last := self._check(resp)) is None:
                    return _parse_result(resp.json(), len(queries))
                timed_out = False
        raise self._error(self.cfg.max_retries + 1, started, last, timed_out)

    async def aretrieve(self, queries: list[str], topk: int | None = None) -> list[list[str]]:
        body, started, last, timed_out = self._body(queries, topk), time.monotonic(), "", False
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as http:
            for attempt in range(self.cfg.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
                try:
                    # wait_for bounds the whole attempt, also a server that trickles bytes slowly
                    resp = await asyncio.wait_for(http.post(self.endpoint, json=body), self.cfg.timeout_s)
                except (TimeoutError, httpx.HTTPError) as e:
                    last = f"{type(e).__name__}: {e}" + (f" (no answer within {self.cfg.timeout_s}s)"
                                                         if isinstance(e, TimeoutError) else "")
                    timed_out = isinstance(e, (TimeoutError, httpx.TimeoutException))
                    continue
                if (last := self._check(resp)) is None:
                    return _parse_result(resp.json(), len(queries))
                timed_out = False
        raise self._error(self.cfg.max_retries + 1, started, last, timed_out)

    def search(self, queries: list[str], topk: int | None = None) -> list[str]:
        """'Doc 1(Title: ..) ..' text per query."""
        return [format_documents(docs) for docs in self.retrieve(queries, topk)]

    async def asearch(self, queries: list[str], topk: int | None = None) -> list[str]:
        return [format_documents(docs) for docs in await self.aretrieve(queries, topk)]

    def health(self) -> dict:
        base = self.endpoint[: -len("/retrieve")]
        try:
            resp = httpx.get(base + "/health", timeout=self.cfg.timeout_s)
            resp.raise_for_status()
            return resp.json()
        except httpx.HTTPError as e:
            raise RetrieverError(f"retriever health check at {base}/health failed: {type(e).__name__}: {e}") from None
