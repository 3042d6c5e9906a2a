"""Drafter kinds other than the model's own MTP layers: small draft models trained beside a target that ships no
draft head, each computing exactly what the vLLM drafter of its speculative method computes, so that what the
trainer predicts for a drafter is what vLLM measures when it serves the export.

- eagle3.py: the EAGLE-3 drafter (vLLM's ``method: eagle3`` with its Llama drafter): its config and module;
- eagle3_export.py: the checkpoint vLLM loads for it, and back;
- greedy_acceptance.py: greedy drafting simulated on known sequences, as vLLM's engine steps run it.
"""
