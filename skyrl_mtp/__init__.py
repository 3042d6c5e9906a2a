"""skyrl-mtp: RL post-training with MTP draft heads."""
__version__ = "0.1.0"
