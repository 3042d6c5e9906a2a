"""The tiny factory's trigram target is a trigram in vLLM and in Megatron alike.

`draft_head_training.py --target trigram` trains heads with the Megatron policy and serves them with vLLM;
what it shows only holds if both run the target the factory meant: after "... a b" the two likely next
tokens are succ(a) and succ(b) (succ: the bigram successor read off the lm_head), and a different token
before b takes succ(a) away. vLLM's prompt logprobs say so, and Megatron's equal them.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skyrl_mtp.models.tiny import TinyModelSpec, _rms, build_tiny_checkpoint, build_weights
from skyrl_mtp.net import free_port
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron_policy import MegatronPolicy

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROBE = Path(__file__).with_name("vllm_probe.py")
ROWS, PREFIX = 16, 10


def test_vllm_and_megatron_run_the_trigram_target(tmp_path):
    spec = TinyModelSpec(seed=0, head="trigram")
    ckpt = build_tiny_checkpoint(tmp_path / "trigram", spec)
    w = build_weights(spec)
    succ = (_rms(w["model.embed_tokens.weight"]) @ w["lm_head.weight"].T).argmax(-1)
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(10, spec.vocab, (ROWS, PREFIX + 2), generator=g)
    a, b = rows[:, -2], rows[:, -1]
    other = 10 + (a - 10 + 1 + torch.randint(0, spec.vocab - 11, (ROWS,), generator=g)) % (spec.vocab - 10)
    keep = a != b   # succ is a permutation, so succ(other) != succ(a) too
    rows, a, b, other = rows[keep], a[keep], b[keep], other[keep]
    swapped = rows.clone()
    swapped[:, -2] = other
    seqs = torch.cat([torch.cat([rows, succ[a][:, None]], 1),        # the token before b's successor
                      torch.cat([rows, succ[b][:, None]], 1),        # b's successor
                      torch.cat([swapped, succ[a][:, None]], 1)])    # a's successor after another token
    n = len(rows)
    assert n >= ROWS // 2

    req = {"model": str(ckpt), "prompts": seqs[:2, :PREFIX].tolist(), "new_tokens": 2, "score": seqs.tolist()}
    (tmp_path / "req.json").write_text(json.dumps(req))
    proc = subprocess.run([sys.executable, str(PROBE), str(tmp_path / "req.json"), str(tmp_path / "res.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    vllm_lp = torch.tensor(json.loads((tmp_path / "res.json").read_text())["prompt_logprobs"])
    last = vllm_lp[:, -1]
    print(f"\nlogprob of succ(a) {last[:n].mean():.2f}, succ(b) {last[n:2 * n].mean():.2f}, "
          f"succ(a) after another token {last[2 * n:].mean():.2f}")
    assert (last[:2 * n] > math.log(0.05)).all()      # two candidates, about 0.3 each at this size
    assert last[:n].exp().mean() > 0.2 and last[n:2 * n].exp().mean() > 0.2
    assert (last[2 * n:] < math.log(0.01)).all()      # the token before b decides the second

    pol = MegatronPolicy(PolicyWorkerConfig(policy_lr=0.0, head_lr=0.0, micro_batch_size=len(seqs), seed=0),
                         str(ckpt), 0, 1, "127.0.0.1", free_port())
    try:
        megatron_lp = pol.compute_logprobs({"input_ids": seqs, "attention_mask": torch.ones_like(seqs)})
    finally:
        pol.shutdown()
    torch.testing.assert_close(vllm_lp, megatron_lp, atol=1e-4, rtol=1e-5)
