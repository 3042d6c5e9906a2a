"""skyrl_mtp.policy."""
