"""The run's reward file checked before anything starts: loaded and called as OpenRLHF 0.11.2 does it.

    python -m openrlhf_lora_sync.config.reward_check --recipe recipes/R.yaml [--set KEY=VALUE ...]

OpenRLHF loads `--reward.remote_url FILE.py` in every vLLM engine actor (SingleTurnAgentExecutor's
constructor: `spec_from_file_location`, then the module's `reward_func`) and calls it once per sample, from
a worker thread (`asyncio.to_thread(reward_func, [query], [prompt], [label])`, query = prompt + response).
It expects a dict: `rewards`, a tensor with one number per query (a plain number works too); optional
`scores` (the same shape) and `extra_logs` (names to numbers, copied into the metrics). What goes wrong
there surfaces minutes later, far from the cause (patch/reward_errors.py is the run-time side).

This module loads the file with OpenRLHF's own constructor and calls `reward_func` the same way, in the
run's environment (its REWARD_* settings), on the first rows of the run's prompt dataset (a stand-in row
when the dataset cannot be read here: preflight's data check reports that) with stand-in completions: the
label itself, an empty one, and a long garbage string. The first failure is one line naming the file,
the case, the error and its line in the file (exit 2): a file that does not load, no `reward_func`, a call
that raises, or a return that is not OpenRLHF's dict. Preflight runs the same check (its `reward` line).
Does not cover: HTTP reward servers (remote_url not a .py file), agent functions (train.agent_func_path),
whether the reward is right, rewards that hang (no timeout here), or prompts rendered with the model's
chat template (the stand-in prompt is the row's text).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from numbers import Number
from pathlib import Path

from openrlhf_lora_sync.config.dataset_rows import load_local_dataset
from openrlhf_lora_sync.config.recipe import RecipeError, Run, load_run

ROWS_CALLED = 3  # dataset rows each stand-in completion is scored on
GARBAGE = "".join(chr(0x20 + (i * 7919) % 0x2FFF) for i in range(4096))  # printable, symbols, CJK, no sense
STAND_IN_COMPLETIONS: tuple[tuple[str, Callable[[object], str]], ...] = (
    ("the label as the completion", lambda label: "" if label is None else str(label)),
    ("an empty completion", lambda label: ""),
    ("a 4096-character garbage completion", lambda label: GARBAGE),
)
STAND_IN_ROW = {"prompt": "What is 1 + 1?", "label": "2"}  # when the dataset cannot be read here


class RewardFileError(Exception):
    """One line: the reward file, what was tried, what went wrong and where in the file."""


def reward_file(run: Run) -> str | None:
    """The run's reward file: reward.remote_url when it names a .py file (OpenRLHF's rule), else None."""
    urls = run.args.reward.remote_url or []
    urls = [urls] if isinstance(urls, str) else urls
    return urls[0] if urls and urls[0].endswith(".py") else None


def prompt_text(prompt) -> str:
    """A stand-in for the rendered prompt: a string as it is, a chat message list as its text items."""
    if isinstance(prompt, str):
        return prompt
    texts = []
    for message in prompt if isinstance(prompt, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        for item in content if isinstance(content, list) else []:
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                texts.append(item["text"])
    return "\n".join(texts)


def where(error: BaseException, path: Path) -> str:
    """Where `error` happened: its line in the reward file when it did (the deepest such frame), else the
    deepest frame of the traceback."""
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename).resolve() == path:
        return f"line {error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    in_file = [frame for frame in frames if Path(frame.filename).resolve() == path]
    if in_file:
        return f"line {in_file[-1].lineno}"
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}"
    return "no traceback"


def describe(error: BaseException, path: Path) -> str:
    message = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {message} ({where(error, path)})"


def load_reward_func(path: Path) -> Callable:
    """reward_func as OpenRLHF's SingleTurnAgentExecutor loads it. Raises RewardFileError."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    agent_logger = logging.getLogger(SingleTurnAgentExecutor.__module__)
    level = agent_logger.level
    agent_logger.setLevel(logging.WARNING)  # its INFO "Loading custom reward_func" line, once per check
    try:
        return SingleTurnAgentExecutor(str(path)).reward_func
    except AttributeError as error:
        if "reward_func" in str(error):
            raise RewardFileError(f"{path}: loads, but defines no reward_func") from error
        raise RewardFileError(f"{path}: does not load: {describe(error, path)}") from error
    except Exception as error:  # whatever the module raises while it runs, SyntaxError included
        raise RewardFileError(f"{path}: does not load: {describe(error, path)}") from error
    finally:
        agent_logger.setLevel(level)


