"""The reward file checked before anything starts (config/reward_check.py, preflight's `reward` line).

Covers: reward files written as users write them, loaded by OpenRLHF's own SingleTurnAgentExecutor and
called as it calls them (a batch of one, from a thread), on the committed sample's rows with the stand-in
completions: each failing file (does not load, no reward_func, raises, returns what OpenRLHF cannot read)
is one line naming the file, the case, the error and its line, and its fixed twin (the negative control)
passes; the repo's own rewards pass on their recipes; the command line exits 2 with that one line; preflight
FAILs the same file; the run's REWARD_* settings reach the reward file.
Does not cover: the run-time side, a reward raising inside a running trainer (test_reward_errors.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from openrlhf_lora_sync.config import preflight, reward_check
from openrlhf_lora_sync.config.recipe import load_run

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample" / "train.jsonl"

GOOD = """\
import torch

def reward_func(queries, prompts, labels, **kwargs):
    rewards = [float(str(label) in query) for query, label in zip(queries, labels)]
    scores = torch.tensor(rewards)
    return {"rewards": scores, "scores": scores, "extra_logs": {"hit": rewards[0]}}
"""

# (case id, the broken file, its fixed twin, what the one line says besides the file's path). Each twin is the
# file as its author would fix it; it must pass, so that the check is shown to react to the fault alone.
CASES = [
    (  # the commonest bug: an index or parse that fails on some completion (here: the empty one)
        "raises",
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            answer = queries[0][len(prompts[0]):]
            first = answer.split()[0]
            return {"rewards": torch.tensor([float(first == str(labels[0]))])}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            answer = queries[0][len(prompts[0]):]
            first = (answer.split() or [""])[0]
            return {"rewards": torch.tensor([float(first == str(labels[0]))])}
        """,
        ["reward_func raised on an empty completion", "IndexError: list index out of range (line 5)"],
    ),
    (  # a file that does not parse: Python's SyntaxError, with its line
        "syntax_error",
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs)
            return {"rewards": torch.zeros(len(queries))}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(len(queries))}
        """,
        ["does not load: SyntaxError", "(line 3)"],
    ),
    (  # an import the engine actor's environment lacks: fails while the module runs
        "import_error",
        """\
        import torch
        import my_missing_scorer

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(len(queries))}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(len(queries))}
        """,
        ["does not load: ModuleNotFoundError: No module named 'my_missing_scorer' (line 2)"],
    ),
    (  # OpenRLHF looks the function up by this name only
        "missing_function",
        """\
        import torch

        def reward(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(len(queries))}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(len(queries))}
        """,
        ["loads, but defines no reward_func"],
    ),
    (  # a list of floats instead of the dict (what TRL-style reward functions return)
        "wrong_return_type",
        """\
        def reward_func(queries, prompts, labels, **kwargs):
            return [0.0 for _ in queries]
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.tensor([0.0 for _ in queries])}
        """,
        ["returned list, not a dict with 'rewards'", "on the label as the completion"],
    ),
    (  # rewards as a list inside the dict: OpenRLHF makes a tensor of the wrong shape from it
        "rewards_not_a_tensor",
        """\
        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": [1.0] * len(queries)}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.tensor([1.0] * len(queries))}
        """,
        ["returned 'rewards' as list, not a torch tensor"],
    ),
    (  # one reward per something other than the queries
        "wrong_length",
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(2)}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(len(queries))}
        """,
        ["returned 'rewards' with 2 values for a batch of 1 query"],
    ),
    (  # a division by the completion's length: NaN on the empty completion, which poisons GRPO's advantages
        "nan_reward",
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            answer = torch.tensor(float(len(queries[0]) - len(prompts[0])))
            return {"rewards": (answer / answer).reshape(1)}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            answer = torch.tensor(float(len(queries[0]) - len(prompts[0])))
            return {"rewards": (answer / answer.clamp(min=1)).reshape(1)}
        """,
        ["returned 'rewards' = nan, not a finite number", "on an empty completion"],
    ),
    (  # extra_logs must hold numbers: OpenRLHF makes a tensor of each value
        "extra_logs_text",
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(1), "extra_logs": {"verdict": "wrong"}}
        """,
        """\
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": torch.zeros(1), "extra_logs": {"verdict_wrong": 1.0}}
        """,
        ["returned extra_logs['verdict'] as str, not a number"],
    ),
]


def sample_run(reward: Path):
    return load_run("smoke-cpu", [f"reward.remote_url={reward}"], environ={})


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


