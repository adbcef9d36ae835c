#!/usr/bin/env python3
"""Preflight: checks this machine for a GRPO + LoRA run, one line per check (PASS/WARN/FAIL/N/A) with a fix.

    python scripts/preflight.py [--recipe recipes/R.yaml] [--model PATH_OR_HUB_ID] [--gpus N]
                                [--gpu-mem-gib G] [--output-dir DIR] [--stack cpu|gpu]
                                [--set FLAG=VALUE ...] [--json]

Hardware: any Linux machine; GPU checks report N/A (no recipe) or FAIL (a recipe that needs GPUs) without
one. What takes time: two short probe processes, the package check, torch's import where an NVIDIA
driver is present, and `datasets`' import where the run's data is local. Exits 1 when any check FAILs, else
0. Makes no network calls.

Covers
- The machine (host_checks.py): gpus, ptrace_scope, cap_sys_ptrace, pidfd_getfd, alloc_conf, dev_shm,
  nccl_p2p, wandb, disk, packages; each one described there.
- model: a local directory with config.json, or a hub id in the local Hugging Face cache.
- data: each entry of data.prompt_dataset and eval.dataset (comma-separated, `path@data_dir`) opened by
  `datasets` as openrlhf.datasets.utils.blending_datasets opens it (builder by extension, save_to_disk
  directory, folder of data files; streamed) with its split, and its first rows (data.max_samples, at most
  1000): data.input_key and data.label_key present; in a VLM run (data.max_images_per_prompt > 0)
  data.image_key present, local image files found relative to the working directory (the launcher's, which
  every Ray actor enters: LORA_SYNC_WORKDIR), and no row over data.max_images_per_prompt. FAILs what stops
  the run (no file, unreadable, no such split or key, a row none of whose images exist, a row over the
  image limit, which vLLM refuses); WARNs rows missing some images or a label, and hub ids (not checked).
- reward: the run's reward file (reward.remote_url, a .py file) loaded and called as OpenRLHF does it, on
  the data's first rows with stand-in completions (reward_check.py); FAILs a file that does not load, a
  reward_func that raises or returns what OpenRLHF cannot read.
- transport: the recipe's sync.transport (or LORA_SYNC_TRANSPORT) against this host: cuda_ipc FAILs
  without GPUs or where the pidfd_getfd probe is denied, naming shm as the fix.
- lora_config: openrlhf_lora_sync.config.config_checks on the recipe (DoRA, no LoRA, the rank against the sync
  mode, ds.lora.target_modules matched by peft against the model built from its config without weights).
- memory: scripts/memory_budget.py's per-GPU estimate of rollout, train and weight sync; a setting that
  does not fit FAILs with the numbers and the knobs that make it fit.
- host_memory: the estimator's host RAM for the run (vLLM's weights at sleep level 1, the trainer base
  offload, the LoRA optimizer, the processes) against MemAvailable in /proc/meminfo; FAILs naming the
  settings that need less (vLLM sleep level 2, less offload) and whether the GPUs still fit with them.

Does not cover: network reachability (hub, wandb), NCCL itself, the driver/CUDA version match (torch
reports that on first use), multi-node setups, hub datasets, rows after the first 1000, whether images
decode, prompt lengths against data.max_len, or blended datasets' features matching. Recipes are read as
YAML mappings whose keys are OpenRLHF flags without dashes, nested (`vllm: {tensor_parallel_size: 4}`) or
dotted; a `base:` key names a recipe (path relative to this one) that it overrides.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.config import config_checks, memory_budget, model_inventory
from openrlhf_lora_sync.config.dataset_rows import DATA_FILE_BUILDERS, load_local_dataset
from openrlhf_lora_sync.config.host_checks import (
    FAIL,
    GIB,
    NA,
    PASS,
    PTRACE_FIX,
    WARN,
    CheckResult,
    GpuInfo,
    check_alloc_conf,
    check_cap_sys_ptrace,
    check_dev_shm,
    check_disk,
    check_gpus,
    check_nccl_p2p,
    check_packages,
    check_pidfd_getfd,
    check_ptrace_scope,
    check_wandb,
    detect_gpus,
)
from openrlhf_lora_sync.config.recipe import RecipeError, Run, load_run
from openrlhf_lora_sync.config.reward_check import RewardFileError, check_run_reward

# ----------------------------------------------------------------------------------------- model


def hf_hub_cache(env: dict) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists()


def model_weights_problem(path: Path) -> str | None:
    """weights_check's line for a local checkpoint's weight files (readable, shaped as its config builds)."""
    from transformers import AutoConfig

    from openrlhf_lora_sync.config.weights_check import expected_shapes, weights_problem

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return weights_problem(path)  # a config this transformers cannot build: files checked, shapes not
    return weights_problem(path, expected=expected_shapes(config))


def check_model(model: str | None, env: dict) -> CheckResult:
    if not model:
        return CheckResult("model", NA, "no model given (--model or the recipe's actor.model_name_or_path)")
    if looks_like_path(model):
        path = Path(model).expanduser()
        if (path / "config.json").is_file():
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
            unreadable = model_weights_problem(path)
            if unreadable:
                fix = "download the checkpoint again (or fix its files) before starting the run"
                return CheckResult("model", FAIL, unreadable, fix)
            return CheckResult(
                "model", PASS, f"{path}: config.json, model_type {model_type}", details={"config": str(path)}
            )
        return CheckResult(
            "model",
            FAIL,
            f"{path}: {'no config.json in it' if path.is_dir() else 'does not exist'}",
            "point actor.model_name_or_path at a Hugging Face checkpoint directory (mount it in compose)",
        )
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return CheckResult("model", FAIL, f"{model!r} is neither a path nor a hub id (org/name)", "fix it")
    cache = hf_hub_cache(env)
    snapshots = sorted((cache / f"models--{model.replace('/', '--')}" / "snapshots").glob("*/config.json"))
    if snapshots:
        snapshot = snapshots[-1].parent
        summary = f"{model} is in the Hugging Face cache ({snapshot})"
        return CheckResult("model", PASS, summary, details={"config": str(snapshot)})
    if env.get("HF_HUB_OFFLINE") == "1":
        return CheckResult(
            "model",
            FAIL,
            f"{model} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1",
            f"download it first (`hf download {model}`) or mount a cache that has it",
        )
    return CheckResult(
        "model",
        WARN,
        f"{model} is not in the Hugging Face cache {cache}; whether the hub has it cannot be checked "
        "offline (preflight makes no network calls); it will be downloaded at start",
        "pre-download it (`hf download " + model + "`); gated models need HF_TOKEN",
    )


# ------------------------------------------------------------------------------------------ data

DATA_ROW_CAP = 1000  # rows read per dataset, so that a large one is checked in seconds
# Image references load_images fetches or decodes instead of opening as a file (the bare base64 it also
# accepts is not told apart: it counts as a missing file).
INLINE_IMAGE_PREFIXES = ("http://", "https://", "data:")


def image_references(row: dict, key: str) -> list:
    """A prompt row's images as OpenRLHF counts them (vlm_utils.process_prompt_with_images): the value under
    `key`, one reference or a list, without None entries (a text-only row has none)."""
    references = row.get(key)
    references = references if isinstance(references, list) else [references]
    return [reference for reference in references if reference is not None]


def row_problems(rows: list[dict], data, workdir: Path) -> tuple[list[tuple[str, str, str]], dict]:
    """What in `rows` the run would trip on, as (status, what, fix), and the counts: the keys the run reads
    (data.input_key, data.label_key), and in a VLM run (data.max_images_per_prompt > 0) each row's images,
    local paths opened from `workdir`, against the limit vLLM enforces."""
    keys = sorted({key for row in rows for key in row})
    problems = []
    missing_input = sum(row.get(data.input_key) is None for row in rows)
    if missing_input:
        what = f"{missing_input} rows have no {data.input_key!r} (data.input_key; keys: {keys})"
        problems.append((FAIL, what, "set data.input_key to the rows' prompt key, or fix those rows"))
    missing_label = sum(row.get(data.label_key) is None for row in rows) if data.label_key else 0
    if missing_label == len(rows):  # preprocess_data indexes every row by the key
        what = f"no row has {data.label_key!r} (data.label_key; keys: {keys})"
        problems.append((FAIL, what, "set data.label_key to the rows' answer key"))
    elif missing_label:
        what = f"{missing_label} rows have no {data.label_key!r}: the reward gets None as their label"
        problems.append((WARN, what, "fix those rows or drop them"))
    counts = {"rows": len(rows)}
    limit = data.max_images_per_prompt
    if limit <= 0:
        return problems, counts

    if not any(data.image_key in row for row in rows):
        what = f"no row has {data.image_key!r} (data.image_key; keys: {keys}) in a VLM run"
        problems.append((FAIL, what, "set data.image_key to the rows' image key"))
    images = found = none_found = some_missing = over_limit = 0
    example = None
    for row in rows:
        references = image_references(row, data.image_key)
        local = [r for r in references if isinstance(r, str) and not r.startswith(INLINE_IMAGE_PREFIXES)]
        missing = [r for r in local if not os.path.isfile(workdir / r)]
        images, found = images + len(references), found + len(references) - len(missing)
        example = example or (missing[0] if missing else None)
        none_found += bool(references) and len(missing) == len(references)
        some_missing += 0 < len(missing) < len(references)
        over_limit += len(references) > limit
    path_fix = (
        f"image paths open relative to the directory the launcher runs in ({workdir}, where preflight runs): "
        "make them relative to it (prepare_data.py --relative-to) or absolute"
    )
    if none_found:
        what = (
            f"{none_found} rows have none of their images (of {images - found} missing, e.g. {example}): "
            "OpenRLHF stops the run at such a row ('All images failed to load')"
        )
        problems.append((FAIL, what, path_fix))
    if some_missing:
        what = (
            f"{some_missing} rows miss some of their images (e.g. {example}): OpenRLHF leaves them out with "
            "a warning, and the prompt keeps their placeholders"
        )
        problems.append((WARN, what, path_fix))
    if over_limit:
        what = (
            f"{over_limit} rows have more than {limit} images (data.max_images_per_prompt): vLLM refuses "
            "such a prompt mid-run"
        )
        fix = "raise data.max_images_per_prompt, or drop those rows (prepare_data.py --max-images-per-prompt)"
        problems.append((FAIL, what, fix))
    return problems, {**counts, "images": images, "missing": images - found, "over_limit": over_limit}


def check_dataset(source: str, flags: tuple[str, str], split: str, data, workdir: Path) -> CheckResult:
    """One entry of a comma-separated dataset list (`path[@data_dir]`, as blending_datasets splits it):
    where it is (relative to `workdir`), whether `datasets` reads it, its split, then row_problems on its
    first rows (data.max_samples, at most DATA_ROW_CAP)."""
    dataset_flag, split_flag = flags
    name, _, data_dir = (part.strip() for part in source.partition("@"))
    shown = f"{dataset_flag} {name}"
    path = workdir / name
    if not path.exists():
        if os.path.splitext(name)[1] in DATA_FILE_BUILDERS or looks_like_path(name):
            return CheckResult(
                "data",
                FAIL,
                f"{shown}: no such file or directory" + ("" if os.path.isabs(name) else f" in {workdir}"),
                "write it (`bash scripts/run_grpo_lora.sh` converts data.source into a missing "
                "data/geometry3k/; `python scripts/prepare_data.py --dataset D --output-dir DIR` any other) "
                f"or point {dataset_flag} at one (relative paths: from the launcher's directory, the repo "
                "root)",
            )
        if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
            return CheckResult(
                "data",
                WARN,
                f"{shown}: not a local path here, so a hub dataset id: not checked offline (preflight makes "
                "no network calls); OpenRLHF downloads it at start",
                f"convert it to local JSONL (`python scripts/prepare_data.py --dataset {name}`) and point "
                f"{dataset_flag} at that",
            )
        return CheckResult("data", FAIL, f"{shown}: neither a local path nor a hub id (org/name)", "fix it")

    limit = min(DATA_ROW_CAP, data.max_samples)
    try:
        loaded = load_local_dataset(path, data_dir or None)
        if isinstance(loaded, dict):  # a (Iterable)DatasetDict: blending_datasets takes the split by name
            if split not in loaded:
                summary = f"{shown}: no split {split!r} ({split_flag}); it has {sorted(loaded)}"
                return CheckResult("data", FAIL, summary, f"set {split_flag} to one of them")
            loaded = loaded[split]
        rows = list(itertools.islice(loaded, limit + 1))
    except Exception as error:  # datasets and pyarrow raise many types for data they cannot parse
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        return CheckResult(
            "data",
            FAIL,
            f"{shown}: `datasets` cannot read it as OpenRLHF does ({type(error).__name__}: {reason})",
            "fix or regenerate it (`python scripts/prepare_data.py`); JSONL is one JSON object per line",
        )
    if not rows:
        return CheckResult(
            "data", FAIL, f"{shown}: no rows", f"point {dataset_flag} at a dataset with prompts"
        )
    read = f"{len(rows)} rows"
    if len(rows) > limit:
        rows = rows[:limit]
        why = "data.max_samples: the run reads no more" if limit == data.max_samples else "preflight's cap"
        read = f"first {limit} rows ({why})"

    problems, details = row_problems(rows, data, workdir)
    if problems:
        status = FAIL if any(problem[0] == FAIL for problem in problems) else WARN
        summary = f"{shown}: {read}: " + "; ".join(problem[1] for problem in problems)
        return CheckResult("data", status, summary, "; ".join(problem[2] for problem in problems), details)
    named = " and ".join(repr(key) for key in (data.input_key, data.label_key) if key)
    summary = f"{shown}: {read}, each with {named}"
    if "images" in details:
        summary += f"; {details['images']} images, every local one found, none over the limit"
    return CheckResult("data", PASS, summary, details=details)


def check_data(run: Run | None, workdir: Path) -> CheckResult:
    """The run's prompt and eval datasets as OpenRLHF will read them in its Ray actors, which work in the
    launcher's directory (LORA_SYNC_WORKDIR): preflight runs there too, and passes it as `workdir`."""
    if run is None:
        return CheckResult("data", NA, "needs a recipe (or --set)")
    data, evaluation = run.args.data, run.args.eval
    lists = [
        (("data.prompt_dataset", "data.prompt_split"), data.prompt_dataset, data.prompt_split),
        (("eval.dataset", "eval.split"), evaluation.dataset, evaluation.split),
    ]
    results = [
        check_dataset(source, flags, split, data, workdir)
        for flags, sources, split in lists
        if sources
        for source in sources.split(",")
    ]
    if not results:
        return CheckResult("data", NA, "the run names no data.prompt_dataset")
    return CheckResult(
        "data",
        next((s for s in (FAIL, WARN) if any(r.status == s for r in results)), PASS),
        " | ".join(r.summary for r in results),
        "; ".join(r.fix for r in results if r.status != PASS),
        {"datasets": [r.details for r in results]},
    )


