"""BM25 index over a Search-R1 JSONL corpus ({"id", "contents"} rows, contents = "title\\ntext").

Kept free of HTTP so ranking can be tested and reused directly; the server wraps one instance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class EmptyCorpusError(ValueError):
    """The corpus file holds no usable document; a retriever over it could never answer."""


@dataclass(frozen=True)
class Document:
    id: str
    contents: str


@dataclass(frozen=True)
class ScoredDocument:
    document: Document
    score: float


def load_corpus(path: str | Path) -> list[Document]:
    """Read a JSONL corpus; every non-blank line must be an object with a string 'contents' (and an 'id')."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"retriever corpus file not found: {p}")
    docs: list[Document] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise ValueError(f"{p}:{lineno}: each row needs a string field 'contents', got {str(row)[:200]!r}")
            doc_id = row.get("id", str(len(docs)))
            docs.append(Document(id=str(doc_id), contents=row["contents"]))
    if not any(d.contents.strip() for d in docs):
        raise EmptyCorpusError(f"retriever corpus {p} has no documents with non-empty 'contents' ({len(docs)} rows)")
    return docs


class BM25Index:
    """Lexical BM25 (bm25s) over documents' contents; English stopwords removed, no stemming."""

    def __init__(self, documents: list[Document]):
        if not documents or not any(d.contents.strip() for d in documents):
            raise EmptyCorpusError("BM25Index needs at least one document with non-empty contents")
        import bm25s

        self._bm25s = bm25s
        self.documents = list(documents)
        tokens = bm25s.tokenize([d.contents for d in documents], stopwords="en", show_progress=False)
        if not tokens.vocab:
            raise EmptyCorpusError("retriever corpus has no indexable words (only stopwords or punctuation)")
        self._vocab = tokens.vocab
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> BM25Index:
        return cls(load_corpus(path))

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, queries: list[str], topk: int) -> list[list[ScoredDocument]]:
        """Top-`topk` documents per query, best first (fewer when the corpus is smaller)."""
        if topk < 1:
            raise ValueError(f"topk={topk} must be >= 1")
        k = min(topk, len(self.documents))
        out: list[list[ScoredDocument]] = []
        for q in queries:
            words = self._bm25s.tokenize([q], stopwords="en", return_ids=False, show_progress=False)[0]
            ids = [self._vocab[w] for w in words if w in self._vocab]
            scores = np.zeros(len(self.documents), dtype=np.float32)
            if ids:
                scores = np.asarray(self._bm25.get_scores(ids), dtype=np.float32)
            # stable sort on -score keeps corpus order among ties (deterministic for queries with no known word)
            order = np.argsort(-scores, kind="stable")[:k]
            out.append([ScoredDocument(self.documents[i], float(scores[i])) for i in order])
        return out