@pytest.mark.parametrize(("broken", "fixed", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_broken_reward_file_is_one_line_and_its_fixed_twin_passes(broken, fixed, expected, tmp_path):
    rows = reward_check.dataset_rows(sample_run(tmp_path / "r.py"), ROOT)
    assert len(rows) == reward_check.ROWS_CALLED and all(rows), rows  # the sample's own rows
    path = write(tmp_path / "my_reward.py", broken)
    with pytest.raises(reward_check.RewardFileError) as raised:
        reward_check.check_reward_file(path, rows)
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"{path}: "), line
    for part in expected:
        assert part in line, line
    write(path, fixed)
    calls = reward_check.check_reward_file(path, rows)
    assert calls == len(rows) * len(reward_check.STAND_IN_COMPLETIONS)


def test_a_correct_file_passes_and_is_called_as_openrlhf_calls_it(tmp_path):
    """The good file trains nothing; it records how it was called: one query per call, from a thread other
    than the caller's, the query being the row's prompt followed by each stand-in completion."""
    log = tmp_path / "calls.jsonl"
    path = write(
        tmp_path / "recording.py",
        GOOD.replace("def reward_func", "def score")
        + textwrap.dedent(f"""\
        import json, threading

        def reward_func(queries, prompts, labels, **kwargs):
            with open({str(log)!r}, "a") as out:
                thread = threading.current_thread() is threading.main_thread()
                out.write(json.dumps([queries, prompts, labels, thread]) + "\\n")
            return score(queries, prompts, labels)
        """),
    )
    rows = reward_check.dataset_rows(sample_run(path), ROOT)
    assert reward_check.check_reward_file(path, rows) == 9
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 9 and all(len(q) == len(p) == len(lab) == 1 for q, p, lab, _ in calls)
    assert not any(on_main_thread for *_, on_main_thread in calls)
    prompt, label = rows[0]
    assert prompt.startswith("Find") or "\n" in prompt, prompt  # the row's question text
    completions = [queries[0][len(prompts[0]) :] for queries, prompts, _, _ in calls[:3]]
    assert completions == [str(label), "", reward_check.GARBAGE]


@pytest.mark.parametrize("recipe", ["smoke-cpu", "learn-cpu", "qwen2_5_vl-7b-4x4090"])
def test_the_repos_rewards_pass_on_their_recipes(recipe):
    name, calls = reward_check.check_run_reward(load_run(recipe, environ={}), ROOT)
    assert name.startswith("rewards/") and calls > 0


def test_the_runs_reward_settings_reach_the_file(tmp_path):
    """REWARD_* come from the recipe (run.env), as in the engine actors; a file that insists on one fails
    only when the recipe does not set it to what it wants (the control)."""
    path = write(
        tmp_path / "strict.py",
        """\
        import os
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            if os.environ["REWARD_ANSWER_FORMAT"] != "boxed":
                raise ValueError("this reward grades boxed answers only")
            return {"rewards": torch.zeros(len(queries))}
        """,
    )
    run = load_run("smoke-cpu", [f"reward.remote_url={path}"], environ={})
    assert reward_check.check_run_reward(run, ROOT)[1] == 9
    sets = [f"reward.remote_url={path}", "reward.answer_format=think_answer"]
    other = load_run("smoke-cpu", sets, environ={})
    with pytest.raises(reward_check.RewardFileError, match="boxed answers only"):
        reward_check.check_run_reward(other, ROOT)


def test_command_line_and_preflight_report_the_same_line(tmp_path):
    broken, fixed = CASES[0][1], CASES[0][2]
    path = write(tmp_path / "my_reward.py", broken)
    command = [sys.executable, "-m", "openrlhf_lora_sync.config.reward_check", "--recipe", "smoke-cpu"]
    done = subprocess.run(
        [*command, "--set", f"reward.remote_url={path}"], cwd=ROOT, capture_output=True, text=True
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("reward_check:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "IndexError: list index out of range (line 5)" in lines[0] and str(path) in lines[0]
    result = preflight.check_reward(sample_run(path), ROOT)
    assert result.status == preflight.FAIL and result.summary == lines[0].removeprefix("reward_check: ")
    write(path, fixed)  # the control: the fixed file passes both
    done = subprocess.run(
        [*command, "--set", f"reward.remote_url={path}"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and "returned OpenRLHF's dict in 9 calls" in done.stdout, done.stderr[-3000:]
    assert preflight.check_reward(sample_run(path), ROOT).status == preflight.PASS


def test_the_run_script_stops_on_a_broken_reward_before_ray_starts(tmp_path):
    """`run_grpo_lora.sh smoke-cpu reward.remote_url=FILE`: one line, exit 2, and the CPU run (Ray, the
    engine, the trainer) never starts. The fixed twin passing the same check is the CLI test's control."""
    path = write(tmp_path / "my_reward.py", CASES[0][1])
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_grpo_lora.sh"), "smoke-cpu", f"reward.remote_url={path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.startswith("reward_check:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert f"{path}: reward_func raised on an empty completion" in lines[0]
    assert "cpu_run:" not in done.stderr and "ray" not in done.stderr.lower()
