"""Tiny HF checkpoints of each supported model family, built locally, deterministically from a seed.

Everything the tests and the embedded default need comes from here: config.json, generation_config.json,
safetensors weights, and a byte-level BPE tokenizer trained on the project's own synthetic text, with a
chat template. Families (``TinyModelSpec.family``):
- "mimo" (default): Qwen2 trunk with `num_nextn_predict_layers` MTP layers, `MiMoForCausalLM`;
- "qwen3_5": Qwen3.5 dense, `Qwen3_5ForCausalLM`: Gated DeltaNet and gated full-attention layers
  alternating (every 2nd layer full attention), `mtp_num_hidden_layers` (0 or 1) MTP layer ``mtp.*``;
- "deepseek_v3", "glm4_moe" (tiny_moe.py): MLA / GQA + DeepSeek-style MoE, `num_nextn_predict_layers` MTP
  layers after the trunk; "qwen3_next", "qwen3_5_moe" (tiny_moe.py): the "qwen3_5" trunk with MoE MLPs;
- "llama", "qwen3" (tiny_dense.py): dense models WITHOUT MTP layers (`mtp_layers` is read as 0 for them).

Heads:
- "random": a freshly initialised trunk and MTP head (the default; the head starts untrained).
- "oracle": a *bigram* target (trunk blocks contribute nothing, so the next token depends only on the
  current one through the untied lm_head) with an MTP head that reproduces exactly that rule for the
  next-next token: its draft always equals the target's greedy choice (acceptance ~1).
- "partial": the same bigram target with a head whose token path is perturbed so that its argmax
  agrees with the target on about `partial_agreement` of the vocabulary.
- "trigram": a target whose next token depends on the last *two* tokens (layer 0 has one attention
  pattern, to the previous position, built from q/k biases and RoPE; everything else writes nothing),
  with a freshly initialised MTP head. Unlike the bigram targets, a draft at depth d needs the token
  before the one it is given, which only the hidden state it receives can carry: the target on which
  depth-aware head training can show what it buys.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from skyrl_mtp.cache_dirs import is_complete, private_build_dir, publish
from skyrl_mtp.models.tiny_dense import DENSE_FAMILIES, build_dense_weights, dense_hf_config
from skyrl_mtp.models.tiny_qwen3_5 import (
    build_qwen3_5_weights,
    qwen3_5_hf_config,
    token_ids,
)

HEADS = ("random", "oracle", "partial", "trigram")
ROPE_THETA = 10000.0
# the trigram target's attention logit gap between the previous position and any other, in nats
PREVIOUS_TOKEN_GAP = 20.0
FAMILIES = ("mimo", "qwen3_5", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe", *DENSE_FAMILIES)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>",
               "<think>", "</think>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # vLLM CPU attention


@dataclass(frozen=True)
class TinyModelSpec:
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    mtp_layers: int = 1
    seed: int = 0
    head: str = "random"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sharpness: float = 0.6   # built targets' lm_head scale: the next token's logit is ~ sharpness * sqrt(hidden)
    partial_agreement: float = 0.5
    family: str = "mimo"

    def __post_init__(self) -> None:
        if self.family in DENSE_FAMILIES and self.mtp_layers:   # they have none: one spec (and cache key) per model
            object.__setattr__(self, "mtp_layers", 0)
        bad = spec_problems(self)
        if bad:
            name, allowed = bad[0]
            raise ValueError(f"TinyModelSpec.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def spec_problems(spec) -> list[tuple[str, str]]:
    """(field, what is allowed) for every rule a tiny model's fields break. `spec` is a TinyModelSpec or any
    object with its fields: the run config checks `model.tiny.*` with it and reports each problem by key."""
    out: list[tuple[str, str]] = []

    def bad(name, allowed):
        out.append((name, str(allowed)))

    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
        if not isinstance(getattr(spec, name), int) or getattr(spec, name) < 1:
            bad(name, "an integer >= 1")
    if out:
        return out
    if spec.vocab < 300:
        bad("vocab", "an integer >= 300 (256 byte symbols + special tokens + merges)")
    if spec.mtp_layers < 0:
        bad("mtp_layers", "an integer >= 0")
    if spec.hidden % spec.heads:
        bad("heads", f"a divisor of hidden={spec.hidden}")
    elif spec.hidden // spec.heads not in SUPPORTED_HEAD_DIMS:
        bad("heads", f"a count giving head_dim=hidden/heads in {SUPPORTED_HEAD_DIMS} (vLLM CPU attention)")
    if spec.heads % spec.kv_heads and all(name != "heads" for name, _ in out):   # blamed on heads only
        bad("kv_heads", f"a divisor of heads={spec.heads}")
    if spec.head not in HEADS:
        bad("head", HEADS)
    elif spec.head != "random" and (spec.mtp_layers < 1 or spec.tie_word_embeddings):
        bad("head", "'random' unless mtp_layers >= 1 and tie_word_embeddings is false "
                    "(oracle/partial/trigram heads need an untied lm_head built from the embeddings)")
    if not isinstance(spec.sharpness, (int, float)) or not spec.sharpness > 0:
        bad("sharpness", "a number > 0")
    if not 0.0 < spec.partial_agreement < 1.0:
        bad("partial_agreement", "a float in (0, 1)")
    if spec.family not in FAMILIES:
        bad("family", FAMILIES)
    if spec.family != "mimo" and spec.head != "random":
        bad("head", f"'random' for family {spec.family!r} (oracle/partial/trigram heads are built for the MiMo layout)")
    if spec.family in ("qwen3_5", "qwen3_next", "qwen3_5_moe") and spec.mtp_layers > 1:
        bad("mtp_layers", f"0 or 1 for family {spec.family!r} (one shared MTP layer)")
    return out


# ---------------------------------------------------------------------------------------------- tokenizer

def tokenizer_training_text(seed: int) -> list[str]:
    """Synthetic text covering the tiny tasks: chat turns, arithmetic, and search-style knowledge."""
    import random

    from skyrl_mtp.data.arithmetic_task import ArithmeticTaskConfig, generate_rows, sft_response

    rng = random.Random(seed)
    lines: list[str] = []
    rows = generate_rows(ArithmeticTaskConfig(digits=2, num_train=400, num_test=0, seed=seed))["train"]
    for row in rows:
        lines.append(f"<|im_start|>user\n{row['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
                     f"{sft_response(row)}<|im_end|>\n")
    from skyrl_mtp.data.search_task import SearchTaskSpec, build_search_task

    task = build_search_task(SearchTaskSpec(num_entities=64, seed=seed))
    lines.extend(d["contents"] for d in task.corpus)
    lines.extend(r["prompt"][0]["content"] + r["response"] for r in task.warmstart[:200])
    words = ("the of is what who which answer search information question final put in number sum "
             "difference result think step first then so").split()
    lines.extend(" ".join(rng.choice(words) for _ in range(12)) for _ in range(200))
    return lines


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_training_text(seed), trainer=trainer)
    tok.add_tokens(list(TOOL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        bos_token=None, additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------------------------------------- weights

def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _block(prefix: str, spec: TinyModelSpec, init, zero_out: bool) -> dict[str, torch.Tensor]:
    h, d, i = spec.hidden, spec.head_dim, spec.intermediate
    q, kv = spec.heads * d, spec.kv_heads * d
    return {
        prefix + "self_attn.q_proj.weight": init(q, h), prefix + "self_attn.q_proj.bias": torch.zeros(q),
        prefix + "self_attn.k_proj.weight": init(kv, h), prefix + "self_attn.k_proj.bias": torch.zeros(kv),
        prefix + "self_attn.v_proj.weight": init(kv, h), prefix + "self_attn.v_proj.bias": torch.zeros(kv),
        prefix + "self_attn.o_proj.weight": torch.zeros(h, q) if zero_out else init(h, q),
        prefix + "mlp.gate_proj.weight": init(i, h), prefix + "mlp.up_proj.weight": init(i, h),
        prefix + "mlp.down_proj.weight": torch.zeros(h, i) if zero_out else init(h, i),
        prefix + "input_layernorm.weight": torch.ones(h),
        prefix + "post_attention_layernorm.weight": torch.ones(h),
    }


def head_target_agreement(embed: torch.Tensor, lm_head: torch.Tensor, token_proj: torch.Tensor) -> float:
    """Share of tokens x where the bigram head's argmax equals the target's (both see only x's embedding)."""
    target = (_rms(embed) @ lm_head.T).argmax(-1)
    head = (_rms(_rms(embed) @ token_proj.T) @ lm_head.T).argmax(-1)
    return (target == head).float().mean().item()


def previous_token_share(spec: TinyModelSpec) -> float:
    """The trigram's previous-token term over the current token's embedding, in squared norm: it is the
    projection of a norm-sqrt(h) vector onto the kv_dim-wide value subspace, scaled by h / kv_dim so that its
    logit equals the current token's, hence squared norm h * (h / kv_dim)."""
    return spec.hidden / (spec.kv_heads * spec.head_dim)


def previous_token_attention(prefix: str, spec: TinyModelSpec, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Attention weights that add the previous position's normed embedding, projected onto the value
    subspace and scaled to the current token's weight in the logits, to the residual stream.

    Queries and keys are constant (biases only), so after (neox) RoPE the score between positions t and s
    is sum_i a cos((t - s - 1) theta_i) over the rotary frequencies theta_i >= 0.03: largest at s = t - 1,
    by PREVIOUS_TOKEN_GAP nats over any other lag below max_position_embeddings. Position 0 sees itself.
    """
    h, d = spec.hidden, spec.head_dim
    kvd, group = spec.kv_heads * d, spec.heads // spec.kv_heads
    theta = ROPE_THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    used = theta >= 0.03
    lags = torch.arange(spec.max_position_embeddings, dtype=torch.float64)
    score = torch.cos((lags[:, None] - 1) * theta[used]).sum(-1)
    margin = score[1] - torch.cat([score[:1], score[2:]]).max()
    if margin <= 0:
        raise ValueError(f"TinyModelSpec: head_dim={d} has no rotary frequencies that single out the previous "
                         f"position within max_position_embeddings={spec.max_position_embeddings}")
    amp = (PREVIOUS_TOKEN_GAP * d**0.5 / margin).sqrt()   # attention scores are scaled by 1/sqrt(d)
    q, k = torch.zeros(2, d // 2, dtype=torch.float64), torch.zeros(2, d // 2, dtype=torch.float64)
    q[0, used], q[1, used] = amp * torch.cos(theta[used]), -amp * torch.sin(theta[used])
    k[0, used] = amp
    basis = torch.linalg.qr(torch.randn(h, kvd, generator=g))[0].T      # [kvd, h], orthonormal rows
    o_proj = torch.cat([basis[(i // group) * d:(i // group + 1) * d].T for i in range(spec.heads)], dim=1)
    return {prefix + "self_attn.q_proj.weight": torch.zeros(spec.heads * d, h),
            prefix + "self_attn.q_proj.bias": q.flatten().float().repeat(spec.heads),
            prefix + "self_attn.k_proj.weight": torch.zeros(kvd, h),
            prefix + "self_attn.k_proj.bias": k.flatten().float().repeat(spec.kv_heads),
            prefix + "self_attn.v_proj.weight": basis.contiguous(),
            prefix + "self_attn.o_proj.weight": (previous_token_share(spec) / group) * o_proj}


def build_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    h, v = spec.hidden, spec.vocab

    def init(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    built = spec.head != "random"   # embeddings of norm ~sqrt(h), silent blocks, lm_head from the embeddings
    bigram = spec.head in ("oracle", "partial")
    embed = init(v, h, std=1.0 if built else 0.02)
    sd = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(h)}
    for layer in range(spec.layers):
        sd.update(_block(f"model.layers.{layer}.", spec, init, zero_out=built))
    if built:
        # lm_head row perm[j] points at token j's embedding: the target's next token after j is perm[j].
        perm = torch.randperm(v, generator=g)
        lm_head = torch.empty(v, h)
        # the trigram's residual stream is longer by sqrt(1 + previous_token_share): scaled back so each of its
        # two candidates is as sharp as a bigram's
        scale = spec.sharpness * ((1 + previous_token_share(spec)) ** 0.5 if spec.head == "trigram" else 1.0)
        lm_head[perm] = scale * embed / embed.norm(dim=-1, keepdim=True)
        sd["lm_head.weight"] = lm_head
    elif not spec.tie_word_embeddings:
        sd["lm_head.weight"] = init(v, h)
    if spec.head == "trigram":
        sd.update(previous_token_attention("model.layers.0.", spec, g))

    token_proj = torch.eye(h)
    if spec.head == "partial":
        noise = torch.randn(h, h, generator=g) / h**0.5
        lo, hi = 0.0, 16.0
        for _ in range(30):  # bisect the noise scale to the requested agreement
            mid = (lo + hi) / 2
            if head_target_agreement(embed, sd["lm_head.weight"], torch.eye(h) + mid * noise) > spec.partial_agreement:
                lo = mid
            else:
                hi = mid
        token_proj = torch.eye(h) + (lo + hi) / 2 * noise
    for j in range(spec.mtp_layers):
        p = f"model.mtp_layers.{j}."
        sd.update(_block(p, spec, init, zero_out=bigram))
        sd[p + "token_layernorm.weight"] = torch.ones(h)
        sd[p + "hidden_layernorm.weight"] = torch.ones(h)
        sd[p + "final_layernorm.weight"] = torch.ones(h)
        # vLLM's MiMo drafter: input_proj(cat([hidden_layernorm(prev_hidden), token_layernorm(embed)]))
        sd[p + "input_proj.weight"] = (torch.cat([torch.zeros(h, h), token_proj], dim=1) if bigram
                                       else init(h, 2 * h))
    return {k: t.contiguous() for k, t in sd.items()}


def hf_config(spec: TinyModelSpec, tokenizer) -> dict:
    from skyrl_mtp.models.tiny_moe import MOE_FAMILIES, moe_hf_config

    if spec.family == "qwen3_5":
        return qwen3_5_hf_config(spec, tokenizer)
    if spec.family in DENSE_FAMILIES:
        return dense_hf_config(spec, tokenizer)
    if spec.family in MOE_FAMILIES:
        return moe_hf_config(spec, tokenizer)
    return {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.layers,
        "rope_theta": ROPE_THETA,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "num_nextn_predict_layers": spec.mtp_layers,
        "torch_dtype": "float32",
        **token_ids(tokenizer),
        "skyrl_mtp_tiny_spec": asdict(spec),
    }


def build_tiny_checkpoint(out: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the checkpoint into `out` (created); same spec -> same bytes. Returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab, spec.seed)
    if len(tokenizer) > spec.vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab={spec.vocab}")
    tokenizer.save_pretrained(out)
    cfg = hf_config(spec, tokenizer)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gen = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
           "bos_token_id": cfg["bos_token_id"], "do_sample": True, "temperature": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True))
    weights = build_spec_weights(spec)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_spec_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """The HF-named weights of ``spec``'s family."""
    from skyrl_mtp.models.tiny_moe import MOE_FAMILIES, build_moe_weights

    if spec.family == "qwen3_5":
        return build_qwen3_5_weights(spec)
    if spec.family in DENSE_FAMILIES:
        return build_dense_weights(spec)
    if spec.family in MOE_FAMILIES:
        return build_moe_weights(spec)
    return build_weights(spec)


def cached_tiny_checkpoint(cache_root: str | Path, spec: TinyModelSpec) -> Path:
    """Build once per spec under cache_root/<hash>; a COMPLETE marker makes half-written dirs rebuild."""
    import hashlib
    import shutil

    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    final = Path(cache_root) / f"tiny-{key}"
    if is_complete(final):
        return final
    tmp = private_build_dir(final)
    try:
        build_tiny_checkpoint(tmp, spec)
        return publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    d = TinyModelSpec()
    ap.add_argument("--mtp-layers", type=int, default=d.mtp_layers)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--intermediate", type=int, default=None, help="default: 2 * hidden")
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--head", choices=HEADS, default=d.head)
    ap.add_argument("--tie-word-embeddings", action="store_true")
    ap.add_argument("--family", choices=FAMILIES, default=d.family)
    a = ap.parse_args(argv)
    try:
        spec = TinyModelSpec(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                             intermediate=a.intermediate or 2 * a.hidden, vocab=a.vocab,
                             mtp_layers=a.mtp_layers, seed=a.seed, head=a.head,
                             tie_word_embeddings=a.tie_word_embeddings, family=a.family)
    except ValueError as e:
        ap.error(str(e))
    print(build_tiny_checkpoint(a.out, spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
