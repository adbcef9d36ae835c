#!/usr/bin/env python3
"""Render a recipe (recipes/*.yaml) into OpenRLHF 0.11.2's train_ppo_ray flags plus this repo's environment
variables, and check them with OpenRLHF's own argument parser.

    python scripts/render_recipe.py RECIPE [key=value ...] [--dry-run] [--print-env] [--resolved OUT]
                                    [--exec]

RECIPE is a path or a name in recipes/ (`qwen3_vl-8b-4x4090`). Prints the launch command (`env VARS python
-m openrlhf_lora_sync.launch FLAGS`); exits 2 naming the key when the recipe is wrong.
Hardware: none. Starts nothing (no Ray, vLLM, torch or GPU); about a second.

Covers
- Loading: a recipe is a YAML mapping with nested or dotted keys; `base: other.yaml` (or a list, paths
  relative to the recipe) names the recipe(s) it changes, merged key by key; then `key=value` overrides,
  each value parsed as YAML (`ds.lora.rank=32`, `ds.lora.target_modules=[q_proj,v_proj]`, `key=` unsets).
  A key given twice in one file is an error, not a silent last-one-wins.
- Validation from the parser's own actions, not a second schema: a key must be a train_ppo_ray option
  (or one of REPO_KEYS); a value is converted the way argparse converts a command-line token (its type=,
  nargs, choices), so a wrong type exits naming the key and the expected type; a switch takes true/false.
  Unknown keys get close matches (difflib).
- Mapping: true/false -> a store_true flag present/absent (turning off a flag whose default is on uses its
  store_false twin, e.g. actor.muon.no_nesterov); a list -> the flag's values (nargs); null -> left out,
  so OpenRLHF's default applies (a recipe unsets a base key with null).
- This repo's own keys (REPO_KEYS: sync, reward weights, wandb mode) -> environment variables.
- Configurations the patch cannot run, named with their fix (openrlhf_lora_sync.config_checks: DoRA keys,
  a run without LoRA); the checks against the model and the host are preflight's.
- --dry-run: runs train_ppo_ray's own `__main__` code on the flags (its parser, its hierarchize and its
  post-parse checks), up to the `train(args)` call, which is not made; then LAUNCH_CHECKS: the GPU-layout
  asserts at the top of upstream `train()` and DeepSpeed's batch-size rule; prints the command, the
  environment and the memory estimate of scripts/memory_budget.py.
- --exec: replaces this process with the launch command (what scripts/run_grpo_lora.sh does last).
Does not cover: whether the model, data and GPUs exist or the run fits in memory (scripts/preflight.py),
nor anything OpenRLHF checks later, when models load.

How --dry-run gets OpenRLHF's parser: train_ppo_ray builds its parser inline in `if __name__ ==
"__main__":`, so it cannot be imported. This file parses the module's source (located without importing
openrlhf), executes the statements of that block that come before `parse_args`, with the module's
standard-library imports, to build the parser; then the rest of the block with `parse_args` bound to the
rendered flags and `train` replaced by a function that records the parsed args. Chosen over running the
whole module under runpy with a patched `ArgumentParser.parse_args`: that imports ray, vLLM, torch and
DeepSpeed (about 20 s on 2 cores, CUDA probing on a GPU host) and patches argparse process-wide, while
the parser and checks executed here are still OpenRLHF's own code, line for line. If an OpenRLHF release
moves the parser out of that block, this fails loudly (RecipeError) instead of checking nothing.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import importlib.util
import io
import netrc
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as `python scripts/render_recipe.py`: make `rewards` importable

from openrlhf_lora_sync import config_checks  # noqa: E402

from rewards.math_answer import ANSWER_FORMATS  # noqa: E402

if __package__:
    from . import memory_budget
else:  # run as a script: scripts/ is sys.path[0]
    import memory_budget

RECIPES_DIR = ROOT / "recipes"
LAUNCH_MODULE = "openrlhf_lora_sync.launch"
BASE_KEY = "base"
# LORA_SYNC_TRANSPORT values openrlhf_patch accepts (transport.TRANSPORT_CHOICES; a test keeps them equal)
SYNC_TRANSPORTS = ("auto", "shm", "cuda_ipc", "broadcast")
WANDB_MODES = ("auto", "online", "offline", "disabled")
# OpenRLHF 0.11.2 starts its wandb logger only when --logger.wandb.key is non-empty, and uses the value only
# when wandb has no key of its own (WANDB_API_KEY, ~/.netrc) and is online. So a key is never written into
# the command: this stand-in turns the logger on, and wandb takes the real key from the environment.
WANDB_KEY_STAND_IN = "from-WANDB_API_KEY"
WANDB_HOST = "api.wandb.ai"
SECRET_FLAGS = ("--logger.wandb.key",)
MEMORY_LINE_PREFIX = "# memory (GiB/GPU, from scripts/memory_budget.py): "  # as in each recipe's header
# A peft target list entry is matched as a module-name suffix; OpenRLHF's nargs="*" always makes a list.
MODULE_SUFFIX = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")

# This repo's own recipe keys: environment variables for the sync patch (openrlhf_patch.py), the reward
# (rewards/math_answer.py) and wandb, declared as argparse options so they are checked like OpenRLHF's.
REPO_KEYS: dict[str, tuple[str, dict]] = {
    "sync.mode": ("LORA_SYNC_MODE", {"type": str, "choices": config_checks.SYNC_MODES}),
    "sync.transport": ("LORA_SYNC_TRANSPORT", {"type": str, "choices": SYNC_TRANSPORTS}),
    "sync.bucket_mb": ("LORA_SYNC_BUCKET_MB", {"type": int}),
    "sync.force_full": ("LORA_SYNC_FORCE_FULL", {"action": "store_true"}),
    "sync.vllm_sleep_level": ("LORA_SYNC_VLLM_SLEEP_LEVEL", {"type": int, "choices": (1, 2)}),
    "sync.probe_every": ("LORA_SYNC_PROBE_EVERY", {"type": int}),
    "sync.reference_from_base": ("LORA_SYNC_REFERENCE_FROM_BASE", {"action": "store_true"}),
    "trainer.offload_params": ("LORA_SYNC_OFFLOAD_PARAMS", {"action": "store_true"}),
    "reward.accuracy_weight": ("REWARD_ACCURACY_WEIGHT", {"type": float}),
    "reward.format_weight": ("REWARD_FORMAT_WEIGHT", {"type": float}),
    "reward.answer_format": ("REWARD_ANSWER_FORMAT", {"type": str, "choices": ANSWER_FORMATS}),
    "logger.wandb.mode": ("WANDB_MODE", {"type": str, "choices": WANDB_MODES}),
}


class RecipeError(ValueError):
    """A recipe that cannot be rendered or that OpenRLHF rejects; `keys` names the recipe keys at fault."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = keys


