"""skyrl_mtp.rollout."""
