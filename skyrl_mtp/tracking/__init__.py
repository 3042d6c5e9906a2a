"""skyrl_mtp.tracking."""