# ------------------------------------------------------------------------------------------ loading


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise RecipeError(f"{key_node.start_mark}: key {key!r} is given twice", (str(key),))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def flatten(mapping: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A recipe path as given, else a name in recipes/ (with or without .yaml)."""
    path = Path(recipe)
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / path.name, RECIPES_DIR / f"{path.name}.yaml"):
        if candidate.is_file():
            return candidate
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise RecipeError(f"{recipe}: no such recipe file, nor a name in recipes/ ({', '.join(names)})")


def load_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The recipe as {dotted key: value}, its `base:` recipes merged under it, in file order."""
    path = Path(path).resolve()
    if path in _chain:
        raise RecipeError(f"{path}: `base:` loops back to itself ({' -> '.join(p.name for p in _chain)})")
    data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of keys to values")
    bases = data.pop(BASE_KEY, None) or []
    flags: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        flags.update(load_recipe(path.parent / base, (*_chain, path)))
    flags.update(flatten(data))
    return flags


def parse_override(text: str) -> tuple[str, object]:
    """`key=value` with the value read as YAML (`4`, `true`, `[a, b]`, `1e-5` stays a string for argparse)."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise RecipeError(f"{text!r}: an override is key=value")
    if key == BASE_KEY:
        raise RecipeError("`base` cannot be overridden; pass that recipe instead", (BASE_KEY,))
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if isinstance(value, dict):  # `key=a: b` reads as a mapping; a flag value never is one
        value = raw
    return key, value


def apply_overrides(flags: dict, overrides: list[str]) -> dict:
    merged = dict(flags)
    merged.update(parse_override(text) for text in overrides)
    return merged


# ---------------------------------------------------------------------------------- OpenRLHF parser


@dataclass(frozen=True)
class _ParserProgram:
    """train_ppo_ray's `__main__` block, compiled in two parts, and what executing it needs."""

    source_path: Path
    build: object  # code: standard-library imports + the statements before parse_args
    check: object  # code: parse_args and the post-parse checks, up to train(args)
    preset: dict  # names the check part imports, loaded without importing the openrlhf package


def _openrlhf_dir() -> Path:
    spec = importlib.util.find_spec("openrlhf")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError("openrlhf is not installed in this Python (bash scripts/setup_env.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
    )


def _calls_parse_args(node: ast.stmt) -> bool:
    return any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "parse_args"
        for sub in ast.walk(node)
    )


