"""The memory budget as people read it: the command line (scripts/memory_budget.py), the what-if table
(README, docs/memory.md) and the breakdown of one estimate. The estimate itself: memory_budget.py.

    python scripts/memory_budget.py --recipe qwen3_5-27b-4x4090          # a recipe (path or name)
    python scripts/memory_budget.py --model Qwen/Qwen3.5-27B --set vllm.tensor_parallel_size=4 ...
    python scripts/memory_budget.py --table        # the what-if table (README): seconds, CPU only

Without --recipe the run is recipes/base.yaml (this repo's defaults: 4 GPUs, ZeRO-3, colocated vLLM,
LoRA r=64); --model M is the override actor.model_name_or_path=M and each --set key=value another one,
so bad keys and values get the recipe path's messages (recipe.load_run), exit 2; exit 1: does not fit.
Does not cover: the formulas (memory_budget.py) or memory measured on a GPU (docs/memory.md).
Hardware: none.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from openrlhf_lora_sync.config import memory_budget, recipe
from openrlhf_lora_sync.config.memory_budget import (
    GIB,
    Budget,
    RunShape,
    best_utilization,
    estimate,
    estimate_run,
    find_fitting,
    gib,
    headline,
)
from openrlhf_lora_sync.config.model_inventory import REFERENCE_CONFIGS, model_spec

BASE_RECIPE = recipe.RECIPES_DIR / "base.yaml"

# The reference table: recipe-like settings on 4x RTX 4090 (one 4090 for the last two). Rows marked
# tune get the largest gpu_memory_utilization at which they fit (they keep theirs when none does).
# The user's flags (TP4, ZeRO-3 x4, LoRA r64, colocate_all, both sleeps) and OpenRLHF's defaults for the
# rest: LoRA on all-linear (vision tower included), KL reference on GPU, util 0.95, no checkpointing.
USER_27B_FLAGS = {
    "actor.model_name_or_path": "Qwen/Qwen3.5-27B",
    "actor.num_gpus_per_node": 4,
    "vllm.num_engines": 1,
    "vllm.tensor_parallel_size": 4,
    "train.colocate_all": True,
    "vllm.enable_sleep": True,
    "ds.enable_sleep": True,
    "ds.lora.rank": 64,
    "ds.zero_stage": 3,
    "algo.advantage.estimator": "group_norm",
}
# What USER_27B_FLAGS map to under upstream OpenRLHF (with sync.reference_from_base: false; through this
# repo's patch the KL reference is the base instead: tests/inputs/test_memory_budget.py checks both).
USER_27B = RunShape()
LANGUAGE_ONLY_LORA = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
LEAN = replace(
    USER_27B,
    reference="none",
    lora_targets=LANGUAGE_ONLY_LORA,
    gradient_checkpointing=True,
    gpu_memory_utilization=0.5,
)
_TP2 = {"vllm_tp": 2, "vllm_engines": 2}
_ONE_GPU = {"gpus": 1, "vllm_tp": 1}
TABLE_ROWS: list[tuple[str, str, RunShape, bool]] = [
    ("user's command as given (KL reference on GPU)", "Qwen/Qwen3.5-27B", USER_27B, False),
    ("27B, KL 0, language-only LoRA", "Qwen/Qwen3.5-27B", LEAN, True),
    ("27B + trainer base offload", "Qwen/Qwen3.5-27B", replace(LEAN, param_offload=True), True),
    (
        "27B + trainer base offload, sleep level 2",
        "Qwen/Qwen3.5-27B",
        replace(LEAN, param_offload=True, vllm_sleep_level=2),
        True,
    ),
    (
        "27B + base offload, sleep level 2, KL from the base",
        "Qwen/Qwen3.5-27B",
        replace(LEAN, param_offload=True, vllm_sleep_level=2, reference="base"),
        True,
    ),
    ("27B + 4-bit base", "Qwen/Qwen3.5-27B", replace(LEAN, base_4bit=True), True),
    ("9B, TP4", "Qwen/Qwen3.5-9B", LEAN, True),
    ("9B, 2 engines x TP2", "Qwen/Qwen3.5-9B", replace(LEAN, **_TP2), True),
    ("Qwen2.5-VL-7B, 2 x TP2", "Qwen/Qwen2.5-VL-7B-Instruct", replace(LEAN, **_TP2), True),
    ("Qwen3-VL-8B, 2 x TP2", "Qwen/Qwen3-VL-8B-Instruct", replace(LEAN, **_TP2), True),
    ("Qwen3.5-4B, 1 GPU", "Qwen/Qwen3.5-4B", replace(LEAN, **_ONE_GPU), True),
    ("Qwen2.5-VL-3B, 1 GPU", "Qwen/Qwen2.5-VL-3B-Instruct", replace(LEAN, **_ONE_GPU), True),
]


def table_rows(rows=None) -> list[Budget]:
    budgets = []
    for label, model, row, tune in rows or TABLE_ROWS:
        spec = model_spec(REFERENCE_CONFIGS[model])
        utilization = best_utilization(spec, row) if tune else None
        row = replace(row, gpu_memory_utilization=utilization or row.gpu_memory_utilization)
        budgets.append(estimate(spec, row, f"{label}, util {row.gpu_memory_utilization}"))
    return budgets


def format_table(budgets: list[Budget]) -> str:
    lines = [
        "| setting | params (B) | LoRA (M) | rollout | train | sync (full) | sync (delta) | spare | KV seqs "
        "| host RAM | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in budgets:
        total = sum(b.parameters.values()) / 1e9
        cells = [gib(b.phase(name).total) for name in ("rollout", "train", "sync", "sync_delta")]
        spare = b.usable - max(b.phase(name).total for name in ("train", "sync"))
        kv = f"{b.kv_sequences:.0f}" if b.kv_sequences >= 0 else "none"
        verdict = (
            "yes"
            if b.fits()
            else "no: " + ", ".join(n for n in ("rollout", "train", "sync") if not b.fits(n))
        )
        lines.append(
            f"| {b.model} | {total:.2f} | {b.lora_parameters / 1e6:.0f} | {' | '.join(cells)} | {gib(spare)} "
            f"| {kv} | {gib(b.host_bytes)} | {verdict} |"
        )
    lines.append("")
    lines.append(
        "GiB per GPU on its busiest GPU. The first sync is full, so 'fits' judges sync (full); sync (delta)"
        " is every later sync at vLLM sleep level 1. Rollout fills what vLLM is given (util), so 'spare' is"
        " what train and sync leave of the usable memory (G - 0.5 GiB). KV seqs: max_len-token sequences"
        " the KV cache holds at once."
    )
    return "\n".join(lines)


def describe(budget: Budget) -> str:
    """Multi-line breakdown of one budget, for preflight's report and the CLI."""
    s = budget.settings
    lines = [
        f"{budget.model}: {sum(budget.parameters.values()) / 1e9:.2f} B parameters "
        + "("
        + ", ".join(f"{part} {count / 1e9:.3f} B" for part, count in budget.parameters.items() if count)
        + f"), LoRA {budget.lora_parameters / 1e6:.1f} M",
        f"  {s.gpus} GPU(s) x {s.gpu_mem_gib} GiB, vLLM {s.vllm_engines} x TP{s.vllm_tp} "
        f"({'colocated' if s.colocate else 'separate'}), ZeRO-{s.zero_stage} over {s.trainer_gpus}, "
        f"sleep level {s.vllm_sleep_level}, util {s.gpu_memory_utilization}",
    ]
    for phase in budget.phases:
        parts = ", ".join(f"{name} {gib(size)}" for name, size in phase.parts.items() if size)
        lines.append(f"  {phase.name:7s} ({phase.role}): {gib(phase.total)} GiB = {parts}")
    kv = f"{budget.kv_sequences:.1f} sequences of {s.max_len} tokens"
    host = ", ".join(f"{name} {gib(size)}" for name, size in budget.host_parts.items())
    lines.append(f"  KV cache: {kv}")
    lines.append(f"  host RAM (node): {gib(budget.host_bytes)} GiB = {host}")
    return "\n".join(lines)


