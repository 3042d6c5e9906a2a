"""The drafting part of the run schema: `trainer.mtp` (speculation and the draft loss) and `trainer.drafter` (which
drafter). Part of `schema.py`'s tree; the reference (docs/config.md) reads its comments as it reads schema.py's."""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_mtp.allowed import DEFAULT_EXPLORE_BUDGET


@dataclass
class MTPConfig:
    """The one high-level MTP knob: drafting at inference and head training at train time."""

    # true: the engines draft with the drafter (trainer.drafter.kind: the model's MTP head, or an EAGLE-3 drafter) and
    # the policy workers train it with the decoupled draft loss; false: no speculative decoding and no drafter training
    enabled: bool = True
    # an int k >= 1 (k drafts every engine step), or "auto": k is chosen per engine step between 0 and
    # max_speculative_tokens from the running batch, live acceptance and timings measured on the engine
    num_speculative_tokens: int | str = 2
    max_speculative_tokens: int = 3   # the maximum k when num_speculative_tokens=auto (refused with a fixed k)
    # how the head drafts in vLLM: "greedy" (argmax; acceptance <= p_target(argmax) at T=1) or
    # "probabilistic" (sampled from the head's distribution; pairs with loss_type=tv). Probabilistic
    # drafts use vLLM's rejection-sampling coupling (lossless in distribution, tokens depend on drafts).
    draft_sample_method: str = "greedy"
    # the cheaper draft loss: train on about this fraction of each sequence's draft positions (1.0 = all)
    loss_position_fraction: float = 1.0
    # depth d's draft loss weighs loss_depth_decay ** (d - 1) (1.0: every depth alike). A draft at depth d
    # is verified only when depths 1..d-1 were accepted, so the deeper ones may deserve less weight;
    # measured both ways (docs/benchmarks.md): 1.0 drafts better on the default run, 0.5 on a trigram target.
    loss_depth_decay: float = 1.0
    # the draft loss against the policy's own detached next-token distribution: soft_ce (soft cross-entropy),
    # hard_ce (cross-entropy on the sampled token), topk_soft_ce (soft CE on the policy's top megatron.mtp_loss_topk
    # tokens), tv (total variation, i.e. 1 - the expected acceptance of a sampled draft)
    loss_type: str = "soft_ce"
    # weight of the draft loss, which trains the MTP head only (0: the head gets no gradient)
    loss_weight: float = 1.0
    # false: train the head but roll out without speculative decoding (e.g. to warm the head up
    # before drafting with it). Bitwise comparisons do not need it on CPU: with
    # generator.draft_invariant_sampling seeded rollouts are a function of the policy alone anyway.
    draft_in_rollouts: bool = True
    # Draft depths the head is trained on (depth d predicts token t+d from the head's own depth d-1
    # output; depths beyond the checkpoint's MTP layers reuse the last layer, as vLLM drafts with it).
    # null = num_speculative_tokens, i.e. trained for every depth it drafts; under
    # num_speculative_tokens=auto, each step trains the depths the engines drafted in >= 10% of the
    # rollout's engine steps plus one more (at most max_speculative_tokens; mtp/draft_depths.py).
    train_depths: int | None = None
    # num_speculative_tokens=auto with train_depths=null: the head trains on a step when its credit covers
    # what its last training took (training it and pushing it to the engines): the engine time its drafts
    # saved since, plus this share of each step's time (that aside) for keeping it aligned with the policy
    # while drafting saves nothing
    # (mtp/draft_depths.py). So an idle head costs at most this share of the run, on any model.
    idle_head_train_budget: float = 0.01
    # num_speculative_tokens=auto: the share of the engines' time the choice of k may spend exploring (probes
    # that time again a k other than a batch bucket's best), charged at what each probe is predicted to cost
    # beyond the best k (speculation/policy.py; each bucket's first timing at every k, once per engine, is not
    # charged). It is what lets the engines notice a head that got better; 0 explores only where that is
    # predicted free.
    explore_budget: float = DEFAULT_EXPLORE_BUDGET
    # num_speculative_tokens=auto: a directory where every engine core writes each call its scheduler makes to
    # the policy choosing k (one file per engine process, speculation/trace.py), for an exact replay of
    # its choices (benchmarks/speculation_policy_trace.py); null writes nothing
    policy_trace_dir: str | None = None


@dataclass
class DrafterConfig:
    """The drafter the engines speculate with and the policy workers train (docs/drafters.md); trainer.mtp's settings
    (speculation on or off, k, the draft loss) apply to every kind."""

    # mtp: the model's own MTP layers; eagle3: an EAGLE-3 drafter, dflash: a DFlash (block) drafter, trained beside
    # the policy, for targets without MTP layers (llama, qwen3); for eagle3, trainer.mtp.train_depths is its
    # test-time-training unroll
    kind: str = "mtp"
    # eagle3 / dflash: an exported drafter of that kind to start from (config.json + model.safetensors, e.g. a
    # checkpoint's draft_head/); null: a fresh one initialised from trainer.seed
    init: str | None = None
    # eagle3 / dflash: the target layers it reads, in vLLM's numbering (0 = the embedding, L = after decoder layer
    # L-1), increasing; eagle3 reads three (null: vLLM's default (2, n//2, n-3), or the nearest three distinct ids on a
    # model of fewer than 6 layers), dflash one per drafter layer by default (null: the published drafters' choice)
    layer_ids: list[int] | None = None
    # dflash: the drafter's decoder layers
    num_layers: int = 1
    # dflash: the anchor (the token just sampled) plus block_size - 1 mask slots drafted in one pass; null =
    # trainer.mtp.num_speculative_tokens + 1 (the block vLLM drafts each engine step)
    block_size: int | None = None
    # dflash: blocks trained per sequence and step, spread evenly over its response (each costs block_size queries)
    anchors: int = 32
    # dflash: the token whose (target) embedding marks a slot to fill; null = the vocabulary's last row (an unused
    # padding row in the checkpoints served here: the run checks that the tokenizer does not use it)
    mask_token_id: int | None = None
