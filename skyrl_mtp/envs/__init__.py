"""skyrl_mtp.envs."""
