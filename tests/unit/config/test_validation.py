"""Every validation error names the key, the value and what is allowed."""

import pytest

from skyrl_mtp.config import ConfigError, load_config

BASE = ["recipe=tiny_dapo"]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(BASE + list(overrides))
    return str(info.value)


def test_tiny_recipe_is_valid():
    cfg = load_config(BASE)
    assert cfg.trainer.mtp.num_speculative_tokens == 2


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.mtp.num_speculative_tokens=0", "trainer.mtp.num_speculative_tokens=0 is invalid: must be >= 1"),
        ("trainer.mtp.loss_type=kl", "trainer.mtp.loss_type='kl' is invalid: must be one of ['soft_ce', 'hard_ce', 'topk_soft_ce', 'tv']"),
        ("megatron.mtp_loss_topk=0", "megatron.mtp_loss_topk=0 is invalid: must be >= 1"),
        ("megatron.ep=0", "megatron.ep=0 is invalid: must be >= 1"),
        ("megatron.ep=2", "megatron.ep=2 is invalid: must divide megatron.tp * megatron.dp = 1"),
        ("megatron.moe_aux_loss_coeff=-0.1", "megatron.moe_aux_loss_coeff=-0.1 is invalid: must be >= 0.0"),
        ("megatron.mtp_num_layers=-1", "megatron.mtp_num_layers=-1 is invalid: must be >= 0"),
        ("megatron.mtp_loss_chunk_size=-1", "megatron.mtp_loss_chunk_size=-1 is invalid: must be an int >= 0 "
         "(tokens per chunk of the draft loss; 0 = one chunk) or 'auto'"),
        ("megatron.mtp_loss_chunk_size=big", "megatron.mtp_loss_chunk_size='big' is invalid: must be an int >= 0"),
        ("megatron.mtp_loss_chunk_size=1.5", "megatron.mtp_loss_chunk_size=1.5 is invalid: must be an integer or "
         "a string"),
        ("trainer.mtp.loss_weight=-0.5", "trainer.mtp.loss_weight=-0.5 is invalid: must be >= 0.0"),
        ("megatron.policy_optimizer.lr=-1", "megatron.policy_optimizer.lr=-1.0 is invalid: must be >= 0"),
        ("generator.sampling.top_p=1.5", "generator.sampling.top_p=1.5 is invalid: must be in (0, 1]"),
        ("generator.sampling.max_tokens=0", "generator.sampling.max_tokens=0 is invalid: must be >= 1"),
        ("generator.sampling.temperature=-1", "generator.sampling.temperature=-1.0 is invalid: must be >= 0.0"),
        ("algorithm.dual_clip_c=0.5", "algorithm.dual_clip_c=0.5 is invalid: must be > 1 or null"),
        ("algorithm.loss_reduction=sum", "algorithm.loss_reduction='sum' is invalid: must be one of"),
        ("environment.name=chess", "environment.name='chess' is invalid: must be one of ['math', 'search']"),
        ("model.path=/does/not/exist", "model.path='/does/not/exist' is invalid: path does not exist"),
        ("data.train_files=[/no/such.parquet]", "data.train_files[0]='/no/such.parquet' is invalid: path does not exist"),
        ("generator.num_engines=0", "generator.num_engines=0 is invalid: must be >= 1"),
        ("generator.pipeline_parallel_size=0", "generator.pipeline_parallel_size=0 is invalid: must be >= 1"),
        ("generator.model_runner=v3", "generator.model_runner='v3' is invalid: must be one of ['v1', 'v2']"),
        ("generator.model_runner=v2", "generator.model_runner='v2' is invalid: 'v1' on CPU engines "
         "(trainer.placement.gpus_per_engine=0): vLLM's V2 runner needs Triton on a GPU"),
        ("trainer.placement.gpu_memory_gb=0", "trainer.placement.gpu_memory_gb=0.0 is invalid: must be > 0"),
    ],
)
def test_single_errors(override, expected):
    assert expected in _error(override)


def test_engine_pipeline_parallelism_with_fixed_k_only():
    assert "pipeline_parallel_size" not in _error("generator.pipeline_parallel_size=2", "megatron.tp=3")
    msg = _error("generator.pipeline_parallel_size=2", "trainer.mtp.num_speculative_tokens=auto")
    assert "generator.pipeline_parallel_size=2 is invalid: must be 1 with trainer.mtp.num_speculative_tokens=auto" in msg


def test_impossible_parallel_layout():
    msg = _error("megatron.tp=2", "trainer.placement.policy_num_workers=3")
    assert ("trainer.placement.policy_num_workers=3 is invalid: must equal the policy's parallel layout "
            "megatron.tp*pp*cp*dp = 2*1*1*1 = 2") in msg
    assert len(msg.splitlines()) == 1   # one problem


