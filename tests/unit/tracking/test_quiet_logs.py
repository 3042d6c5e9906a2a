"""logger.verbose=false: vLLM logs through its own config at WARNING with the known harmless ones dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from skyrl_mtp.tracking.quiet_logs import HarmlessFilter, quiet_env, vllm_logging_config


def test_verbose_changes_nothing():
    assert quiet_env(True, "/x.json") == {}
    env = quiet_env(False, "/x.json")
    assert env["VLLM_LOGGING_CONFIG_PATH"] == "/x.json" and env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert "ignore:full scope is deprecated:UserWarning" in env["PYTHONWARNINGS"]


def test_filter_drops_only_known_harmless_messages():
    import logging

    def rec(msg):
        return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, msg, None, None)

    f = HarmlessFilter()
    assert not f.filter(rec("Model Runner V2 requires Triton; using the V1 model runner instead."))
    assert not f.filter(rec("RotaryEmbedding: Failed to load weights"))
    assert f.filter(rec("KV cache is full; preempting requests"))


def test_a_vllm_process_with_the_config_prints_only_real_warnings(tmp_path):
    path = tmp_path / "vllm_logging.json"
    path.write_text(json.dumps(vllm_logging_config()))
    code = textwrap.dedent("""
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging, init_logger
        configure_logging(LoggingConfig())   # what an engine does at start: reads VLLM_LOGGING_CONFIG_PATH
        log = init_logger("vllm.some_module")
        log.info("an info line")
        log.warning("Model Runner V2 requires Triton; using the V1 model runner instead.")
        log.warning("a real problem")
    """)
    env = {**os.environ, **quiet_env(False, str(path))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "a real problem" in text
    assert "an info line" not in text and "Model Runner V2" not in text
