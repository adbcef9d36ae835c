"""Test and benchmark harness, installed with the package and shared by tests/ and the tools.

- tiny_models: tiny random Qwen2.5-VL / Qwen3-VL / Qwen3.5 / Qwen3 checkpoints built offline.
- logprob_check: a vLLM engine on a checkpoint (with this package's worker extension), putting it back on
  that checkpoint, and the prompt-logprob comparison against HF, with the tolerances per dtype.
- cpu_deepspeed: OpenRLHF's strategy and Actor on DeepSpeed's CPU accelerator, one process per rank.
- policies: the peft LoRA policies, target patterns and training nudges the tests and benchmarks share.

Imports go one way: this subpackage uses the runtime modules beside it; the runtime never imports it.
"""
