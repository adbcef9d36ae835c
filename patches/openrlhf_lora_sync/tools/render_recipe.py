#!/usr/bin/env python3
"""Render a recipe into the launch command, checked by OpenRLHF's own parser (recipe.load_run).

    python scripts/render_recipe.py RECIPE [key=value ...] [--dry-run] [--print-env] [--resolved OUT]
                                    [--exec]

RECIPE is a path or a name in recipes/ (`qwen3_vl-8b-4x4090`). Prints the launch command (`env VARS python
-m openrlhf_lora_sync.patch.launch FLAGS`); exits 2 with one `render_recipe: ...` line per problem (the key
and its fix) when the recipe is wrong. Every invocation runs the whole recipe path (OpenRLHF's parser and
checks, config_checks): `--dry-run` adds the memory estimate (memory_budget.py) and says it passed.
`--exec` replaces this process with the launch command (what scripts/run_grpo_lora.sh does last).
Hardware: none. Starts nothing (no Ray, vLLM, torch or GPU) except for the memory estimate of --dry-run,
which builds the model on the meta device; seconds.
Does not cover: whether the model, data and GPUs exist (scripts/preflight.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import yaml

from openrlhf_lora_sync.config import memory_budget
from openrlhf_lora_sync.config.recipe import MEMORY_LINE_PREFIX, RecipeError, Rendered, Run, load_run


def memory_report(run: Run, gpu_mem_gib: float = 24.0) -> list[str]:
    """memory_budget's estimate for a run: the recipe header's memory line (GiB per GPU per phase, and host
    RAM for the node), then one line per phase that does not fit."""
    model = run.args.actor.model_name_or_path
    if not model:
        return ["not estimated (no actor.model_name_or_path)"]
    try:
        _, budget = memory_budget.estimate_run(run, gpu_mem_gib)
    except FileNotFoundError:
        return [f"not estimated ({model}: no config.json there, nor a reference config in memory_budget.py)"]
    except ValueError as error:
        return [f"not estimated ({error})"]
    return [memory_budget.headline(budget), *budget.problems()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipes/NAME.yaml, or NAME")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe keys to change")
    parser.add_argument("--dry-run", action="store_true", help="also estimate memory; start nothing")
    parser.add_argument("--print-env", action="store_true", help="print only `export VAR=value` lines")
    parser.add_argument("--resolved", type=Path, metavar="OUT", help="write the final recipe keys here")
    parser.add_argument("--exec", action="store_true", help="replace this process with the launch command")
    args = parser.parse_args(argv)

    try:
        run = load_run(args.recipe, args.overrides)
    except RecipeError as error:
        print("\n".join(f"render_recipe: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2

    if args.resolved:
        args.resolved.parent.mkdir(parents=True, exist_ok=True)
        args.resolved.write_text(yaml.safe_dump(run.flags, sort_keys=False))
    if args.print_env:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in run.env.items()))
        return 0
    rendered = Rendered(run.argv, run.env)
    if args.exec:
        command = rendered.command(sys.executable, mask_secrets=False)
        print(rendered.shell_command(sys.executable), file=sys.stderr, flush=True)
        os.execve(sys.executable, command, {**os.environ, **run.env})

    print(rendered.shell_command())
    for note in run.notes:
        print(f"# {note}")
    if args.dry_run:
        headline, *problems = memory_report(run)
        print(MEMORY_LINE_PREFIX + headline)
        for problem in problems:
            print(f"#   {problem}")
        name = run.path.name
        print(f"# dry run: {name} passes OpenRLHF's train_ppo_ray parser and checks; nothing started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
