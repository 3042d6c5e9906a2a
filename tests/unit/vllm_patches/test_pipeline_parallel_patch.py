"""The pipeline-parallel patch's pure parts: the stage-agreement accounting, and its checks on vLLM's code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from skyrl_mtp.vllm_patches import pp_spec_accounting as acct


def _sched(new=(), cached=(), spec=None):
    """A SchedulerOutput-like object: new = [(req_id, computed, scheduled)], cached the same."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, _, n in [*new, *cached]},
        scheduled_spec_decode_tokens=spec or {})


def test_layout_follows_the_scheduler_output_and_places_the_samples():
    layout = acct.step_layout(_sched(new=[("a", 0, 7)], cached=[("b", 10, 3)], spec={"b": [5, 6]}))
    assert [(r.req_id, r.num_computed, r.num_scheduled, r.num_drafts) for r in layout] == [("a", 0, 7, 0),
                                                                                         ("b", 10, 3, 2)]
    # a prefill's sample follows the prompt; a decode step's follows its one non-draft input
    assert [r.first_sample_position for r in layout] == [7, 11]


def test_payload_round_trip_and_next_step_counts():
    k = 2
    layout = acct.step_layout(_sched(new=[("a", 0, 7)], cached=[("b", 10, 3), ("c", 20, 3), ("d", 30, 3)],
                                     spec={"b": [5, 6], "c": [1, 2], "d": [3, 4]}))
    kept = {"a": [100], "b": [5, 6, 101], "c": [102]}        # b accepted both drafts, c none; d unknown
    drafts = {"a": [7, 8], "b": [9, 10], "c": [11]}
    payload = acct.encode(layout, kept, drafts, k)
    assert payload.shape == (4, acct.payload_width(k)) and payload.dtype == torch.int64
    recs = acct.decode(payload, layout, k)
    assert sorted(recs) == ["a", "b", "c"]
    assert recs["b"].kept == (5, 6, 101) and recs["b"].drafts == (9, 10) and recs["c"].drafts == (11,)
    # next num_computed_tokens: prefill -> prompt length; decode -> start + kept - 1
    assert [recs[r].next_num_computed for r in "abc"] == [7, 13, 21]
    assert [recs[r].num_accepted_tokens for r in "abc"] == [1, 3, 1]


def test_a_step_that_kept_nothing_only_advances_by_its_tokens():
    layout = acct.step_layout(_sched(cached=[("p", 64, 64)]))   # a prefill chunk: its sample is discarded
    rec = acct.decode(acct.encode(layout, {"p": []}, {}, 1), layout, 1)["p"]
    assert rec.kept == () and rec.next_num_computed == 128 and rec.num_accepted_tokens == 1


def test_next_step_checks_name_the_disagreement():
    layout = acct.step_layout(_sched(cached=[("b", 10, 3)], spec={"b": [5, 6]}))
    rec = acct.decode(acct.encode(layout, {"b": [5, 101]}, {"b": [8, 9]}, 2), layout, 2)["b"]
    acct.check_next_step(rec, 12, [101], [8, 9])
    acct.check_next_step(rec, 12, None, [8])            # the scheduler may trim drafts near max_model_len
    acct.check_next_step(rec, 12, None, [8, -1])        # and mark invalid ones -1 (structured output)
    with pytest.raises(acct.PipelineAccountingError, match="num_computed_tokens=13, the last pipeline stage's "
                                                           "step implies 12"):
        acct.check_next_step(rec, 13, [101], [8, 9])
    with pytest.raises(acct.PipelineAccountingError, match="next input token 5 is not"):
        acct.check_next_step(rec, 12, [5], [8, 9])
    with pytest.raises(acct.PipelineAccountingError, match="scheduled drafts"):
        acct.check_next_step(rec, 12, [101], [9, 8])


def test_payload_refuses_more_tokens_than_k_allows():
    layout = acct.step_layout(_sched(cached=[("b", 10, 2)], spec={"b": [5]}))
    with pytest.raises(acct.PipelineAccountingError, match="exceed k=1"):
        acct.encode(layout, {"b": [1, 2, 3]}, {}, 1)
    with pytest.raises(acct.PipelineAccountingError, match="payload shape"):
        acct.decode(torch.zeros(2, acct.payload_width(1), dtype=torch.int64), layout, 1)


def test_patch_targets_match_the_installed_vllm():
    from skyrl_mtp.vllm_patches import pipeline_parallel as pp

    originals = pp.check_targets()
    assert set(originals) == set(pp.REPLACED) == set(pp._WRAPPERS)


