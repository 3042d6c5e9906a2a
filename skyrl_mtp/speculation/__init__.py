"""Adaptive speculation (`trainer.mtp.num_speculative_tokens=auto`): the policy that picks k per engine step and its hook into vLLM's scheduler."""