def test_batch_not_divisible_by_dp():
    msg = _error("megatron.dp=3", "trainer.placement.policy_num_workers=3", "trainer.train_batch_size=4",
                 "generator.n_samples_per_prompt=4", "trainer.policy_mini_batch_size=2")
    assert "trainer.train_batch_size=4 is invalid" in msg and "divisible by megatron.dp=3" in msg


def test_unknown_key_lists_allowed_keys_and_suggests():
    msg = _error("trainer.mtp.num_speculative_token=3")
    assert "trainer.mtp.num_speculative_token=3: unknown key (did you mean 'num_speculative_tokens'?)" in msg
    assert "allowed keys under 'trainer.mtp': ['draft_in_rollouts', 'draft_sample_method', 'enabled', 'explore_budget', 'idle_head_train_budget', 'loss_depth_decay', 'loss_position_fraction', 'loss_type', 'loss_weight', 'max_speculative_tokens', 'num_speculative_tokens'" in msg


def test_unknown_top_level_key():
    assert "bogus=1: unknown key" in _error("bogus=1")


def test_wrong_type_names_key():
    assert "trainer.seed" in _error("trainer.seed=abc")


def test_all_problems_reported_together():
    msg = _error("megatron.mtp_loss_topk=0", "generator.num_engines=0", "trainer.total_steps=0")
    for key in ("megatron.mtp_loss_topk=0", "generator.num_engines=0", "trainer.total_steps=0"):
        assert key in msg


def test_unknown_recipe_lists_available():
    with pytest.raises(ConfigError, match=r"recipe='nope' is invalid: no such recipe; available: \[.*'tiny_dapo'"):
        load_config(["recipe=nope"])


def test_missing_recipe_dir():
    with pytest.raises(ConfigError, match="recipe_dir='/nonexistent' is invalid: directory does not exist"):
        load_config(["recipe=tiny_dapo", "recipe_dir=/nonexistent"])


def test_user_recipe_dir_with_bad_key(tmp_path):
    (tmp_path / "mine.yaml").write_text("trainer:\n  total_step: 3\n")
    with pytest.raises(ConfigError, match=r"recipe mine .*trainer.total_step: unknown key \(did you mean 'total_steps'\?\)"):
        load_config(["recipe=mine", f"recipe_dir={tmp_path}"])


def test_user_recipe_dir_works(tmp_path):
    (tmp_path / "mine.yaml").write_text("trainer:\n  total_steps: 3\ndata:\n  synthetic: arithmetic\n")
    cfg = load_config(["recipe=mine", f"recipe_dir={tmp_path}", "trainer.seed=7"])
    assert cfg.trainer.total_steps == 3 and cfg.trainer.seed == 7


def test_search_env_needs_a_retriever():
    msg = _error("environment.name=search")
    assert "environment.search.retriever_url=None is invalid" in msg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algorithm.eps_clip_low=2"], "algorithm.eps_clip_low=2.0 is invalid: must be in (0, 1)"),
        (["algorithm.eps_clip_low=0"], "algorithm.eps_clip_low=0.0 is invalid: must be in (0, 1)"),
        (["algorithm.eps_clip_high=0"], "algorithm.eps_clip_high=0.0 is invalid: must be > 0"),
        (["algorithm.dual_clip_c=1"], "algorithm.dual_clip_c=1.0 is invalid: must be > 1 or null"),
        (["generator.n_samples_per_prompt=1"], "generator.n_samples_per_prompt=1 is invalid: must be >= 2 with "
                                               "algorithm.advantage_estimator=grpo"),
        (["trainer.mtp.loss_type=kl"], "trainer.mtp.loss_type='kl' is invalid: must be one of"),
        (["megatron.pp=3", "trainer.placement.policy_num_workers=3"],
         "megatron.pp=3 is invalid: must divide the model's 2 decoder layers"),
        (["megatron.head_optimizer.lr_schedule=step"], "megatron.head_optimizer.lr_schedule='step' is invalid"),
        (["logger.wandb_mode=sometimes"], "logger.wandb_mode='sometimes' is invalid: must be one of"),
        (["model.tiny.heads=3"], "model.tiny.heads=3 is invalid: a divisor of hidden=128"),
    ],
)
def test_one_error_per_bad_key_naming_the_key_written(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(BASE + overrides)
    assert expected in str(info.value)
    assert len(info.value.problems) == 1, info.value.problems   # never twice, never blamed on another key


def test_v2_runner_cannot_serve_auto_k():
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=tiny_dapo", "generator.model_runner=v2", "trainer.mtp.num_speculative_tokens=auto",
                     "trainer.placement.gpus_per_engine=1", "trainer.placement.gpus_per_policy_worker=1"])
    assert info.value.problems == ["generator.model_runner='v2' is invalid: 'v1' with "
                                   "trainer.mtp.num_speculative_tokens=auto: the adaptive-k hook needs V1's "
                                   "propose_draft_token_ids and drafter"]
