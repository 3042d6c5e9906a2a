"""BM25 retriever server (Search-R1 API) and its bounded client."""

from skyrl_mtp.data.corpus_index import (
           BM25Index,
           Document,
           EmptyCorpusError,
           ScoredDocument,
           load_corpus,
)
from skyrl_mtp.envs.retriever.client import RetrieverClient, RetrieverClientConfig, RetrieverError

__all__ = ["BM25Index", "Document", "EmptyCorpusError", "RetrieverClient", "RetrieverClientConfig",
           "RetrieverError", "ScoredDocument", "load_corpus"]
