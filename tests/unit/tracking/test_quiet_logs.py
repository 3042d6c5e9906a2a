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


def test_the_driver_hides_the_triton_notice_vllm_logs_while_it_is_imported(tmp_path):
    """The launcher's process: quiet_library_logs before vLLM's modules are imported (it imports vllm.logger
    itself, before the config path is in the environment), then vLLM's Triton check runs and finds no CPU backend."""
    code = textwrap.dedent(f"""
        from skyrl_mtp.tracking.quiet_logs import quiet_library_logs
        quiet_library_logs(False, {str(tmp_path)!r})
        from vllm.triton_utils import HAS_TRITON
        print("HAS_TRITON", HAS_TRITON)
        from vllm.logger import init_logger
        init_logger("vllm.some_module").warning("a real problem")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HAS_TRITON False" in out.stdout          # vLLM took the branch that logs the notice
    assert "Triton is installed, but doesn't include CPU backend" not in out.stdout + out.stderr
    assert "a real problem" in out.stdout + out.stderr


def test_ray_workers_hide_the_import_time_notices_unless_verbose():
    import importlib

    from skyrl_mtp.tracking.quiet_logs import hide_import_warnings, ray_init_kwargs

    assert "runtime_env" not in ray_init_kwargs(True)
    hook = ray_init_kwargs(False)["runtime_env"]["worker_process_setup_hook"]   # Ray imports it by this name
    module, _, name = hook.rpartition(".")
    assert getattr(importlib.import_module(module), name) is hide_import_warnings
