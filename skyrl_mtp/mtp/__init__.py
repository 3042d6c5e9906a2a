"""skyrl_mtp.mtp."""
