"""LoRA-aware policy-to-vLLM weight sync for OpenRLHF, vendored as a run-time patch.

This package is installed (editable) under its own name by scripts/setup_env.sh so that every process
of a run, Ray actors and vLLM engine processes included, can import it.

Modules:
- worker_extension: the vLLM worker extension (subclass of OpenRLHF's WorkerWrap) that loads weights
  in place through vLLM's layerwise reload.
- logprob_check: start a vLLM engine on a checkpoint and compare its prompt logprobs with HF's.
- tiny_models: tiny random Qwen checkpoints built offline, for tests and CPU runs.
"""
