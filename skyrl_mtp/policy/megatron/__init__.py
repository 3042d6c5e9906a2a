"""skyrl_mtp.policy.megatron."""
