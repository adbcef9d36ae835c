"""The main job on a machine without a GPU: OpenRLHF's real `train_ppo_ray` on a CPU recipe, then its summary.

Hardware: CPU only (2 cores are enough), the CPU stack (`bash scripts/setup_env.sh`), no network, several
GB of RAM. On 2 cores, after setup, recipes/smoke-cpu.yaml (2 steps) takes about a minute and
recipes/learn-cpu.yaml with --control (the control run, then the run: 12 steps each) a few; the first run
on a machine also compiles DeepSpeed's CPU ops (cached in ~/.cache/torch_extensions). Measured time, memory
and results: docs/cpu-run.md.

    bash scripts/run_grpo_lora.sh                      # no GPU: learn-cpu with its control (this module)
    bash scripts/run_grpo_lora.sh smoke-cpu            # the 2-step pipeline check
    .venv/bin/python -m openrlhf_lora_sync.tools.cpu_run RECIPE [--set KEY=VALUE ...] [--control]

Each run is the command a GPU user runs: render_recipe --exec -> `python -m openrlhf_lora_sync.patch.launch`
-> OpenRLHF's train_ppo_ray on a local Ray cluster (its PPOTrainer, PolicyModelActor under DeepSpeed ZeRO-3
on the CPU accelerator, a vLLM-CPU engine in its RolloutRayActor), this repo's sync between rollouts, the
reward file as OpenRLHF loads it, the KL reference from the disabled adapters, the post-sync probe, wandb
offline, the adapter saved; what the CPU needs answered is cpu_standins.py, listed in one log line.
The model: a recipe whose actor.model_name_or_path is its own tiny path (a folder named tiny-<family>, e.g.
outputs/learn-cpu/tiny-qwen2_5_vl) gets that random tiny checkpoint built there (testing/tiny_models.py)
when it is missing; any other path is used as given and must be a local checkpoint directory.

--control first runs the same recipe with sync.stale_engine_control (after the first full sync the engine
is never synced again) into <ckpt.output_dir>/control, then the run itself. Afterwards, from each run's
<ckpt.output_dir>/metrics/steps.jsonl (written by the patched trainer, openrlhf_patch.py): a summary table,
summary.json (ok, reward_first / reward_last: mean reward of the first and last REWARD_WINDOW steps, the
control's control_reward_first / control_reward_last, the rollout parity: the engine's log-probs of the
sampled tokens against the trainer's, as gen-KL and token probability ratio) and reward.png.
Results come only from this invocation's runs: the metrics, summary.json and reward.png an earlier one
left are removed first; a run that fails (the control or the run) gets one line naming which and its exit
status, no table or plot, and a summary.json with ok false and the steps it logged.
Does not cover: GPUs (run_grpo_lora.sh runs the launcher directly there), or choosing hyperparameters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from openrlhf_lora_sync import REPO_ROOT
from openrlhf_lora_sync.config import recipe
from openrlhf_lora_sync.patch.openrlhf_patch import METRICS_FILE

REWARD_WINDOW = 5  # steps averaged at each end of a run for reward_first / reward_last
CONTROL = "control"  # the control run's folder in the run folder, and its summary prefix
REWARD_KEY = "rollout/reward_mean"
TABLE_COLUMNS = (  # (metrics key, header, format)
    ("global_step", "step", "{:.0f}"),
    (REWARD_KEY, "reward", "{:.3f}"),
    (f"{CONTROL}:{REWARD_KEY}", "control", "{:.3f}"),
    ("sync/full", "full", "{:.0f}"),
    ("sync/bytes", "MiB", "{:.2f}"),
    ("sync/seconds", "sync s", "{:.2f}"),
    ("sync/probe_max_abs_diff", "probe", "{:.1e}"),
    ("sync/probe_ratio", "probe/floor", "{:.1f}"),
    ("parity/gen_kl", "gen-KL", "{:.1e}"),
    (f"{CONTROL}:parity/gen_kl", "ctl gen-KL", "{:.1e}"),
    ("timing/step_total", "step s", "{:.1f}"),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipes/NAME.yaml, a path, or NAME")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="recipe keys to change"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="first the same run on an engine never synced after its first sync",
    )
    return parser.parse_args(argv)


def tiny_family(model: str) -> str | None:
    """The tiny family a model path names as its own (a folder tiny-<family>), else None."""
    from openrlhf_lora_sync.testing.tiny_models import FAMILIES

    name = Path(model).name
    family = name.removeprefix("tiny-")
    return family if name.startswith("tiny-") and family in FAMILIES else None


def prepare_model(run: recipe.Run) -> Path:
    """The run's checkpoint directory: the recipe's own tiny model, built when missing, or the given one."""
    model = run.args.actor.model_name_or_path
    path = REPO_ROOT / model
    family = tiny_family(model)
    if family and not (path / "config.json").exists():
        from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

        print(f"cpu_run: building the tiny random {family} checkpoint in {path}", file=sys.stderr)
        build_tiny_model(family, path, seed=run.args.train.seed)
    elif not (path / "config.json").exists():
        raise recipe.RecipeError(
            f"actor.model_name_or_path: {model} is not a local checkpoint (no config.json): a CPU run takes "
            "a checkpoint directory (model hubs are not reached), or a folder tiny-<family> to build one",
            ("actor.model_name_or_path",),
        )
    return path


def run_trainer(recipe_path: Path, sets: list[str]) -> int:
    """One train_ppo_ray run through the launcher, as run_grpo_lora.sh starts it on a GPU machine."""
    command = [
        sys.executable,
        "-m",
        "openrlhf_lora_sync.tools.render_recipe",
        str(recipe_path),
        *sets,
        "--exec",
    ]
    return subprocess.run(command, cwd=REPO_ROOT).returncode


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def window_means(values: list[float]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last REWARD_WINDOW values (they overlap in a shorter run)."""
    if not values:
        return None, None
    first, last = values[:REWARD_WINDOW], values[-REWARD_WINDOW:]
    return sum(first) / len(first), sum(last) / len(last)


