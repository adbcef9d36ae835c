"""Launcher: apply the patch everywhere, then run OpenRLHF's own `train_ppo_ray` with the user's flags.

    python -m openrlhf_lora_sync.launch --pretrain ... --ds.lora.rank 64 ...   (train_ppo_ray's flags)

Covers: refusing, before anything starts (exit status 2, one line per problem), flags OpenRLHF's parser
rejects and what this patch cannot run, through the same recipe path as every other entry point
(recipe.run_from_argv: OpenRLHF's parser and checks, config_checks: no LoRA, DoRA, a rank above the
sync mode's limit; bad LORA_SYNC_*/REWARD_* values in the environment), plus unsupported OpenRLHF/vLLM
releases and target modules matching nothing in the model's config; starting Ray (or joining
the cluster named by RAY_ADDRESS) with `apply` as the worker-process setup hook, so every Ray actor
and task (nested ones too) is patched, and with this repo's settings (LORA_SYNC_*, REWARD_*, WANDB_*)
forwarded to them; then running the upstream CLI module as __main__, so its flags, defaults and
validation are OpenRLHF's own; when it ends (returns, raises, or the launcher gets SIGTERM, as from
`docker compose down`), removing this run's /dev/shm bucket files, which actors Ray ends may leave.
Does not cover: rendering recipes into flags (scripts/run_grpo_lora.sh) or preflight checks.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import uuid

SETUP_HOOK = "openrlhf_lora_sync.openrlhf_patch.apply"
FORWARDED_PREFIXES = ("LORA_SYNC_", "REWARD_", "WANDB_", "HF_", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_")
# What train_ppo_ray's own ray.init would set; it skips its init when Ray is already up.
OPENRLHF_RAY_ENV_DEFAULTS = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}


def ray_runtime_env() -> dict:
    env_vars = {name: os.environ.get(name, default) for name, default in OPENRLHF_RAY_ENV_DEFAULTS.items()}
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)})
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": env_vars}


def main(argv: list[str] | None = None) -> int:
    from openrlhf_lora_sync.config_checks import launch_problems
    from openrlhf_lora_sync.openrlhf_patch import apply
    from openrlhf_lora_sync.recipe import RecipeError, run_from_argv

    argv = sys.argv[1:] if argv is None else argv
    try:
        run = run_from_argv(argv, os.environ)
    except RecipeError as error:
        print("\n".join(f"openrlhf_lora_sync: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    problems = launch_problems(run)
    for line in [note for note in run.notes if note.startswith("warning: ")] + [str(p) for p in problems]:
        print(f"openrlhf_lora_sync: {line}", file=sys.stderr)
    if any(problem.fatal for problem in problems):
        return 2
    # Adapter-mode engines size their LoRA layers for the trainer's rank; they read it from here.
    os.environ["LORA_SYNC_LORA_RANK"] = str(run.args.ds.lora.rank)
    apply()

    import ray

    from openrlhf_lora_sync.transport import RUN_ID_ENV, remove_run_files

    os.environ.setdefault(RUN_ID_ENV, uuid.uuid4().hex[:12])  # forwarded to every actor (LORA_SYNC_ prefix)
    # SIGTERM's default action skips `finally`; as SystemExit it unwinds through the cleanup below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env=ray_runtime_env())
    sys.argv = ["openrlhf.cli.train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    finally:
        remove_run_files(os.environ[RUN_ID_ENV])
    return 0


if __name__ == "__main__":
    sys.exit(main())
