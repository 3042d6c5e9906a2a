"""Every patch this project applies to vLLM, one module each; each checks that what it replaces is still there and fails loudly when it is not."""
