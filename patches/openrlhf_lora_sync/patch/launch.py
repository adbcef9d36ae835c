"""Launcher: apply the patch everywhere, then run OpenRLHF's own `train_ppo_ray` with the user's flags.

    python -m openrlhf_lora_sync.patch.launch --pretrain ... --ds.lora.rank 64 ...   (train_ppo_ray's flags)

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
from pathlib import Path

from openrlhf_lora_sync import python_warnings

SETUP_HOOK = "openrlhf_lora_sync.patch.openrlhf_patch.apply"
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
    # vLLM's engine and worker processes import torch before this package: they are quieted at start-up.
    env_vars["PYTHONWARNINGS"] = python_warnings(os.environ.get("PYTHONWARNINGS"))
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": env_vars}


# Flags holding local paths that Ray actors open. Made absolute in the driver, so every actor (whatever its
# working directory, on whichever node) opens what the driver means; hub ids and URLs stay as given.
PATH_FLAGS = (
    "--actor.model_name_or_path",
    "--data.prompt_dataset",
    "--eval.dataset",
    "--reward.remote_url",
    "--ckpt.output_dir",
    "--ckpt.path",
)
OUTPUT_FLAGS = ("--ckpt.output_dir", "--ckpt.path")  # made absolute even before they exist


def absolute_paths(argv: list[str], cwd: Path) -> list[str]:
    """argv with each PATH_FLAGS value that names a local file or directory (or an output directory)
    relative to `cwd` replaced by its absolute path."""
    out, flag = [], None
    for token in argv:
        if flag and not token.startswith("--"):
            path = cwd / token
            if not Path(token).is_absolute() and (flag in OUTPUT_FLAGS or path.exists()):
                token = str(path.resolve())
        else:
            flag = token if token in PATH_FLAGS else None
        out.append(token)
    return out


def declared_resources(args) -> dict[str, int]:
    """The Ray resources to declare for a run on a machine without CUDA: OpenRLHF's placement groups and
    actors ask for GPUs (and a CPU per bundle), which Ray only schedules when the node has them. Enough
    for every group the run starts (policy, engines, reference when not colocated), plus the PPOTrainer
    actor's CPU; declared resources are counters, so too many costs nothing."""
    gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    if not args.train.colocate_all:
        gpus += (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
        gpus += args.ref.num_nodes * args.ref.num_gpus_per_node
    return {"num_gpus": gpus, "num_cpus": gpus + 2}


VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Ray refuses to declare GPUs while CUDA_VISIBLE_DEVICES is set but empty ("Attempting to start raylet with 1
# GPU, but CUDA_VISIBLE_DEVICES contains []"), the usual way of hiding GPUs; a CPU run declares them.
HIDDEN_GPUS_WITH_CUDA_TORCH = (
    f"{VISIBLE_DEVICES_ENV} is set but empty and this torch is a CUDA build: Ray cannot declare the GPUs "
    "OpenRLHF's placement groups ask for; to train on the GPUs, unset it; for the CPU job, use the CPU "
    "stack (a .venv that bash scripts/setup_env.sh builds where nvidia-smi lists no GPU)"
)


def gpus_hidden_by_empty_list(environ) -> bool:
    return environ.get(VISIBLE_DEVICES_ENV) is not None and not environ[VISIBLE_DEVICES_ENV].strip()


def main(argv: list[str] | None = None) -> int:
    from openrlhf_lora_sync.base import settings
    from openrlhf_lora_sync.config.config_checks import launch_problems
    from openrlhf_lora_sync.config.recipe import RecipeError, run_from_argv
    from openrlhf_lora_sync.patch import cpu_standins
    from openrlhf_lora_sync.patch.openrlhf_patch import apply

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
    # OpenRLHF's wandb logger writes under the working directory of its actor; keep the run's files with
    # the run's outputs (metrics.jsonl, the adapter) unless WANDB_DIR says otherwise.
    output_dir = Path(run.args.ckpt.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    # Adapter-mode engines size their LoRA layers for the trainer's rank; they read it from here.
    os.environ[settings.get("LORA_SYNC_LORA_RANK").env] = str(run.args.ds.lora.rank)
    # Every worker enters the driver's directory (openrlhf_patch.apply): relative paths inside the data
    # (image paths) open in the engine actors as here, whichever directory Ray started them in.
    os.environ[settings.get("LORA_SYNC_WORKDIR").env] = os.getcwd()
    apply()

    import ray

    from openrlhf_lora_sync.sync.transport import RUN_ID_ENV, remove_run_files

    os.environ.setdefault(RUN_ID_ENV, uuid.uuid4().hex[:12])  # forwarded to every actor (LORA_SYNC_ prefix)
    # SIGTERM's default action skips `finally`; as SystemExit it unwinds through the cleanup below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    runtime_env = ray_runtime_env()
    resources = {}
    if cpu_standins.needed():
        print(f"openrlhf_lora_sync: {cpu_standins.summary()}", file=sys.stderr)
        os.environ.update(cpu_standins.DS_ACCELERATOR_ENV)
        runtime_env["env_vars"].update(cpu_standins.DS_ACCELERATOR_ENV)
        if not os.environ.get("RAY_ADDRESS"):
            import torch

            if gpus_hidden_by_empty_list(os.environ):
                if torch.version.cuda is not None:  # dropping it would show the GPUs to Ray's workers
                    print(f"openrlhf_lora_sync: {HIDDEN_GPUS_WITH_CUDA_TORCH}", file=sys.stderr)
                    return 2
                del os.environ[VISIBLE_DEVICES_ENV]  # it hides nothing from a torch without CUDA
            resources = declared_resources(run.args)
    if not ray.is_initialized():
        # "local": a new cluster of this run's own, never one some other job left running on this host.
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", runtime_env=runtime_env, **resources)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *absolute_paths(argv, Path.cwd())]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except Exception as error:
        from openrlhf_lora_sync.patch import reward_errors
        from openrlhf_lora_sync.patch.run_errors import dead_actor_line

        # an actor of the run died (run_errors.py), or no sample of a step got a reward (reward_errors.py)
        line = dead_actor_line(error) or reward_errors.failure_line(error)
        if line is None:
            raise
        ray.shutdown()  # the run's other actors end now, so their last lines come before this one
        print(f"openrlhf_lora_sync: {line}", file=sys.stderr)
        return 1
    finally:
        remove_run_files(os.environ[RUN_ID_ENV])
    return 0


if __name__ == "__main__":
    sys.exit(main())