def _error(lines: str) -> int:
    print("\n".join(f"memory_budget: {line}" for line in lines.splitlines()), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=memory_budget.__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe", help="recipes/NAME.yaml, or NAME (default: recipes/base.yaml, this repo's defaults)"
    )
    parser.add_argument("--model", help="local model directory or a hub id in REFERENCE_CONFIGS")
    parser.add_argument("--gpu-mem-gib", type=float, default=24.0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe key (OpenRLHF flag or repo setting), e.g. ds.lora.rank=64; repeatable",
    )
    parser.add_argument("--table", action="store_true", help="print the what-if table (markdown)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args(argv)
    if args.table:
        print(format_table(table_rows()))
        return 0
    overrides = [*args.set, *([f"actor.model_name_or_path={args.model}"] if args.model else [])]
    try:
        run = recipe.load_run(args.recipe or BASE_RECIPE, overrides)
    except recipe.RecipeError as error:
        return _error(str(error))
    model = run.args.actor.model_name_or_path
    if not model:
        return _error("no model: give --model, or a recipe that sets actor.model_name_or_path")
    try:
        spec, budget = estimate_run(run, args.gpu_mem_gib)
    except (OSError, ValueError) as error:  # no config, a model transformers or peft refuses
        return _error(str(error).splitlines()[0])
    if args.json:
        out = {
            "model": budget.model,
            "settings": asdict(budget.settings),
            "parameters": budget.parameters,
            "lora_parameters": budget.lora_parameters,
            "phases_gib": {f"{p.name}/{p.role}": round(p.total / GIB, 2) for p in budget.phases},
            "kv_sequences": budget.kv_sequences,
            "host_gib": round(budget.host_bytes / GIB, 1),
            "fits": budget.fits(),
        }
        print(json.dumps(out))
    else:
        print(describe(budget))
        for line in budget.problems():
            print("  does not fit: " + line)
        last = f"memory: {headline(budget)}"  # the line a recipe's header carries, and the verdict
        if not budget.fits():
            fitting = find_fitting(spec, budget.settings)
            last += "; cheapest fix: " + ("; ".join(fitting[0]) if fitting else "none the estimator knows")
        print(last)
    return 0 if budget.fits() else 1


if __name__ == "__main__":
    sys.exit(main())
