"""Every entry point gives the same bad input the same message: render_recipe (run_grpo_lora.sh and its
--dry-run), preflight, memory_budget, the CPU runs (smoke_cpu) and the launcher all go through
recipe.load_run / run_from_argv, so each must print the same lines (behind its own `name: ` prefix) and
exit 2, before anything starts. Each case has a fixed twin that passes the recipe path (the control).
And `null` never crashes any of them.

Does not cover: what each tool does with a good run (their own tests).
"""

from __future__ import annotations

import pytest
from openrlhf_lora_sync import launch, memory_budget, preflight
from openrlhf_lora_sync import recipe as rr
from openrlhf_lora_sync.tools import render_recipe, smoke_cpu

RECIPE = "qwen2_5_vl-7b-4x4090"  # a bare name, as users type it
LAUNCH_BASE = [
    "--actor.model_name_or_path",
    "Qwen/Qwen2.5-VL-7B-Instruct",
    "--reward.remote_url",
    "rewards/math_answer.py",
    "--algo.advantage.estimator",
    "group_norm",
    "--rollout.n_samples_per_prompt",
    "8",
]

# (case, overrides, what the message says, the fixed overrides, the launcher's argv form or None)
CASES = [
    (
        "typo'd key",
        ["ds.lora.rnk=8"],
        "did you mean ds.lora.rank",
        ["ds.lora.rank=8"],
        ["--ds.lora.rnk", "8"],
    ),
    ("negative rank", ["ds.lora.rank=-4"], "-4 is negative", ["ds.lora.rank=4"], ["--ds.lora.rank", "-4"]),
    (
        "zero bucket",
        ["sync.bucket_mb=0"],
        "sync.bucket_mb: expected an integer >= 1",
        ["sync.bucket_mb=64"],
        None,
    ),
    ("empty value", ["ds.lora.rank="], "empty value", ["ds.lora.rank=8"], None),
    (
        "adapter rank vLLM refuses",
        ["sync.mode=adapter", "ds.lora.rank=1024"],
        "largest max_lora_rank",
        ["sync.mode=adapter", "ds.lora.rank=512"],
        None,
    ),
    ("base overridden", ["base=x"], "cannot be overridden", [], None),
]


def messages(capsys, prefix: str) -> list[str]:
    err = capsys.readouterr().err.splitlines()
    return [line.removeprefix(prefix) for line in err if line.startswith(prefix)]


def through_every_entry_point(
    overrides: list[str], capsys, recipe=RECIPE
) -> dict[str, tuple[int, list[str]]]:
    sets = [token for override in overrides for token in ("--set", override)]
    results = {}
    code = render_recipe.main([recipe, *overrides, "--dry-run"])
    results["render_recipe"] = (code, messages(capsys, "render_recipe: "))
    for name, main in (
        ("preflight", preflight.main),
        ("memory_budget", memory_budget.main),
        ("smoke_cpu", smoke_cpu.main),
    ):
        code = main(["--recipe", recipe, *sets])
        results[name] = (code, messages(capsys, f"{name}: "))
    return results


def test_a_recipe_that_is_not_there_gets_the_same_message_everywhere(capsys):
    results = through_every_entry_point([], capsys, recipe="qwen2_5_vl-7b")
    expected = results["render_recipe"][1]
    assert (
        len(expected) == 1 and "no such recipe file" in expected[0] and "qwen2_5_vl-7b-4x4090" in expected[0]
    )
    assert all(result == (2, expected) for result in results.values()), results


@pytest.mark.parametrize(("case", "bad", "says", "fixed", "argv"), CASES, ids=[c[0] for c in CASES])
def test_the_same_bad_input_gets_the_same_message_everywhere(
    case, bad, says, fixed, argv, capsys, monkeypatch
):
    monkeypatch.setenv("HOME", "/nonexistent")  # no wandb key: the same notes everywhere
    results = through_every_entry_point(bad, capsys)
    expected = results["render_recipe"][1]
    assert expected and any(says in line for line in expected), expected
    for name, (code, lines) in results.items():
        assert code == 2 and lines == expected, f"{name}: exit {code}, {lines} vs {expected}"
    if argv is not None:
        assert launch.main([*LAUNCH_BASE, *argv]) == 2
        launched = messages(capsys, "openrlhf_lora_sync: ")
        assert any(says in line for line in launched), launched
    rr.load_run(RECIPE, fixed)  # the control: the fixed input passes the same path


@pytest.mark.parametrize(
    "overrides",
    [
        ["ckpt.save_steps=null"],
        ["vllm.tensor_parallel_size=null", "vllm.num_engines=null"],
        ["eval.dataset=null"],
    ],
)
def test_null_never_crashes_an_entry_point(overrides, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", "/nonexistent")
    assert render_recipe.main([RECIPE, *overrides, "--dry-run"]) == 0  # null: OpenRLHF's default applies
    sets = [token for override in overrides for token in ("--set", override)]
    assert memory_budget.main(["--recipe", RECIPE, *sets]) in (0, 1)  # fits or not, never refused
    plan = preflight.Plan(preflight.load_plan_run(RECIPE, overrides), output_dir=tmp_path, stack="cpu")
    assert {result.name for result in preflight.run_checks(plan)} >= {"memory", "disk", "lora_config"}


def test_base_recipe_and_bare_names_load_everywhere(capsys):
    assert memory_budget.main(["--recipe", "base", "--model", "Qwen/Qwen2.5-VL-7B-Instruct"]) in (0, 1)
    assert "Traceback" not in capsys.readouterr().err
    assert preflight.load_plan_run("base", [], model="Qwen/Qwen2.5-VL-7B-Instruct") is not None
