"""`python -m skyrl_mtp.envs.retriever --corpus FILE --port P`: serve a BM25 retriever in the foreground."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m skyrl_mtp.envs.retriever", description=__doc__)
    ap.add_argument("--corpus", required=True, help="JSONL corpus, one {'id', 'contents'} object per line")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-topk", type=int, default=50)
    args = ap.parse_args(argv)
    if not 0 < args.port < 65536:
        ap.error(f"--port={args.port} must be in [1, 65535]")

    import uvicorn

    from skyrl_mtp.data.corpus_index import BM25Index
    from skyrl_mtp.envs.retriever.server import build_app

    index = BM25Index.from_jsonl(args.corpus)
    print(f"retriever: {len(index)} documents from {args.corpus}; serving on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(build_app(index, max_topk=args.max_topk), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
