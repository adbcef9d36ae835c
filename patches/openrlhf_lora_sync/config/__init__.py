"""A run's configuration and everything checked before anything starts.

- recipe: the one recipe path, a recipe or a launcher's argv -> a checked Run (OpenRLHF's own parser).
- config_checks: what this patch refuses before any GPU work, each problem with its fix.
- memory_budget: per-GPU and host memory of a run; memory_report: its command line, what-if table and
  breakdown; model_inventory: the model's modules and LoRA parameters, built on the meta device;
  lora_targets: LoRA target rules (language-linears, ...) expanded on the model.
- preflight: the machine and the run checked, one line per check; host_checks: its checks of the machine.
- weights_check, adapter_check: weight files and peft adapters that cannot load, named before loading.

Imports: `base`, and `sync` for what the sync itself refuses (merge.check_supported_adapters,
adapter_mode.check_adapter_mode_supported), so a recipe is refused with the trainer's own words; never
`patch`, `testing` or `tools`.
"""
