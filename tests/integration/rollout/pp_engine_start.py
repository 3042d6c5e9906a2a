"""Start one InferenceEngine in this process from an EngineConfig given as JSON (argv[1]), print ready()'s
runner and exit: the pipeline-parallel tests read what vLLM prints when an engine fails to start."""

from __future__ import annotations

import asyncio
import json
import sys


def main() -> int:
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.engine import InferenceEngine

    engine = InferenceEngine(EngineConfig(**json.loads(sys.argv[1])))
    try:
        info = asyncio.run(engine.ready())
        print("READY", info["runner"], flush=True)
    finally:
        asyncio.run(engine.shutdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