def parity_summary(history: list[dict]) -> dict[str, float | None]:
    gen_kl = [row["parity/gen_kl"] for row in history if "parity/gen_kl" in row]
    ratio = [row["parity/prob_ratio_mean"] for row in history if "parity/prob_ratio_mean" in row]
    return {
        "gen_kl_mean": sum(gen_kl) / len(gen_kl) if gen_kl else None,
        "gen_kl_max": max(gen_kl, default=None),
        "prob_ratio_mean": sum(ratio) / len(ratio) if ratio else None,
        # Steps whose gen-KL was above sync.gen_kl_gate (openrlhf_patch.gen_kl_gate warned at each).
        "gen_kl_over_gate_steps": sum(row.get("parity/gen_kl_over_gate", 0) for row in history),
    }


def summarize(history: list[dict], control: list[dict]) -> dict:
    rewards = [row[REWARD_KEY] for row in history if REWARD_KEY in row]
    summary = dict(zip(("reward_first", "reward_last"), window_means(rewards), strict=True))
    summary["parity"] = parity_summary(history)
    if control:
        control_rewards = [row[REWARD_KEY] for row in control if REWARD_KEY in row]
        first_last = window_means(control_rewards)
        summary.update(zip(("control_reward_first", "control_reward_last"), first_last, strict=True))
        summary["control_parity"] = parity_summary(control)
    return summary


