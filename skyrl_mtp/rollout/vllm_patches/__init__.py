"""Patches of vLLM's own code, one module each; every patch checks that what it replaces is still there (and
still does what the patch assumes) and fails loudly when it is not."""