def return_problem(result) -> str | None:
    """What in reward_func's return for a one-query batch is not the dict OpenRLHF reads, or None."""
    import torch

    if not isinstance(result, dict):
        return f"returned {type(result).__name__}, not a dict with 'rewards' (a tensor, one value per query)"
    for key in ("rewards", "scores"):
        value = result.get(key)
        if value is None and key == "scores":
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = torch.tensor([value])  # OpenRLHF wraps a plain number in a tensor itself
        if not isinstance(value, torch.Tensor):
            return f"returned {key!r} as {type(value).__name__}, not a torch tensor with one value per query"
        if value.numel() != 1:
            return f"returned {key!r} with {value.numel()} values for a batch of 1 query"
        if not math.isfinite(float(value.flatten()[0])):
            return f"returned {key!r} = {float(value.flatten()[0])}, not a finite number"
    extra_logs = result.get("extra_logs") or {}
    if not isinstance(extra_logs, dict):
        return f"returned 'extra_logs' as {type(extra_logs).__name__}, not a dict of names to numbers"
    for name, value in extra_logs.items():
        if not isinstance(value, (Number, torch.Tensor)):
            return f"returned extra_logs[{name!r}] as {type(value).__name__}, not a number"
    return None


def call_as_openrlhf(reward_func: Callable, query: str, prompt: str, label):
    """One call as SingleTurnAgentExecutor._fetch_rewards_via_func makes it: a batch of one, on a thread."""
    return asyncio.run(asyncio.to_thread(reward_func, [query], [prompt], [label]))


def check_reward_file(path: Path, rows: list[tuple[str, object]]) -> int:
    """Load `path` and call its reward_func with each stand-in completion on each (prompt, label) row;
    returns the number of calls. Raises RewardFileError with one line for the first failure."""
    path = path.resolve()
    if not path.is_file():
        raise RewardFileError(f"{path}: no such file (reward.remote_url)")
    reward_func = load_reward_func(path)
    calls = 0
    for (prompt, label), (case, completion) in itertools.product(rows, STAND_IN_COMPLETIONS):
        query = prompt + completion(label)
        shown = f"{case}, label {label!r}"[:120]
        try:
            result = call_as_openrlhf(reward_func, query, prompt, label)
        except Exception as error:
            cause = describe(error, path)
            raise RewardFileError(f"{path}: reward_func raised on {shown}: {cause}") from error
        problem = return_problem(result)
        if problem:
            raise RewardFileError(f"{path}: reward_func {problem} (on {shown})")
        calls += 1
    return calls


def dataset_rows(run: Run, workdir: Path, limit: int = ROWS_CALLED) -> list[tuple[str, object]]:
    """(prompt text, label) of the first rows of the run's first prompt dataset, read as preflight reads
    it; the stand-in row when it cannot be read here."""
    data = run.args.data
    name, _, data_dir = (part.strip() for part in (data.prompt_dataset or "").split(",")[0].partition("@"))
    rows = []
    if name and (workdir / name).exists():
        try:
            loaded = load_local_dataset(workdir / name, data_dir or None)
            if isinstance(loaded, dict):
                loaded = loaded[data.prompt_split]
            rows = list(itertools.islice(loaded, limit))
        except Exception:  # datasets raises many types; preflight's data check names the problem
            rows = []
    rows = rows or [STAND_IN_ROW]
    input_key, label_key = data.input_key or "prompt", data.label_key or "label"
    return [(prompt_text(row.get(input_key)), row.get(label_key)) for row in rows]


@contextlib.contextmanager
def run_environment(env: dict[str, str]):
    """os.environ with the run's variables (REWARD_*, which reward files read), restored afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_run_reward(run: Run, workdir: Path) -> tuple[str | None, int]:
    """(the run's reward file, calls made) after checking it; (None, 0) without a reward file. Raises
    RewardFileError."""
    name = reward_file(run)
    if name is None:
        return None, 0
    rows = dataset_rows(run, workdir)
    with run_environment(run.env):
        return name, check_reward_file(workdir / name, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipes/NAME.yaml, or NAME")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe key")
    args = parser.parse_args(argv)
    try:
        run = load_run(args.recipe, args.set)
        name, calls = check_run_reward(run, Path.cwd())
    except (RecipeError, RewardFileError) as error:
        print("\n".join(f"reward_check: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    if name is None:
        print("reward_check: the run names no reward file (reward.remote_url is not a .py file): not checked")
    else:
        print(f"reward_check: {name}: reward_func returned OpenRLHF's dict in {calls} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
