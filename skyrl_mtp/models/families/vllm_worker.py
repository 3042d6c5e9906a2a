"""A vLLM ``worker_extension_cls`` that only prepares the served model family in each worker process.

vLLM on CPU spawns its engine-core and worker processes, so what ``ModelFamily.prepare_vllm_import`` did
in the parent (e.g. the torchvision-free Qwen3.5 import) must be redone there before the model loads;
vLLM imports the worker extension class first. The project's engines get this through
rollout/worker_extension.py; a bare ``vllm.LLM`` (tests, scripts) names this class instead.
"""

from skyrl_mtp import engine_process
from skyrl_mtp.models.families import prepare_vllm_worker

PREPARED_FAMILY = prepare_vllm_worker(engine_process.current().model_family)


class FamilyWorkerExtension:
    """No methods: importing this module is the point."""
