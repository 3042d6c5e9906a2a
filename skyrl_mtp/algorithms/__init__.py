"""skyrl_mtp.algorithms."""