def _is_stdlib_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return all(alias.name.split(".")[0] in sys.stdlib_module_names for alias in node.names)
    return (
        isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module.split(".")[0] in sys.stdlib_module_names
    )


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _parser_program() -> _ParserProgram:
    package = _openrlhf_dir()
    path = package / "cli" / "train_ppo_ray.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    main = next((node for node in tree.body if _is_main_guard(node)), None)
    split = next((i for i, node in enumerate(main.body) if _calls_parse_args(node)), None) if main else None
    if split is None:
        raise RecipeError(
            f"{path}: no `parser.parse_args()` in an `if __name__ == '__main__':` block; this OpenRLHF "
            "release builds its parser elsewhere, so --dry-run cannot check flags against it"
        )
    stdlib_imports = [node for node in tree.body if _is_stdlib_import(node)]
    # The check part imports hierarchize from openrlhf.utils.config, whose package __init__ imports torch
    # and DeepSpeed; the module itself is plain Python, so it is loaded by path and the import skipped.
    config = _load_by_path("_openrlhf_utils_config", package / "utils" / "config.py")
    check_body, preset = [], {}
    for node in main.body[split:]:
        if isinstance(node, ast.ImportFrom) and node.module == "openrlhf.utils.config":
            preset.update({alias.asname or alias.name: getattr(config, alias.name) for alias in node.names})
        else:
            check_body.append(node)

    def compiled(body):
        return compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")

    return _ParserProgram(path, compiled(stdlib_imports + main.body[:split]), compiled(check_body), preset)


def _raise_parse_error(message: str):
    raise RecipeError(f"OpenRLHF's train_ppo_ray parser rejected the flags: {message}")


def openrlhf_parser() -> tuple[argparse.ArgumentParser, dict]:
    """A fresh train_ppo_ray parser, built by OpenRLHF's own statements, and the namespace they ran in."""
    program = _parser_program()
    namespace = {"__name__": "__openrlhf_train_ppo_ray_dry_run__", "__file__": str(program.source_path)}
    exec(program.build, namespace)
    parser = namespace.get("parser")
    if not isinstance(parser, argparse.ArgumentParser):
        raise RecipeError(
            f"{program.source_path}: its __main__ block no longer builds `parser` before parsing"
        )
    parser.error = _raise_parse_error  # argparse reports through self.error; raise instead of exiting
    return parser, namespace


@functools.cache
def _repo_key_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    for key, (_, options) in REPO_KEYS.items():
        parser.add_argument(f"--{key}", **options)
    return parser


# --------------------------------------------------------------------------------------- rendering