@pytest.mark.parametrize("how", ["signature", "removed"])
def test_patch_fails_loudly_when_vllm_changes(monkeypatch, how):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from skyrl_mtp.vllm_patches import pipeline_parallel as pp

    if how == "signature":
        monkeypatch.setattr(GPUModelRunner, "_update_states", lambda self, output, extra: None)
        match = r"_update_states takes \('self', 'output'\), expected \('self', 'scheduler_output'\)"
    else:
        monkeypatch.delattr(GPUModelRunner, "_get_draft_token_ids_cpu")
        match = "_get_draft_token_ids_cpu is gone"
    with pytest.raises(pp.PipelineParallelPatchError, match=match):
        pp.check_targets()


def test_scheduler_override_checks_vllm():
    from skyrl_mtp.rollout import pipeline_parallel_scheduler as ps

    ps.check_scheduler()

    class Changed:
        def schedule(self):
            pass

        def update_from_output(self, output):
            pass

        def update_draft_token_ids(self, draft_token_ids):
            pass

    with pytest.raises(ps.PipelineParallelSchedulerError, match="update_from_output takes"):
        ps.check_scheduler(Changed)


def test_engine_config_installs_both_halves_only_for_pipeline_parallel_drafting(tmp_path):
    from skyrl_mtp.rollout.config import PIPELINE_PARALLEL_SCHEDULER_CLS, EngineConfig
    from skyrl_mtp.rollout.engine import engine_process_settings

    def cfg(**kw):
        return EngineConfig(model_path=str(tmp_path), **kw)

    pp2 = cfg(pipeline_parallel_size=2, num_speculative_tokens=2)
    assert pp2.managed_engine_kwargs("x")["scheduler_cls"] == PIPELINE_PARALLEL_SCHEDULER_CLS
    assert engine_process_settings(pp2).pipeline_parallel_patch is True
    off = cfg(pipeline_parallel_size=2, num_speculative_tokens=2, pipeline_parallel_patch=False)
    assert off.managed_engine_kwargs("x")["scheduler_cls"] is None and engine_process_settings(off).pipeline_parallel_patch is False
    # PP without drafting: both halves too (the scheduler's class also prepares the family in the engine core)
    nospec = cfg(pipeline_parallel_size=2)
    assert nospec.managed_engine_kwargs("x")["scheduler_cls"] == PIPELINE_PARALLEL_SCHEDULER_CLS
    assert engine_process_settings(nospec).pipeline_parallel_patch is True
    assert engine_process_settings(cfg(num_speculative_tokens=2)).pipeline_parallel_patch is False
    with pytest.raises(ValueError, match="adaptive_speculation=True is invalid: False with pipeline_parallel_size"):
        cfg(pipeline_parallel_size=2, num_speculative_tokens=2, adaptive_speculation=True)
    with pytest.raises(ValueError, match="model_runner='v2' is invalid: 'v1' with pipeline_parallel_size > 1"):
        cfg(pipeline_parallel_size=2, model_runner="v2")


@pytest.mark.parametrize("last_stage", [False, True])
def test_dummy_runs_build_the_targets_speculative_attention_metadata_on_every_stage(monkeypatch, last_stage):
    """_dummy_run (profiling, warm-up, CUDA graph capture) hides the drafter on stages without it, but the target's
    attention metadata keeps the speculative mode of the real steps (a hybrid model's GDN layers would otherwise be
    captured on their non-speculative path). The stand-in runner calls as vLLM's _dummy_run does (checked below)."""
    from skyrl_mtp.vllm_patches import pipeline_parallel as pp

    assert pp.SOURCE_TEXT[(pp.RUNNER, "_dummy_run")] == "use_spec_decode=self.speculative_config is not None"
    pp.check_targets()   # vLLM's _dummy_run still passes exactly that
    monkeypatch.setattr(pp, "_pp", lambda: SimpleNamespace(is_last_rank=last_stage))
    spec = object()

    class Runner:
        speculative_config = spec

        def _dummy_run(self, num_tokens):
            return self._build_attention_metadata(num_tokens, 1, 1,
                                                  use_spec_decode=self.speculative_config is not None)

        def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, use_spec_decode=False):
            return use_spec_decode, self.speculative_config   # what the metadata builders would see

    Runner._dummy_run = pp._WRAPPERS[(pp.RUNNER, "_dummy_run")](Runner._dummy_run)
    Runner._build_attention_metadata = pp._WRAPPERS[(pp.RUNNER, "_build_attention_metadata")](
        Runner._build_attention_metadata)
    runner = Runner()
    assert runner._dummy_run(8) == (True, spec if last_stage else None)
    # a real step passes use_spec_decode itself; outside a dummy run nothing is forced
    assert runner._build_attention_metadata(8, 2, 4, use_spec_decode=False) == (False, spec if last_stage else None)
    assert runner.speculative_config is spec
