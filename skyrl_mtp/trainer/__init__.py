"""skyrl_mtp.trainer."""