@dataclass
class Rendered:
    argv: list[str]  # train_ppo_ray flags
    env: dict[str, str]  # this repo's settings
    notes: list[str] = field(default_factory=list)

    def command(self, python: str = "python", mask_secrets: bool = True) -> list[str]:
        argv = list(self.argv)
        if mask_secrets:
            for i, token in enumerate(argv[:-1]):
                if token in SECRET_FLAGS and argv[i + 1] != WANDB_KEY_STAND_IN:
                    argv[i + 1] = "***"
        return [python, "-m", LAUNCH_MODULE, *argv]

    def shell_command(self, python: str = "python") -> str:
        """`env VARS python -m ... \\` with one flag and its values per line."""
        lines = ["env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items()) + " \\"]
        command = self.command(python)
        current = " ".join(shlex.quote(t) for t in command[:3])
        for token in command[3:]:
            if token.startswith("--"):
                lines.append(f"  {current} \\")
                current = token
            else:
                current += " " + shlex.quote(token)
        lines.append(f"  {current}")
        return "\n".join(lines)


def _type_name(action: argparse.Action) -> str:
    return getattr(action.type, "__name__", str(action.type)) if action.type else "str"


def _convert(key: str, value, action: argparse.Action):
    """One value, converted the way argparse converts a command-line token for this option."""
    wrong = RecipeError(
        f"{key}: expected {_type_name(action)} (--{key}), got {value!r} ({type(value).__name__})", (key,)
    )
    if isinstance(value, bool | list | dict) or value is None:
        raise wrong
    try:
        converted = (action.type or str)(str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise wrong from None
    if action.choices is not None and converted not in action.choices:
        raise RecipeError(f"{key}: {converted!r} is not one of {list(action.choices)} (--{key})", (key,))
    return converted


def _values(key: str, value, action: argparse.Action) -> list:
    """The converted value(s) of an option that takes values, per its nargs."""
    nargs = action.nargs
    if nargs in (None, "?"):
        if isinstance(value, list):
            raise RecipeError(f"{key}: expected one {_type_name(action)} (--{key}), got a list", (key,))
        return [_convert(key, value, action)]
    values = value if isinstance(value, list) else [value]
    if isinstance(nargs, int) and len(values) != nargs:
        raise RecipeError(
            f"{key}: expected a list of {nargs} {_type_name(action)} values (--{key}), got {value!r}", (key,)
        )
    if nargs == "+" and not values:
        raise RecipeError(f"{key}: expected at least one value (--{key})", (key,))
    return [_convert(key, item, action) for item in values]


def _require_bool(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise RecipeError(f"{key}: expected true or false (a switch, --{key}), got {value!r}", (key,))
    return value


def _switch(key: str, value, action: argparse.Action, parser: argparse.ArgumentParser) -> list[str]:
    """The option string that gives the switch the recipe's value, or nothing when that is the default."""
    value = _require_bool(key, value)
    wanted = value if action.const is not False else not value  # `no_x: true` means dest False
    if wanted == parser.get_default(action.dest):
        return []
    twin = next(
        (a for a in parser._actions if a.dest == action.dest and a.nargs == 0 and a.const == wanted), None
    )
    if twin is None:
        raise RecipeError(f"{key}: OpenRLHF has no flag that sets it to {value}", (key,))
    return [twin.option_strings[0]]


def _lora_target_problem(values: list) -> str | None:
    odd = [v for v in values if v == "all-linear" or not MODULE_SUFFIX.fullmatch(str(v))]
    if not odd:
        return None
    return (
        f"ds.lora.target_modules: {odd} would match nothing: OpenRLHF's --ds.lora.target_modules takes "
        "a list (nargs='*'), and peft matches list entries as module-name suffixes, never as a regex or as "
        "'all-linear' (peft raises NoMatchingPeftModuleError when the run starts). List module names "
        "(q_proj, layers.0.mlp.gate_proj, ...), or set the key to null for OpenRLHF's default 'all-linear'"
    )


def _known_keys(parser: argparse.ArgumentParser) -> list[str]:
    options = [o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")]
    return [*options, *REPO_KEYS]


def wandb_has_credentials(environ) -> bool:
    """Whether wandb would find an API key: WANDB_API_KEY, or the netrc file wandb reads."""
    if environ.get("WANDB_API_KEY"):
        return True
    path = Path(environ.get("NETRC") or Path(environ.get("HOME", "~")).expanduser() / ".netrc")
    try:
        return path.is_file() and netrc.netrc(path).authenticators(WANDB_HOST) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def render(flags: dict, environ=None) -> Rendered:
    """The recipe's flags -> train_ppo_ray argv and this repo's environment. Raises RecipeError with
    every bad key at once. `environ` (default os.environ) decides logger.wandb.mode=auto."""
    environ = os.environ if environ is None else environ
    parser, _ = openrlhf_parser()
    repo_parser = _repo_key_parser()
    known = _known_keys(parser)
    # Configurations the patch cannot run (DoRA, no LoRA), with their fix, before the per-key checks.
    problems = [problem for problem in config_checks.flag_problems(flags, environ) if problem.fatal]
    argv, env = [], {}
    errors, bad_keys = [str(problem) for problem in problems], [problem.key for problem in problems]
    for key, value in flags.items():
        if key in bad_keys:
            continue
        try:
            if key in REPO_KEYS:
                if value is not None:
                    action = repo_parser._option_string_actions[f"--{key}"]
                    if action.nargs == 0:
                        env[REPO_KEYS[key][0]] = "1" if _require_bool(key, value) else "0"
                    else:
                        env[REPO_KEYS[key][0]] = str(_values(key, value, action)[0])
                continue
            action = parser._option_string_actions.get(f"--{key}")
            if action is None:
                close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                raise RecipeError(
                    f"{key}: not an OpenRLHF 0.11.2 train_ppo_ray flag nor a repo key{hint}", (key,)
                )
            if value is None:
                continue
            if action.nargs == 0:
                argv += _switch(key, value, action, parser)
                continue
            values = _values(key, value, action)
            if key == "ds.lora.target_modules" and (problem := _lora_target_problem(values)):
                raise RecipeError(problem, (key,))
            argv += [f"--{key}", *(str(v) for v in values)]
        except RecipeError as error:
            errors.append(str(error))
            bad_keys += error.keys
    if errors:
        raise RecipeError("\n".join(errors), tuple(bad_keys))

    rendered = Rendered(argv, env)
    mode = env.get("WANDB_MODE")
    if mode == "auto" and environ.get("WANDB_MODE"):
        mode = env["WANDB_MODE"] = environ["WANDB_MODE"]
        rendered.notes.append(f"logger.wandb.mode auto -> {mode} (WANDB_MODE of the environment)")
    elif mode == "auto":
        online = wandb_has_credentials(environ) or bool(flags.get("logger.wandb.key"))
        mode = env["WANDB_MODE"] = "online" if online else "offline"
        rendered.notes.append(
            f"logger.wandb.mode auto -> {mode} ({'a' if online else 'no'} wandb API key found)"
        )
    if mode is not None and mode != "disabled" and not flags.get("logger.wandb.key"):
        argv += ["--logger.wandb.key", WANDB_KEY_STAND_IN]
    return rendered


# ------------------------------------------------------------------------------------------ dry run

# The asserts at the top of upstream train() (and DeepSpeed's batch check) that reject a GPU layout before
# any model loads; --dry-run does not call train(), so they are checked here. Each: (problem, message).
LAUNCH_CHECKS = (
    (
        lambda a: (
            a.train.colocate_all
            and not a.train.async_enable
            and (a.vllm.num_engines or 0) > 0
            and a.actor.num_nodes * a.actor.num_gpus_per_node
            != a.vllm.num_engines * a.vllm.tensor_parallel_size
        ),
        "train.colocate_all: actor GPUs (actor.num_nodes x actor.num_gpus_per_node) must equal vLLM GPUs "
        "(vllm.num_engines x vllm.tensor_parallel_size)",
    ),
    (
        lambda a: (
            (a.train.colocate_all or a.train.colocate_actor_ref)
            and a.algo.kl.init_coef > 0
            and (a.actor.num_nodes, a.actor.num_gpus_per_node) != (a.ref.num_nodes, a.ref.num_gpus_per_node)
        ),
        "a colocated KL reference (algo.kl.init_coef > 0) needs ref.num_nodes / ref.num_gpus_per_node "
        "equal to the actor's (OpenRLHF's default is 8 GPUs)",
    ),
    (
        lambda a: (
            (a.train.batch_size * a.ds.ring_attn_size * a.ds.tensor_parallel_size)
            % (a.train.micro_batch_size * a.actor.num_nodes * a.actor.num_gpus_per_node)
            != 0
        ),
        "DeepSpeed: train.batch_size must be a multiple of train.micro_batch_size x actor GPUs",
    ),
)


def dry_run(argv: list[str]) -> tuple[SimpleNamespace, list[str]]:
    """Runs train_ppo_ray's own parsing and checks on argv without training; returns (the hierarchized
    args train() would get, what OpenRLHF printed). Raises RecipeError when OpenRLHF rejects the flags."""
    parser, namespace = openrlhf_parser()
    program = _parser_program()
    captured = []
    namespace.update(program.preset)
    namespace["train"] = captured.append
    parser.parse_args = functools.partial(argparse.ArgumentParser.parse_args, parser, list(argv))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(program.check, namespace)
    except AssertionError as error:
        raise RecipeError(f"OpenRLHF's train_ppo_ray rejected the flags: {error}") from None
    if not captured:
        raise RecipeError(f"{program.source_path}: its __main__ block no longer ends in train(args)")
    args = captured[0]
    problems = [message for check, message in LAUNCH_CHECKS if check(args)]
    if problems:
        raise RecipeError("upstream train() would reject the flags: " + "; ".join(problems))
    return args, [line for line in printed.getvalue().splitlines() if line.strip()]


def memory_report(flags: dict, gpu_mem_gib: float = 24.0) -> list[str]:
    """scripts/memory_budget.py's estimate for these flags: the recipe header's memory line (GiB per GPU
    per phase, and host RAM for the node), then one line per phase that does not fit."""
    model = flags.get("actor.model_name_or_path")
    if not model:
        return ["not estimated (no actor.model_name_or_path)"]
    try:
        spec = memory_budget.model_spec(memory_budget.load_config(model))
    except FileNotFoundError:
        return [f"not estimated ({model}: no config.json there, nor a reference config in memory_budget.py)"]
    except ValueError as error:
        return [f"not estimated ({error})"]
    budget = memory_budget.estimate(spec, memory_budget.settings_from_flags(flags, gpu_mem_gib))
    phases = {"rollout": "rollout", "train": "train", "sync": "sync", "delta sync": "sync_delta"}
    peaks = ", ".join(
        f"{label} {memory_budget.gib(budget.phase(name).total)}" for label, name in phases.items()
    )
    failing = [name for name in ("rollout", "train", "sync") if not budget.fits(name)]
    verdict = "fits" if not failing else f"does NOT fit ({', '.join(failing)})"
    usable, host = memory_budget.gib(budget.usable), memory_budget.gib(budget.host_bytes)
    return [f"{peaks} of {usable} usable; host RAM {host} GiB per node; {verdict}", *budget.problems()]


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipes/NAME.yaml, or NAME")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe keys to change")
    parser.add_argument("--dry-run", action="store_true", help="check with OpenRLHF's parser; start nothing")
    parser.add_argument("--print-env", action="store_true", help="print only `export VAR=value` lines")
    parser.add_argument("--resolved", type=Path, metavar="OUT", help="write the final recipe keys here")
    parser.add_argument("--exec", action="store_true", help="replace this process with the launch command")
    args = parser.parse_args(argv)

    try:
        path = resolve_recipe_path(args.recipe)
        flags = apply_overrides(load_recipe(path), args.overrides)
        rendered = render(flags)
        if args.dry_run:
            _, printed = dry_run(rendered.argv)
            rendered.notes += [f"OpenRLHF: {line}" for line in printed]
    except RecipeError as error:
        print("\n".join(f"render_recipe: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2

    if args.resolved:
        args.resolved.parent.mkdir(parents=True, exist_ok=True)
        args.resolved.write_text(yaml.safe_dump(flags, sort_keys=False))
    if args.print_env:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in rendered.env.items()))
        return 0
    if args.exec:
        command = rendered.command(sys.executable, mask_secrets=False)
        print(rendered.shell_command(sys.executable), file=sys.stderr, flush=True)
        os.execve(sys.executable, command, {**os.environ, **rendered.env})

    print(rendered.shell_command())
    for note in rendered.notes:
        print(f"# {note}")
    if args.dry_run:
        headline, *problems = memory_report(flags)
        print(MEMORY_LINE_PREFIX + headline)
        for problem in problems:
            print(f"#   {problem}")
        print(f"# dry run: {path.name} passes OpenRLHF's train_ppo_ray parser and checks; nothing started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