def check_reward(run: Run | None, workdir: Path) -> CheckResult:
    """The run's reward file loaded and called as OpenRLHF does it, on the data's first rows with stand-in
    completions (reward_check.py)."""
    if run is None:
        return CheckResult("reward", NA, "needs a recipe (or --set)")
    try:
        name, calls = check_run_reward(run, workdir)
    except RewardFileError as error:
        fix = "fix the reward file (rerun this check: python -m openrlhf_lora_sync.config.reward_check)"
        return CheckResult("reward", FAIL, str(error), fix)
    if name is None:
        return CheckResult("reward", NA, "reward.remote_url is not a .py file: not checked")
    return CheckResult("reward", PASS, f"{name}: reward_func returned OpenRLHF's dict in {calls} calls")


# ---------------------------------------------------------------------------------- memory budget


def _peaks(budget: memory_budget.Budget) -> str:
    return ", ".join(
        f"{name} {memory_budget.gib(budget.phase(name).total)}" for name in ("rollout", "train", "sync")
    )


def check_memory(budget: memory_budget.Budget, spec: model_inventory.ModelSpec) -> CheckResult:
    summary = f"{budget.model}: per-GPU peaks {_peaks(budget)} GiB of {memory_budget.gib(budget.gpu_bytes)}"
    details = {
        "peaks_gib": {f"{p.name}/{p.role}": round(p.total / GIB, 2) for p in budget.phases},
        "kv_sequences": budget.kv_sequences,
    }
    if budget.fits():
        return CheckResult("memory", PASS, summary, "", details)
    fitting = memory_budget.find_fitting(spec, budget.settings)
    if fitting is None:
        fix = "no knob makes it fit: a smaller model (README memory table), more GPUs or larger ones"
    else:
        changes, tuned = fitting
        after = memory_budget.estimate(spec, tuned)
        fix = (
            f"turn: {'; '.join(changes)} (then {_peaks(after)} GiB per GPU, "
            f"host RAM about {memory_budget.gib(after.host_bytes)} GiB)"
        )
    summary += " -- " + " | ".join(budget.problems())
    return CheckResult("memory", FAIL, summary, fix, details)


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """What the kernel says can be allocated without swapping (MemAvailable), in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable line")


def check_host_memory(
    budget: memory_budget.Budget, spec: model_inventory.ModelSpec, meminfo: Path
) -> CheckResult:
    gib = memory_budget.gib
    available = mem_available_bytes(meminfo)
    parts = ", ".join(f"{name} {gib(size)}" for name, size in budget.host_parts.items())
    summary = (
        f"the run needs about {gib(budget.host_bytes)} GiB of host RAM ({parts}); "
        f"{gib(available)} GiB available (MemAvailable)"
    )
    details = {"need_gib": round(budget.host_bytes / GIB, 1), "available_gib": round(available / GIB, 1)}
    if budget.host_bytes <= available:
        return CheckResult("host_memory", PASS, summary, details=details)
    options = []
    for label, after in memory_budget.host_alternatives(spec, budget.settings):
        host = "fits" if after.host_bytes <= available else "still too much"
        failing = [
            f"{n} {gib(after.phase(n).total)}" for n in ("rollout", "train", "sync") if not after.fits(n)
        ]
        gpus = (
            f"but the GPUs do not fit ({', '.join(failing)} GiB per GPU)" if failing else "the GPUs still fit"
        )
        options.append(f"{label}: host RAM {gib(after.host_bytes)} GiB ({host}), {gpus}")
    options.append("or free host RAM / run on a host with more")
    return CheckResult("host_memory", FAIL, summary, " | ".join(options), details)


# ------------------------------------------------------------------------------- run configuration


def check_lora_config(run: Run | None, model: str | None) -> CheckResult:
    """ds.lora.target_modules matched by peft against a weightless copy of the model (its local config,
    else model_inventory's reference config of that hub id), and data.max_len against the model's length;
    the run's own checks (DoRA, no LoRA, the rank against the sync mode) already passed when the recipe
    loaded (recipe.load_run)."""
    if run is None:
        return CheckResult("lora_config", NA, "needs a recipe (or --set)")
    reference = model_inventory.REFERENCE_CONFIGS.get(str(model))
    problems = []
    if model:
        problems = config_checks.length_problems(run, model)
        problems += config_checks.target_problems(run, model, reference)
    fatal = [p for p in problems if p.fatal]
    shown = fatal or problems
    if shown:
        summary = " | ".join(f"{p.key}: {p.message}" for p in shown)
        return CheckResult("lora_config", FAIL if fatal else WARN, summary, "; ".join(p.fix for p in shown))
    targets = f"checked against {model}" if model else "not checked (no model)"
    return CheckResult(
        "lora_config",
        PASS,
        f"LoRA rank {run.args.ds.lora.rank}, sync mode {run.setting('sync.mode')}, target_modules {targets}",
    )


def check_transport(transport: str, gpus: list[GpuInfo], pidfd: CheckResult) -> CheckResult:
    """The sync transport the recipe asks for against this host: cuda_ipc needs GPUs, and is refused where
    the pidfd_getfd probe is denied (CUDA IPC of expandable-segment memory fails there, and the transport's
    way around it, plain cudaMalloc buckets, has not been measured on GPUs)."""
    if transport != "cuda_ipc":
        return CheckResult(
            "transport", PASS, f"sync transport {transport}: only cuda_ipc depends on pidfd_getfd"
        )
    fix = "sync.transport: shm (or auto; LORA_SYNC_TRANSPORT=shm): the /dev/shm transport needs neither"
    if not gpus:
        return CheckResult(
            "transport", FAIL, "sync.transport cuda_ipc needs CUDA GPUs; none visible", fix + " GPUs"
        )
    if pidfd.details.get("errno"):
        return CheckResult(
            "transport",
            FAIL,
            f"sync.transport cuda_ipc on a host that denies pidfd_getfd between sibling processes "
            f"({pidfd.summary})",
            f"{fix} ptrace permission; or allow it: {PTRACE_FIX}",
        )
    return CheckResult("transport", PASS, "sync transport cuda_ipc: pidfd_getfd between siblings works here")


# ------------------------------------------------------------------------------------------- run


@dataclass
class Plan:
    """What the checks are measured against: the run (recipe.load_run) and the command line."""

    run: Run | None = None
    gpu_mem_gib: float | None = None
    output_dir: Path = Path("outputs")
    stack: str | None = None
    meminfo: Path = Path("/proc/meminfo")  # where host RAM is read (tests give a fake one)


def run_checks(plan: Plan, env: dict | None = None) -> list[CheckResult]:
    env = dict(os.environ if env is None else env)
    run = plan.run
    flags = run.flags if run else {}
    model = run.args.actor.model_name_or_path if run else None
    gpus, source = detect_gpus()
    results = []

    model_result = check_model(model, env)
    config = None
    if model_result.details.get("config"):
        config = model_inventory.load_config(model_result.details["config"])
    elif model in model_inventory.REFERENCE_CONFIGS:
        config = model_inventory.REFERENCE_CONFIGS[model]

    estimate_settings = memory_budget.shape_from_run(run, plan.gpu_mem_gib or 24.0) if run else None
    budget = spec = None
    memory_result = CheckResult("memory", NA, "needs a recipe (or --set) and a model config")
    host_result = CheckResult("host_memory", NA, "needs a recipe (or --set) and a model config")
    if estimate_settings and config:
        if gpus and not plan.gpu_mem_gib:
            estimate_settings = replace(estimate_settings, gpu_mem_gib=min(gpu.memory_gib for gpu in gpus))
        try:
            spec = model_inventory.model_spec(config)
            budget = memory_budget.estimate(spec, estimate_settings, str(model))
            memory_result = check_memory(budget, spec)
            host_result = check_host_memory(budget, spec, plan.meminfo)
        except ValueError as error:
            memory_result = CheckResult("memory", NA, f"not estimated: {error}")
            host_result = CheckResult("host_memory", NA, f"not estimated: {error}")

    need_gpus = estimate_settings.gpus if estimate_settings else None
    results.append(check_gpus(gpus, source, need_gpus, plan.gpu_mem_gib))
    results.append(check_ptrace_scope())
    results.append(check_cap_sys_ptrace())
    pidfd_result = check_pidfd_getfd(env)
    results.append(pidfd_result)
    transport = run.setting("sync.transport") if run else settings.read("sync.transport", env)
    results.append(check_transport(transport, gpus, pidfd_result))
    results.append(check_alloc_conf(env))
    results.append(check_dev_shm())
    results.append(check_nccl_p2p(gpus, env))
    results.append(check_wandb(env, flags))

    ckpt = run.args.ckpt if run else None
    output_dir = Path((ckpt and (ckpt.path or ckpt.output_dir)) or plan.output_dir)
    if budget and ckpt.save_steps > 0:
        per_checkpoint = 2.0 * spec.total_parameters + 16.0 * budget.lora_parameters
        need = ckpt.max_num * per_checkpoint + 5 * GIB
        reason = f"{ckpt.max_num} DeepSpeed checkpoints of {per_checkpoint / GIB:.0f} GiB + 5"
    else:
        need, reason = 5 * GIB, "adapters and logs; no periodic DeepSpeed checkpoints"
    results.append(check_disk(output_dir, need, reason))
    results.append(model_result)
    results.append(check_data(run, Path.cwd()))
    results.append(check_reward(run, Path.cwd()))
    results.append(check_packages(plan.stack or ("gpu" if gpus else "cpu")))
    results.append(memory_result)
    results.append(host_result)
    results.append(check_lora_config(run, model_result.details.get("config") or model))
    return results


def load_plan_run(recipe, overrides=(), model=None, gpus=None, environ=None) -> Run | None:
    """The run preflight checks: the recipe (path or name) with --set overrides, --model and --gpus as the
    recipe keys they stand for; None without a recipe or overrides. Raises recipe.RecipeError."""
    overrides = list(overrides)
    if model:
        overrides.append(f"actor.model_name_or_path={model}")
    if gpus:
        overrides += ["actor.num_nodes=1", f"actor.num_gpus_per_node={gpus}"]
    if recipe is None and not overrides:
        return None
    return load_run(recipe, overrides, environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", help="recipes/NAME.yaml, or NAME")
    parser.add_argument("--model", help="model directory or hub id (default: the recipe's)")
    parser.add_argument("--gpus", type=int, help="GPUs the run uses (default: the recipe's)")
    parser.add_argument("--gpu-mem-gib", type=float, help="memory per GPU (default: detected, else 24)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"), help="where checkpoints go")
    parser.add_argument("--stack", choices=("cpu", "gpu"), help="pinned stack (default: gpu where a GPU is)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe key")
    parser.add_argument("--json", action="store_true", help="one JSON object per check")
    args = parser.parse_args(argv)

    try:
        run = load_plan_run(args.recipe, args.set, args.model, args.gpus)
    except RecipeError as error:
        print("\n".join(f"preflight: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    results = run_checks(Plan(run, args.gpu_mem_gib, args.output_dir, args.stack))
    for result in results:
        if args.json:
            print(json.dumps(asdict(result), default=str))
        else:
            print("\n".join(result.lines()))
    failed = [r.name for r in results if r.status == FAIL]
    if not args.json:
        names = f" ({', '.join(failed)})" if failed else ""
        print(f"preflight: {len(results)} checks, {len(failed)} failed{names}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
