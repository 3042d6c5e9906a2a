"""The RL loop end to end on CPU: real Ray, Megatron and vLLM, launched through the CLI like `make run`.

Run A trains a few steps of the tiny DAPO recipe with MTP speculative decoding and checkpoints. Run B resumes a
copy of A from its step-2 checkpoint, must reproduce A's step 3, then loses its engine in step 4's rollout: the
run stops naming the engine and leaves its last checkpoint untouched. Run A0 repeats A with the draft loss weight
0 and trainer.async_rl.mode=fully_async at max_staleness 0: drafting with k = 3 in both, the policy is untouched by
draft training (bitwise, thanks to draft-invariant sampling) and fully async at staleness 0 is sync, step for step
(one run checks both: either difference would show). Two more runs do the same one step off
(trainer.async_rl.mode=one_step_off) with the TIS correction reading the engine's logprobs, and a copy of one of
them resumes from its step-2 checkpoint (which holds the batch generated ahead) and repeats step 3. The runs go two
at a time (each keeps about one core busy): A with the first one-step-off run, then B with A0, then the second
one-step-off run with the resumed copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from skyrl_mtp.tracking.compare import (
    VOLATILE,  # identical metrics across runs exclude wall-clock ones
    compare_policy_runs,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["recipe=tiny_dapo", "trainer.train_batch_size=4", "generator.n_samples_per_prompt=4",
         "trainer.policy_mini_batch_size=2", "generator.sampling.max_tokens=24", "generator.eval_sampling.max_tokens=24",
         "trainer.eval_batch_size=8", "megatron.head_optimizer.lr=1.0e-2", "trainer.progress_bar=false",
         "algorithm.dynamic_sampling.max_gen_rounds=1"]


def metrics(run: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(s in k for s in VOLATILE)}


RUN_A = [*SMALL, "trainer.total_steps=3", "trainer.checkpoint.every_n_steps=2", "trainer.eval_every_n_steps=3",
         "trainer.mtp.num_speculative_tokens=3", "trainer.mtp.loss_type=topk_soft_ce", "megatron.mtp_loss_topk=16"]


OSF = [*SMALL, "trainer.total_steps=3", "trainer.checkpoint.every_n_steps=2", "trainer.eval_every_n_steps=0",
       "trainer.async_rl.mode=one_step_off", "algorithm.off_policy.correction=tis", "logger.plots=false"]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, cli) -> dict[str, Path]:
    """Run A and the one-step-off run with the draft loss weight 1, side by side (each keeps about one core busy)."""
    root = tmp_path_factory.mktemp("rl")
    runs = {"a": (root / "a", RUN_A), "osf1": (root / "osf1", [*OSF, "trainer.mtp.loss_weight=1.0"])}
    with ThreadPoolExecutor(2) as pool:
        procs = {k: pool.submit(cli, [*args, f"trainer.run_dir={run}"]) for k, (run, args) in runs.items()}
        for proc in procs.values():
            assert proc.result().returncode == 0, proc.result().stderr[-4000:]
    return {k: run for k, (run, _) in runs.items()}


@pytest.fixture(scope="module")
def run_a(first_runs) -> Path:
    return first_runs["a"]


def test_run_writes_metrics_plots_checkpoints_and_acceptance_rises(run_a):
    m = metrics(run_a)
    assert sorted(m) == [0, 1, 2, 3]                      # step 0 = eval before training
    for step in (1, 2, 3):
        for key in ("reward/mean", "rollout/train/draft_acceptance_rate", "rollout/train/mean_acceptance_length",
                    "policy/loss", "policy/grad_norm", "mtp/loss", "mtp/grad_norm", "timing/generate_s",
                    "timing/train_s", "timing/sync_s", *[f"rollout/train/draft_acceptance_rate_pos_{i}" for i in (1, 2, 3)]):
            assert key in m[step], (step, key)
    acc = [m[s]["rollout/train/draft_acceptance_rate_pos_1"] for s in (1, 2, 3)]
    assert acc[0] < 0.1, acc                               # the head starts untrained
    assert acc[-1] > acc[0] + 0.05, acc                    # ... and catches up with the policy
    assert m[3]["rollout/eval/draft_acceptance_rate_pos_1"] > m[0]["rollout/eval/draft_acceptance_rate_pos_1"]
    assert m[3]["mtp/loss"] < m[1]["mtp/loss"]
    for png in ("reward.png", "acceptance_per_position.png", "mean_acceptance_length.png"):
        assert (run_a / "plots" / png).stat().st_size > 1000
    for step in (2, 3):
        ck = run_a / "checkpoints" / f"step_{step}"
        assert (ck / "COMPLETE").exists() and (ck / "train_state_rank0.pt").exists()
        assert (ck / "hf" / "model.safetensors").exists() and (ck / "hf" / "config.json").exists()
        assert any((ck / "draft_head").glob("*.safetensors"))


def test_cli_overrides_reach_the_engines_and_the_loss(run_a):
    info = json.loads((run_a / "run_info.json").read_text())
    assert info["engine_speculative_tokens"] == [3]                 # read back from the running vLLM engine
    assert info["policy_worker_config"]["mtp_loss_type"] == "topk_soft_ce"   # read back from the Megatron actor
    assert info["policy_worker_config"]["mtp_loss_topk"] == 16
    assert info["policy_worker_config"]["layer_impl"] == "local"          # megatron.layer_impl, the CPU default


def test_actors_run_in_their_placement_group_bundles(run_a):
    # the plan's bundles are reserved as one placement group; each actor reports the group it runs in
    pl = json.loads((run_a / "run_info.json").read_text())["placement"]
    assert pl["engine_actors_in"] == [pl["placement_group"]] and pl["policy_actors_in"] == [pl["placement_group"]]
    assert pl["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}] and pl["engine_bundles"] == [0] and pl["policy_bundles"] == [1]


@pytest.fixture(scope="module")
def after_a(run_a, tmp_path_factory, cli) -> dict:
    """The two runs that start from run A, side by side (each keeps about one core busy): B resumes a copy of A and
    loses its engine in step 4; A0 repeats A with the draft loss weight 0 (plots off: nothing reads them)."""
    root = tmp_path_factory.mktemp("after_a")
    run_b, run_off = root / "b", root / "a0"
    shutil.copytree(run_a, run_b)
    shutil.rmtree(run_b / "checkpoints" / "step_3")
    before = _digest(run_b / "checkpoints" / "step_2")
    # the learning rate is constant (no warmup): running to step 5 instead of 3 leaves step 3 as it was
    args_b = [a if not a.startswith("trainer.total_steps=") else "trainer.total_steps=5" for a in RUN_A]
    with ThreadPoolExecutor(2) as pool:
        b = pool.submit(cli, [*args_b, f"trainer.run_dir={run_b}"],
                        env_extra={"SKYRL_MTP_FAULT_KILL_ENGINE_AT_STEP": "4"})
        off = pool.submit(cli, [*RUN_A, f"trainer.run_dir={run_off}", "trainer.mtp.loss_weight=0.0", "logger.plots=false",
                                "trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=0"])
        return {"b": (run_b, before, b.result()), "a0": (run_off, off.result())}


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def test_resume_continues_with_identical_next_step_then_engine_death_is_named_and_checkpoint_survives(run_a, after_a):
    run_b, before, proc = after_a["b"]
    assert "resumed from" in proc.stderr and "step_2" in proc.stderr
    a, b = metrics(run_a), metrics(run_b)
    assert sorted(b) == [0, 1, 2, 3]
    assert stable(b[3]) == stable(a[3])
    # then the engine dies in step 4's rollout: named, exit status 1, the last checkpoint (step 2) untouched
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "inference engine" in proc.stderr and "died during the rollout of step 4" in proc.stderr
    assert f"the last complete checkpoint is {run_b / 'checkpoints' / 'step_2'} and was not modified" in proc.stderr
    assert _digest(run_b / "checkpoints" / "step_2") == before
    assert not (run_b / "checkpoints" / "step_4").exists()


def test_draft_training_leaves_the_policy_bitwise_untouched_and_fully_async_at_staleness_0_is_sync(run_a, after_a):
    # Spec decoding ON in both runs: with the draft loss weight 1 (run A) the head learns and drafts get
    # accepted, with weight 0 it stays random. Draft-invariant sampling makes the seeded T=1 rollouts
    # independent of the drafts, so everything the policy sees and does must be bitwise equal. A0 also runs
    # fully async at max_staleness 0: its producer thread generates each batch once the previous step's weights
    # are synced, which must change nothing either.
    run_off, proc = after_a["a0"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((run_off / "run_info.json").read_text())["engine_speculative_tokens"] == [3]
    problems, summary = compare_policy_runs(run_a, run_off)
    # fully async's own metrics exist in A0 only
    assert problems and all("async/" in p and " vs " in p and p.startswith("step ") for p in problems), problems[:10]
    problems = [p for p in problems if "async/" not in p]
    assert problems == [], problems[:10]
    m0 = metrics(run_off)
    for step in (1, 2, 3):
        assert m0[step]["async/staleness_max"] == 0.0 and m0[step]["async/sync_under_requests"] == 0.0
        assert m0[step]["async/version"] == step - 1
    # steps 0-3: step 0 and 3 hold evals, compared too
    assert summary["steps"] == 4 and summary["checkpoint"] == "step_3" and summary["trunk_tensors_compared"] > 10
    on, off = metrics(run_a), metrics(run_off)
    for step in (1, 2, 3):
        assert "policy/loss" in on[step] and "reward/mean" in on[step]
        assert on[step]["mtp/grad_norm"] > 0
    acc = "rollout/train/draft_acceptance_rate"
    assert on[3][acc] > off[3][acc] + 0.05, (on[3][acc], off[3][acc])   # the drafts really differed
    w_on = load_file(str(run_a / "checkpoints/step_3/hf/model.safetensors"))
    w_off = load_file(str(run_off / "checkpoints/step_3/hf/model.safetensors"))
    mtp = [k for k in w_on if ".mtp_layers." in k]
    assert mtp and any(not w_on[k].equal(w_off[k]) for k in mtp)


def test_one_step_off_is_one_step_stale_resumes_as_unbroken_and_leaves_the_policy_bitwise_untouched(first_runs,
                                                                                                   tmp_path, cli):
    # The next batch is generated with the weights from before the current step's update while it trains
    # (staleness 1 from step 2 on); the TIS correction weights the loss with the engine's logprobs. With the
    # draft loss weight 1 and 0 every policy metric (off_policy/* included) and trunk tensor must be equal. A copy
    # of the weight-1 run cut back to its step-2 checkpoint (as if killed after writing it) resumes with the batch
    # that checkpoint holds and must repeat step 3.
    runs = {1.0: first_runs["osf1"], 0.0: tmp_path / "w0"}
    resumed = tmp_path / "resumed"
    shutil.copytree(runs[1.0], resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    with ThreadPoolExecutor(2) as pool:   # side by side: each keeps about one core busy
        procs = [pool.submit(cli, [*OSF, f"trainer.run_dir={runs[0.0]}", "trainer.mtp.loss_weight=0.0"]),
                 pool.submit(cli, [*OSF, f"trainer.run_dir={resumed}", "trainer.mtp.loss_weight=1.0"])]
        for proc in procs:
            assert proc.result().returncode == 0, proc.result().stderr[-4000:]
    assert "resumed from" in procs[1].result().stderr
    assert (resumed / "checkpoints" / "step_2" / "pending_rollouts.pkl").exists()
    assert stable(metrics(resumed)[3]) == stable(metrics(runs[1.0])[3])
    on, off = metrics(runs[1.0]), metrics(runs[0.0])
    assert [on[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [on[s]["async/staleness_mean"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in (1, 2, 3):   # every batch comes from the producer thread
        assert on[step]["timing/background/generate_s"] > 0 and on[step]["timing/wait_rollout_s"] >= 0
    for step in (1, 2):      # the next batch was generated during this step: the engines were not idle all along
        assert on[step]["timing/engines_idle_s"] < on[step]["timing/step_s"]
    assert on[3]["timing/engines_idle_s"] == on[3]["timing/step_s"]   # the last step generates nothing
    # the correction read the engine's logprobs of batches one update behind: weights differ from 1
    assert all(on[s]["off_policy/log_ratio_abs_mean"] > 0 for s in (2, 3))
    problems, summary = compare_policy_runs(runs[1.0], runs[0.0])
    assert problems == [], problems[:10]
    assert summary["steps"] == 3 and summary["checkpoint"] == "step_3" and summary["trunk_tensors_compared"] > 10
    acc = "rollout/train/draft_acceptance_rate"
    assert on[3][acc] > off[3][acc] + 0.05, (on[3][acc], off[3][acc])   # the drafts really differed


# a short warm start of their own (the tiny llama's, built once by whichever run gets there first)
EXTERNAL = [*SMALL, "model.tiny.family=llama", "trainer.warm_start.steps=50", "trainer.total_steps=3",
            "trainer.checkpoint.every_n_steps=3", "trainer.eval_every_n_steps=0", "logger.plots=false"]


@pytest.fixture(scope="module")
def external_runs(tmp_path_factory, cli) -> dict[str, Path]:
    """The tiny llama (no MTP layers) with an EAGLE-3 and with a DFlash drafter, side by side."""
    root = tmp_path_factory.mktemp("rl")
    with ThreadPoolExecutor(2) as pool:
        procs = {k: pool.submit(cli, [*EXTERNAL, f"trainer.drafter.kind={k}", f"trainer.run_dir={root / k}"])
                 for k in ("eagle3", "dflash")}
        for proc in procs.values():
            assert proc.result().returncode == 0, proc.result().stderr[-4000:]
    return {k: root / k for k in procs}


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_an_external_drafter_trains_beside_the_policy_and_the_engines_draft_with_each_update(external_runs, kind):
    """trainer.drafter.kind=eagle3 / dflash on the tiny llama: the engines start on the run's seeded drafter export
    and draft with vLLM's method of that name; each step's sync carries the drafter trained in the policy worker (its
    loss falls; EAGLE-3's acceptance climbs within the 3 steps); the checkpoint holds the drafter, exported as vLLM
    loads it; the policy's metrics are the same with either drafter (it never sees them)."""
    from skyrl_mtp.drafters.dflash_export import load_dflash
    from skyrl_mtp.drafters.eagle3_export import load_eagle3

    run = external_runs[kind]
    info = json.loads((run / "run_info.json").read_text())
    assert info["engine_config"]["speculative_config"] == {
        "method": kind, "model": str(run / "drafter_init"), "num_speculative_tokens": 2}
    assert info["policy_worker_config"]["drafter_kind"] == kind and info["policy_worker_config"]["mtp_num_layers"] == 0
    m = metrics(run)
    acc = [m[s]["rollout/train/draft_acceptance_rate_pos_1"] for s in (1, 2, 3)]
    assert acc[0] < 0.15 and m[3]["mtp/grad_norm"] > 0, acc
    if kind == "eagle3":
        assert acc[-1] > acc[0] + 0.1 and m[3]["mtp/loss"] < m[1]["mtp/loss"], acc
    else:   # on ~170 trained slots a step DFlash's loss falls first, its acceptance climbs later (docs/drafters.md);
        # that the engines draft with each synced DFlash drafter is test_dflash_engine.py's (counters == simulation)
        assert m[3]["mtp/loss"] < 0.8 * m[1]["mtp/loss"] and m[3]["rollout/train/num_drafts"] > 0, m[3]
    load = load_eagle3 if kind == "eagle3" else load_dflash
    initial, _ = load(run / "drafter_init")
    trained, cfg = load(run / "checkpoints" / "step_3" / "draft_head")
    assert (cfg.aux_layer_ids if kind == "eagle3" else cfg.target_layer_ids) == ((0, 1, 2) if kind == "eagle3" else (1,))
    moved = {n: float((t - initial.state_dict()[n]).abs().max()) for n, t in trained.state_dict().items()}
    assert min(moved.values()) > 0, moved
    other = metrics(external_runs["dflash" if kind == "eagle3" else "eagle3"])
    for step in (1, 2, 3):
        assert {k: v for k, v in m[step].items() if k.startswith(("policy/", "reward/"))} == \
            {k: v for k, v in other[step].items() if k.startswith(("policy/", "reward/"))}
