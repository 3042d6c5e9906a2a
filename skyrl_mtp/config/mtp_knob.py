"""Propagation of the high-level `trainer.mtp` knob into the training and inference settings.

`trainer.mtp` says, once, whether the model drafts with its MTP head and how the head is trained.
The low-level keys it drives (`megatron.mtp_*` and `generator.speculative_config`) are derived
from it when left unset (null); an explicit low-level value that contradicts the knob is an
error rather than being silently overwritten, because a user who wrote it meant something.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from skyrl_mtp.config.errors import ConfigError, problem


def speculative_config_for(k: int) -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": int(k)}


def propagate_mtp_knob(cfg: DictConfig) -> DictConfig:
    """Fill `megatron.mtp_*` and `generator.speculative_config` from `trainer.mtp`, in place.

    Raises ConfigError listing every contradiction between the knob and explicit settings.
    """
    knob = cfg.trainer.mtp
    meg = cfg.megatron
    gen = cfg.generator
    problems: list[str] = []

    if knob.enabled:
        k = int(knob.num_speculative_tokens)
        if k < 1:
            raise ConfigError([problem("trainer.mtp.num_speculative_tokens", k,
                                       "must be >= 1 when trainer.mtp.enabled=true (set enabled=false to turn MTP off)")])
        if meg.mtp_num_layers is not None and meg.mtp_num_layers == 0:
            problems.append(problem("megatron.mtp_num_layers", 0,
                                    "contradicts trainer.mtp.enabled=true; leave it null (use the checkpoint's MTP layers) or >= 1"))
        if meg.mtp_loss_type is not None and meg.mtp_loss_type != knob.loss_type:
            problems.append(problem("megatron.mtp_loss_type", meg.mtp_loss_type,
                                    f"contradicts trainer.mtp.loss_type={knob.loss_type!r}; leave it null or make them equal"))
        if meg.mtp_loss_weight is not None and float(meg.mtp_loss_weight) != float(knob.loss_weight):
            problems.append(problem("megatron.mtp_loss_weight", meg.mtp_loss_weight,
                                    f"contradicts trainer.mtp.loss_weight={knob.loss_weight!r}; leave it null or make them equal"))
        wanted = speculative_config_for(k)
        if not knob.get("draft_in_rollouts", True):
            if gen.speculative_config is not None:
                problems.append(problem("generator.speculative_config",
                                        OmegaConf.to_container(gen.speculative_config, resolve=True),
                                        "contradicts trainer.mtp.draft_in_rollouts=false; leave it null"))
            if problems:
                raise ConfigError(problems)
            with open_dict(cfg):
                meg.mtp_loss_type = knob.loss_type
                meg.mtp_loss_weight = float(knob.loss_weight)
            return cfg
        if gen.speculative_config is not None:
            given = OmegaConf.to_container(gen.speculative_config, resolve=True)
            if given.get("method") != "mtp" or int(given.get("num_speculative_tokens", -1)) != k:
                problems.append(problem("generator.speculative_config", given,
                                        f"contradicts trainer.mtp (expected {wanted}); leave it null to derive it"))
        if problems:
            raise ConfigError(problems)
        with open_dict(cfg):
            meg.mtp_loss_type = knob.loss_type
            meg.mtp_loss_weight = float(knob.loss_weight)
            extra = {} if gen.speculative_config is None else OmegaConf.to_container(gen.speculative_config)
            gen.speculative_config = {**wanted, **extra}
        return cfg

    if gen.speculative_config is not None:
        problems.append(problem("generator.speculative_config",
                                OmegaConf.to_container(gen.speculative_config, resolve=True),
                                "speculative decoding needs the MTP head: set trainer.mtp.enabled=true or leave it null"))
    if meg.mtp_num_layers is not None and meg.mtp_num_layers > 0:
        problems.append(problem("megatron.mtp_num_layers", meg.mtp_num_layers,
                                "contradicts trainer.mtp.enabled=false; leave it null or set 0"))
    if meg.mtp_loss_weight is not None and float(meg.mtp_loss_weight) != 0.0:
        problems.append(problem("megatron.mtp_loss_weight", meg.mtp_loss_weight,
                                "contradicts trainer.mtp.enabled=false; leave it null or set 0"))
    if problems:
        raise ConfigError(problems)
    with open_dict(cfg):
        meg.mtp_num_layers = 0
        meg.mtp_loss_weight = 0.0
    return cfg
