"""vLLM's per-token weight-version spans -> the project's (version, start, end) tuples (outputs.py)."""

from types import SimpleNamespace

from skyrl_mtp.rollout.outputs import weight_version_spans


def _span(v, s, e):
    return SimpleNamespace(version=v, start=s, end=e)


def test_numeric_labels_become_int_spans():
    out = SimpleNamespace(weight_versions=[_span("3", 0, 5), _span("4", 5, 9)])
    assert weight_version_spans(out) == [(3, 0, 5), (4, 5, 9)]


def test_an_unlabelled_engine_gives_none():
    assert weight_version_spans(SimpleNamespace(weight_versions=None)) is None
    assert weight_version_spans(SimpleNamespace()) is None
    # vLLM labels every engine "default" until update_weight_version is called
    assert weight_version_spans(SimpleNamespace(weight_versions=[_span("default", 0, 4)])) is None
