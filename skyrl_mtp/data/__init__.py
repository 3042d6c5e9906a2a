"""skyrl_mtp.data."""
