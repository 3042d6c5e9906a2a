"""Start-up hook for proving vLLM's AVX2 kernel path on a host that has AVX-512.

With this directory on PYTHONPATH and SKYRL_MTP_VLLM_CPU_ISA=avx2 in the environment (`make
test-avx2`), every Python process (pytest, Ray workers, vLLM's engine-core and worker subprocesses)
masks AVX-512 out of torch's CPU capability report before anything imports vLLM, so vLLM maps its
`_C_AVX2` kernels exactly as it does on an AVX2-only CPU. Without the variable it does nothing.
"""

import os

if os.environ.get("SKYRL_MTP_VLLM_CPU_ISA"):
    from skyrl_mtp.vllm_patches.cpu_kernels import apply_isa_override

    apply_isa_override(os.environ["SKYRL_MTP_VLLM_CPU_ISA"])
