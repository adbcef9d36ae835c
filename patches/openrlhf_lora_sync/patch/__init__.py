"""The run-time patch of OpenRLHF 0.11.2 and the launcher that applies it in every process of a run.

- openrlhf_patch: `apply()`, the patched trainer, engine actor and strategy; the sync wired into them.
- run_metrics: rollout parity and the gen-KL gate, the metrics file, wandb's teardown.
- launch: `python -m openrlhf_lora_sync.patch.launch <train_ppo_ray flags>`: checks, Ray with `apply`
  as every worker's setup hook, then OpenRLHF's own CLI.
- offload: trainer base offload. reference_policy: KL from the policy with its adapters disabled.
- checkpoint: atomic adapter saves and the resume log line.
- cpu_standins: the CUDA calls answered on a CPU-only run. run_errors: one line for a dead Ray actor.

Imports: `base`, `sync`, and `config` (the launcher checks its flags through config.recipe and
config.config_checks); never `testing` or `tools`.
"""
