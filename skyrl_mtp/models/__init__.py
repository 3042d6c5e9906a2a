"""skyrl_mtp.models."""
