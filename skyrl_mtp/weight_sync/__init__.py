"""Weight transfer from the policy to the vLLM engines through vLLM's own RL weight-transfer API.

vLLM 0.32 ships the engine-side lifecycle (`init_weight_transfer_engine`, `start_weight_update` /
`start_draft_weight_update`, `update_weights`, `finish_weight_update`), trainer-side engines that stream a
`WeightSource`, and two GPU transports (`nccl`, `ipc`). This package adds what the project needs on top:
a CPU transport registered in both of vLLM's factories (so CI runs the GPU call sequence), the one seam
that picks the transport, the policy's export as a `WeightSource`, and the round that pushes the main
model and the MTP drafter after checking every name, shape and dtype.
"""

from skyrl_mtp.weight_sync.registration import CPU_BACKEND, register_cpu_transport

__all__ = ["CPU_BACKEND", "register_cpu_transport"]