def table(history: list[dict], control: list[dict]) -> str:
    by_step = {row["global_step"]: dict(row) for row in history}
    for row in control:
        by_step.setdefault(row["global_step"], {"global_step": row["global_step"]}).update(
            {f"{CONTROL}:{key}": value for key, value in row.items()}
        )
    columns = [c for c in TABLE_COLUMNS if any(c[0] in row for row in by_step.values())]
    if "sync/bytes" in dict((c[0], c) for c in columns):
        for row in by_step.values():
            if "sync/bytes" in row:
                row["sync/bytes"] = row["sync/bytes"] / 2**20
    rows = [[header for _, header, _ in columns]]
    for step in sorted(by_step):
        row = by_step[step]
        rows.append([fmt.format(row[key]) if key in row else "-" for key, _, fmt in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def reward_plot(curves: dict[str, list[float]], summary: dict, path: Path, reward_name: str, what: str):
    """reward.png: each curve's mean reward per step, titled with `what` and the summary's first/last
    means (and the control's); None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display on a CI machine
    import matplotlib.pyplot as plt

    title = f"GRPO + LoRA on CPU: {what}"
    if summary["reward_first"] is not None:
        title += f"\nmean of the first/last {REWARD_WINDOW} steps: "
        title += f"{summary['reward_first']:.2f} -> {summary['reward_last']:.2f}"
        if summary.get("control_reward_first") is not None:
            title += (
                f", control {summary['control_reward_first']:.2f} -> {summary['control_reward_last']:.2f}"
            )
    figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for label, rewards in curves.items():
        if rewards:
            axes.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3, label=label)
    axes.set_xlabel("GRPO step")
    axes.set_ylabel(f"mean reward ({reward_name.replace('_', ' ')})")
    axes.set_title(title, fontsize=9)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    if any(curves.values()):  # a run that stopped before its first step has no curve to label
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    started = time.perf_counter()
    options = parse_args(argv)
    try:
        run = recipe.load_run(options.recipe, options.set)
        model = prepare_model(run)
    except recipe.RecipeError as error:
        print("\n".join(f"cpu_run: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    out = REPO_ROOT / run.args.ckpt.output_dir
    control_dir = out / CONTROL
    runs = []
    if options.control:
        control_sets = [
            "sync.stale_engine_control=true",
            f"ckpt.output_dir={control_dir}",
            f"ckpt.path={control_dir / 'checkpoints'}",
        ]
        runs.append((CONTROL, control_dir, control_sets))
    runs.append(("run", out, []))
    # What an earlier run left is never this run's: a failed run must not show it as its own.
    for _, run_dir, _ in runs:
        (run_dir / METRICS_FILE).unlink(missing_ok=True)
    for stale in ("summary.json", "reward.png"):
        (out / stale).unlink(missing_ok=True)
    status, failed = 0, None
    for name, _, sets in runs:
        print(
            f"cpu_run: {name}: OpenRLHF train_ppo_ray through openrlhf_lora_sync.patch.launch",
            file=sys.stderr,
        )
        status = run_trainer(run.path, [*options.set, *sets])
        if status != 0:
            failed = name
            break
    history, control = read_metrics(out), read_metrics(control_dir) if options.control else []
    if failed:
        summary = {"ok": False, "failed": failed, "status": status, "recipe": str(run.path)}
        summary.update(history=history, control_history=control, seconds=time.perf_counter() - started)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"cpu_run: FAIL: the {failed} exited with status {status} (the cause is in the log above); "
            f"no results: it logged {len(control if failed == CONTROL else history)} steps "
            f"({out / 'summary.json'})",
            file=sys.stderr,
        )
        return status
    summary = {"ok": True, **summarize(history, control)}
    reward_file = Path((run.args.reward.remote_url or ["reward"])[0]).stem
    curves = {
        "synced: the engine gets every update": [row[REWARD_KEY] for row in history if REWARD_KEY in row]
    }
    if control:
        curves["control: engine not synced after its first sync"] = [
            row[REWARD_KEY] for row in control if REWARD_KEY in row
        ]
    what = "OpenRLHF train_ppo_ray, tiny Qwen2.5-VL, vLLM-CPU rollouts"
    plot = reward_plot(curves, summary, out / "reward.png", reward_file, what)
    summary.update(
        recipe=str(run.path),
        model=str(model),
        history=history,
        control_history=control,
        seconds=time.perf_counter() - started,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{table(history, control)}\n")
    if summary["reward_first"] is not None:
        line = f"mean reward, first {REWARD_WINDOW} -> last {REWARD_WINDOW} steps: "
        line += f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}"
        if summary.get("control_reward_first") is not None:
            line += " (control, engine not synced after its first sync: "
            line += f"{summary['control_reward_first']:.3f} -> {summary['control_reward_last']:.3f})"
        print(line)
    parity = summary["parity"]
    if parity["gen_kl_mean"] is not None:
        print(
            f"rollout parity (engine vs trainer log-probs of the sampled tokens): mean gen-KL "
            f"{parity['gen_kl_mean']:.2e} (max {parity['gen_kl_max']:.2e}; "
            f"{parity['gen_kl_over_gate_steps']:.0f} step(s) over the gate), token probability ratio "
            f"{parity['prob_ratio_mean']:.4f}"
        )
    print(f"model:                {model}")
    print(f"LoRA adapter (peft):  {out}  (checkpoints: {REPO_ROOT / run.args.ckpt.path})")
    wandb_dir = Path(os.environ.get("WANDB_DIR") or out) / "wandb"  # the launcher's default: the run folder
    print(f"wandb (offline run):  {wandb_dir}  (upload with: wandb sync DIR)")
    print(f"metrics:              {out / METRICS_FILE}")
    if options.control:
        print(f"control:              {control_dir}")
    print(f"reward plot:          {plot or 'not drawn: matplotlib is not installed'}")
    print(f"summary:              {out / 'summary.json'}")
    print(f"total:                {summary['seconds']:.0f} s")
    print(f"cpu_run: OK: {len(history)} steps of OpenRLHF's train_ppo_ray")
    return 0


if __name__ == "__main__":
    sys.exit(main())
