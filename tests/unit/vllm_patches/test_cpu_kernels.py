"""vLLM's CPU kernels are loaded only through vLLM's platform, and the AVX2 override really switches builds.

A direct `import vllm._C` runs AVX-512 code and dies with SIGILL on AVX2-only CPUs, so the project
must never do it. The override (`make test-avx2`) is what proves the AVX2 path on an AVX-512 host:
run in a fresh interpreter, it must make vLLM map `_C_AVX2` and its ops must work.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_mtp.vllm_patches import cpu_kernels as kern

REPO = Path(__file__).resolve().parents[3]
DIRECT_IMPORT = re.compile(r"(import\s+vllm\._C|from\s+vllm\s+import\s+_C|from\s+vllm\._C|"
                           r"importorskip\(\s*[\"']vllm\._C|import_module\(\s*[\"']vllm\._C)")

PROBE = """
import json, torch
from skyrl_mtp.vllm_patches import cpu_kernels as k
build = k.load()
logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
toks = torch.ops._C.fused_gumbel_argmax(logits, torch.tensor([1, 2, 3]))
print(json.dumps({"build": build, "expected": k.expected_build(), "avx512": torch.cpu._is_avx512_supported(),
                  "tokens": [int(t) for t in toks]}))
"""


def _probe(isa: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (kern.ISA_OVERRIDE_ENV, "ATEN_CPU_CAPABILITY")}
    if isa:
        env[kern.ISA_OVERRIDE_ENV] = isa
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "scripts" / "cpu_isa"), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nothing_imports_a_vllm_kernel_build_directly():
    offenders = []
    for top in ("skyrl_mtp", "tests", "benchmarks", "scripts"):
        for path in (REPO / top).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if DIRECT_IMPORT.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "load vLLM's kernels with skyrl_mtp.vllm_patches.cpu_kernels.load():\n" + "\n".join(offenders)


def test_the_pattern_catches_direct_imports():
    for line in ("import vllm._C", "import vllm._C_AVX512  # x", 'pytest.importorskip("vllm._C")',
                 "from vllm import _C", 'importlib.import_module("vllm._C_AVX2")'):
        assert DIRECT_IMPORT.search(line), line
    assert not DIRECT_IMPORT.search("from vllm.platforms import current_platform")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see which build is mapped")
def test_load_maps_the_build_vllm_picks_for_this_cpu():
    pytest.importorskip("vllm")
    native = _probe(None)
    assert native["build"] == native["expected"], native
    forced = _probe("avx2")
    assert forced["build"] == "_C_AVX2" and forced["avx512"] is False, forced
    # both builds sample a valid token per row; their values may differ (never compared across builds)
    assert all(0 <= t < 50 for t in native["tokens"] + forced["tokens"])


def test_override_rejects_an_isa_it_cannot_emulate():
    with pytest.raises(kern.IsaOverrideError, match=kern.ISA_OVERRIDE_ENV + r"='avx512'.*allowed: \('avx2',\)"):
        kern.apply_isa_override("avx512")
