"""The one recipe path: a recipe (recipes/*.yaml) or a launcher's argv -> a checked Run (OpenRLHF 0.11.2's
train_ppo_ray flags, this repo's environment variables, and OpenRLHF's own parsed arguments).

    run = load_run("qwen3_vl-8b-4x4090", ["rollout.batch_size=16"])   # raises RecipeError
    run.argv, run.env, run.args.ds.lora.rank, run.setting("sync.mode")

Every entry point goes through it: scripts/render_recipe.py (and run_grpo_lora.sh, --dry-run), preflight,
memory_budget (--recipe), the CPU run (cpu_run) and the launcher (run_from_argv), so the same bad input
gets the same message everywhere. Hardware: none; imports no vLLM, Ray or DeepSpeed, and torch only to
expand a LoRA target rule (lora_targets.py, on the model built weightless).

Covers
- Loading: a recipe is a YAML mapping with nested or dotted keys; `base: other.yaml` (or a list, paths
  relative to the recipe) names the recipe(s) it changes, merged key by key; then `key=value` overrides,
  each value parsed as YAML (`ds.lora.rank=32`, `ds.lora.target_modules=[q_proj,v_proj]`, `key=null`
  unsets; `key=` is refused as an empty value). A key given twice in one file is an error, not a silent
  last-one-wins. A recipe is a path or a bare name in recipes/.
- Validation from the parser's own actions, not a second schema: a key must be a train_ppo_ray option
  or one of this repo's settings (settings.SETTINGS, checked by settings.Setting.parse: type, choices,
  lower bound); a value is converted the way argparse converts a command-line token (its type=, nargs,
  choices), so a wrong type exits naming the key and the expected type; a switch takes true/false; an
  empty string is refused. Unknown keys get close matches (difflib).
- Mapping: true/false -> a store_true flag present/absent (turning off a flag whose default is on uses its
  store_false twin, e.g. actor.muon.no_nesterov); a list -> the flag's values (nargs); null -> left out,
  so OpenRLHF's default applies (a recipe unsets a base key with null). Repo settings -> environment
  variables. ds.lora.target_modules: a rule (lora_targets.RULES) -> the module names it stands for on
  actor.model_name_or_path, noted in Run.notes; module names as given.
- Then train_ppo_ray's own `__main__` code on the flags (its parser, its hierarchize and its post-parse
  checks), up to the `train(args)` call, which is not made; LAUNCH_CHECKS, the GPU-layout asserts at the
  top of upstream `train()` and DeepSpeed's batch-size rule; and config_checks.run_problems (DoRA, LoRA
  off or a negative rank, adapter ranks vLLM refuses, trainer offload without ZeRO-3).
Does not cover: whether the model, data and GPUs exist or the run fits in memory (preflight.py,
memory_budget.py), nor anything OpenRLHF checks later, when models load.

How --dry-run gets OpenRLHF's parser: train_ppo_ray builds its parser inline in `if __name__ ==
"__main__":`, so it cannot be imported. This file parses the module's source (located without importing
openrlhf), executes the statements of that block that come before `parse_args`, with the module's
standard-library imports, to build the parser; then the rest of the block with `parse_args` bound to the
rendered flags and `train` replaced by a function that records the parsed args. Chosen over running the
whole module under runpy with a patched `ArgumentParser.parse_args`: that imports ray, vLLM, torch and
DeepSpeed (tens of seconds: docs/reliability.md; CUDA probing on a GPU host) and patches argparse
process-wide, while the parser and checks executed here are still OpenRLHF's own code, line for line.
If an OpenRLHF release moves the parser out of that block, this fails loudly (RecipeError) instead of
checking nothing.
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
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import yaml

from openrlhf_lora_sync import REPO_ROOT
from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.config import config_checks, lora_targets

RECIPES_DIR = REPO_ROOT / "recipes"
LAUNCH_MODULE = "openrlhf_lora_sync.patch.launch"
BASE_KEY = "base"
# OpenRLHF 0.11.2 starts its wandb logger only when --logger.wandb.key is non-empty, and uses the value only
# when wandb has no key of its own (WANDB_API_KEY, ~/.netrc) and is online. So a key is never written into
# the command: this stand-in turns the logger on, and wandb takes the real key from the environment.
WANDB_KEY_STAND_IN = "from-WANDB_API_KEY"
WANDB_HOST = "api.wandb.ai"
SECRET_FLAGS = ("--logger.wandb.key",)
MEMORY_LINE_PREFIX = "# memory (GiB/GPU, from scripts/memory_budget.py): "  # as in each recipe's header
# A peft target list entry is matched as a module-name suffix; OpenRLHF's nargs="*" always makes a list.
MODULE_SUFFIX = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


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
    raise RecipeError(
        f"{recipe}: no such recipe file, nor a name in {RECIPES_DIR} ({', '.join(names)})", (BASE_KEY,)
    )


def yaml_error_line(path: Path, error: yaml.YAMLError) -> str:
    """One line for a recipe YAML cannot parse: the file, YAML's line and column (1-based, as editors
    count) and YAML's own reason."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
    reason = (
        " ".join(part for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
        or str(error).splitlines()[0]
    )
    hint = "; YAML indents with spaces, never tabs" if r"\t" in reason else ""  # YAML writes a tab as \t
    return f"{where}: not valid YAML ({reason}){hint}"


def load_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The recipe as {dotted key: value}, its `base:` recipes merged under it, in file order."""
    path = Path(path).resolve()
    if not path.is_file():
        via = f" (named by `base:` in {_chain[-1]})" if _chain else ""
        raise RecipeError(f"{path}: no such recipe file{via}", (BASE_KEY,))
    if path in _chain:
        raise RecipeError(f"{path}: `base:` loops back to itself ({' -> '.join(p.name for p in _chain)})")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise RecipeError(yaml_error_line(path, error)) from None
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
    if not raw.strip():
        raise RecipeError(
            f"{text!r}: empty value; give {key} a value, or {key}=null to leave it out (OpenRLHF's or the "
            "setting's default)",
            (key,),
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if isinstance(value, dict):  # `key=a: b` reads as a mapping; a flag value never is one
        value = raw
    return key, value


def apply_overrides(flags: dict, overrides: list[str]) -> dict:
    """`flags` with the overrides applied; RecipeError naming every malformed one."""
    merged, errors, keys = dict(flags), [], []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except RecipeError as error:
            errors.append(str(error))
            keys += error.keys
            continue
        merged[key] = value
    if errors:
        raise RecipeError("\n".join(errors), tuple(keys))
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


def _lora_targets(values: list, flags: dict, notes: list[str]) -> list:
    """ds.lora.target_modules as OpenRLHF passes it to peft: a rule (lora_targets.RULES) expanded on the
    recipe's model, else the module names as given; RecipeError for what would match nothing."""
    rules = [value for value in values if lora_targets.is_rule(value)]
    if rules and len(values) > 1:
        raise RecipeError(
            f"{lora_targets.KEY}: a rule ({rules[0]}) stands alone; give one rule or a list of module names",
            (lora_targets.KEY,),
        )
    if rules:
        model = flags.get("actor.model_name_or_path")
        if isinstance(model, str) and not model.strip():
            return values  # the model's own key reports the empty value
        if model is None:
            raise RecipeError(
                f"{lora_targets.KEY}: no model to expand the rule {rules[0]} on: set "
                "actor.model_name_or_path (--model of memory_budget.py and preflight.py)",
                (lora_targets.KEY,),
            )
        try:
            expanded, note = lora_targets.expand(rules[0], model)
        except lora_targets.TargetRuleError as error:
            raise RecipeError(str(error), (lora_targets.KEY,)) from None
        notes.append(f"{lora_targets.KEY} {note}")
        return expanded
    odd = [v for v in values if v == "all-linear" or not MODULE_SUFFIX.fullmatch(str(v))]
    if odd:
        raise RecipeError(
            f"{lora_targets.KEY}: {odd} would match nothing: OpenRLHF's --{lora_targets.KEY} takes a list "
            "(nargs='*'), and peft matches list entries as module-name suffixes, never as a regex or as "
            "'all-linear' (peft raises NoMatchingPeftModuleError when the run starts). Give a rule "
            f"({', '.join(lora_targets.RULES)}), list module names (q_proj, layers.0.mlp.gate_proj, ...), "
            "or set the key to null for OpenRLHF's default 'all-linear'",
            (lora_targets.KEY,),
        )
    return values


def _known_keys(parser: argparse.ArgumentParser) -> list[str]:
    options = [o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")]
    return [*options, *settings.BY_KEY]


def _unknown_key(key: str, parser: argparse.ArgumentParser) -> RecipeError:
    close = difflib.get_close_matches(key, _known_keys(parser), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return RecipeError(f"{key}: not an OpenRLHF 0.11.2 train_ppo_ray flag nor a repo key{hint}", (key,))


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
    # DoRA keys are no OpenRLHF flag: name what they ask for rather than call them unknown.
    problems = config_checks.dora_problems(flags, flags)
    argv, env, notes = [], {}, []
    errors, bad_keys = [str(problem) for problem in problems], [problem.key for problem in problems]
    for key, value in flags.items():
        if key in bad_keys:
            continue
        try:
            if isinstance(value, str) and not value.strip():
                raise RecipeError(f"{key}: empty value; give a value, or null for the default", (key,))
            if key in settings.BY_KEY:
                if value is not None:
                    setting = settings.BY_KEY[key]
                    try:
                        env[setting.env] = setting.to_env(value)
                    except settings.SettingError as error:
                        raise RecipeError(f"{error} (repo key -> {setting.env})", (key,)) from None
                continue
            action = parser._option_string_actions.get(f"--{key}")
            if action is None:
                raise _unknown_key(key, parser)
            if value is None:
                continue
            if action.nargs == 0:
                argv += _switch(key, value, action, parser)
                continue
            values = _values(key, value, action)
            if key == lora_targets.KEY:
                values = _lora_targets(values, flags, notes)
            argv += [f"--{key}", *(str(v) for v in values)]
        except RecipeError as error:
            errors.append(str(error))
            bad_keys += error.keys
    if errors:
        raise RecipeError("\n".join(errors), tuple(bad_keys))

    rendered = Rendered(argv, env, notes)
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
    except Exception as error:  # OpenRLHF's own checks, tripping over a value they never expected
        line = next(
            (
                f.lineno
                for f in reversed(traceback.extract_tb(error.__traceback__))
                if f.filename == str(program.source_path)
            ),
            "?",
        )
        raise RecipeError(
            f"OpenRLHF's train_ppo_ray fails on these flags ({program.source_path.name} line {line}: "
            f"{type(error).__name__}: {error}); a flag it needs is probably unset (null), e.g. "
            "reward.remote_url or reward.model_name_or_path, or algo.advantage.estimator"
        ) from None
    if not captured:
        raise RecipeError(f"{program.source_path}: its __main__ block no longer ends in train(args)")
    args = captured[0]
    problems = [message for check, message in LAUNCH_CHECKS if check(args)]
    if problems:
        raise RecipeError("upstream train() would reject the flags: " + "; ".join(problems))
    return args, [line for line in printed.getvalue().splitlines() if line.strip()]


# ------------------------------------------------------------------------------- the one recipe path


@dataclass
class Run:
    """A run as every entry point sees it: the recipe keys, what they render to, and OpenRLHF's own parsed
    arguments (its defaults filled in), checked by OpenRLHF's parser and checks and by config_checks."""

    path: Path | None  # the recipe file; None for flags given on a command line
    flags: dict  # recipe keys after overrides, null values kept (what --resolved writes)
    argv: list[str]  # train_ppo_ray flags
    env: dict[str, str]  # this repo's settings the recipe sets, as environment variables
    args: SimpleNamespace  # train_ppo_ray's hierarchized args: args.ds.lora.rank, args.vllm.num_engines, ...
    environ: Mapping[str, str]  # the environment the settings fall back to
    notes: list[str] = field(default_factory=list)  # what was decided (wandb mode) and warnings

    def setting(self, name: str):
        """A repo setting's typed value: the recipe's key, else the environment, else its default."""
        return settings.resolve(name, self.flags, self.environ)


def _environment_errors(flags: Mapping, environ: Mapping[str, str]) -> list[str]:
    """Settings the recipe leaves to the environment whose variable holds a value they refuse."""
    errors = []
    for setting in settings.SETTINGS:
        if setting.key and flags.get(setting.key) is not None:
            continue
        try:
            settings.read(setting.env, environ)
        except settings.SettingError as error:
            where = f"; recipe key {setting.key}" if setting.key else ""
            errors.append(f"{error} (from the environment{where})")
    return errors


def _checked(path, flags, argv, env, environ, notes) -> Run:
    args, printed = dry_run(argv)
    if errors := _environment_errors(flags, environ):
        raise RecipeError("\n".join(errors))
    run = Run(path, flags, argv, env, args, environ, [*notes, *(f"OpenRLHF: {line}" for line in printed)])
    problems = config_checks.run_problems(run)
    fatal = [problem for problem in problems if problem.fatal]
    if fatal:
        raise RecipeError("\n".join(map(str, fatal)), tuple(problem.key for problem in fatal))
    run.notes += [f"warning: {problem}" for problem in problems]
    return run


def load_run(recipe: str | Path | None, overrides: Sequence[str] = (), environ=None) -> Run:
    """The one recipe path: `recipe` (a path, a name in recipes/, or None for OpenRLHF's defaults) loaded
    with its `base:` chain, `key=value` overrides applied, every key checked and rendered, OpenRLHF's parser
    and launch checks run on the flags, then config_checks.run_problems. Raises RecipeError listing every
    problem, each naming its key and fix; starts nothing and imports nothing heavy."""
    environ = os.environ if environ is None else environ
    path = resolve_recipe_path(recipe) if recipe is not None else None
    flags = apply_overrides(load_recipe(path) if path else {}, list(overrides))
    rendered = render(flags, environ)
    return _checked(path, flags, rendered.argv, rendered.env, environ, rendered.notes)


def run_from_argv(argv: Sequence[str], environ=None) -> Run:
    """The launcher's flags (train_ppo_ray argv, by hand or rendered) through the same parser and checks;
    `flags` holds the keys the argv names (for the DoRA check and the notes), values from OpenRLHF."""
    environ = os.environ if environ is None else environ
    keys = [token[2:].partition("=")[0] for token in argv if token.startswith("--")]
    errors = [str(problem) for problem in config_checks.dora_problems(keys)]
    parser, _ = openrlhf_parser()
    for key in keys:
        if "dora" in key.lower() or f"--{key}" in parser._option_string_actions:
            continue
        if key in settings.BY_KEY:
            env = settings.BY_KEY[key].env
            errors.append(f"{key}: a repo key, not a train_ppo_ray flag: set it in the recipe or as {env}")
        else:
            errors.append(str(_unknown_key(key, parser)))
    if errors:
        raise RecipeError("\n".join(errors), tuple(keys))
    return _checked(None, dict.fromkeys(keys, True), list(argv), {}, environ, [])
