"""Patches of vLLM, one module each; every patch checks that what it replaces is still there and fails loudly."""
