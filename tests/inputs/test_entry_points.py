"""Every entry point gives the same bad input the same message: render_recipe (run_grpo_lora.sh and its
--dry-run), preflight, memory_budget, the CPU run (cpu_run) and the launcher all go through
recipe.load_run / run_from_argv, so each must print the same lines (behind its own `name: ` prefix) and
exit 2, before anything starts. Each case has a fixed twin that passes the recipe path (the control).
And `null` never crashes any of them.

Does not cover: what each tool does with a good run (their own tests).
"""

from __future__ import annotations

import pytest
from openrlhf_lora_sync.config import memory_report, preflight
from openrlhf_lora_sync.config import recipe as rr
from openrlhf_lora_sync.patch import launch
from openrlhf_lora_sync.tools import cpu_run, render_recipe

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
        ("memory_budget", memory_report.main),
    ):
        code = main(["--recipe", recipe, *sets])
        results[name] = (code, messages(capsys, f"{name}: "))
    results["cpu_run"] = (cpu_run.main([str(recipe), *sets]), messages(capsys, "cpu_run: "))
    return results


def test_a_recipe_that_is_not_there_gets_the_same_message_everywhere(capsys):
    results = through_every_entry_point([], capsys, recipe="qwen2_5_vl-7b")
    expected = results["render_recipe"][1]
    assert (
        len(expected) == 1 and "no such recipe file" in expected[0] and "qwen2_5_vl-7b-4x4090" in expected[0]
    )
    assert all(result == (2, expected) for result in results.values()), results


def test_a_recipe_that_is_not_valid_yaml_gets_one_line_everywhere(capsys, tmp_path):
    """A tab in the indentation: the file, YAML's line and column and its reason, and exit 2 from every
    entry point, the run script's --dry-run included; the same recipe indented with spaces loads."""
    import subprocess

    text = "base: {base}\nsync:\n{indent}mode: merge\n"
    bad, fixed = tmp_path / "bad.yaml", tmp_path / "fixed.yaml"
    bad.write_text(text.format(base=rr.RECIPES_DIR / "smoke-cpu.yaml", indent="\t"))
    fixed.write_text(text.format(base=rr.RECIPES_DIR / "smoke-cpu.yaml", indent="  "))
    results = through_every_entry_point([], capsys, recipe=str(bad))
    expected = results["render_recipe"][1]
    assert expected == [
        f"{bad}, line 3, column 1: not valid YAML (while scanning for the next token found character "
        "'\\t' that cannot start any token); YAML indents with spaces, never tabs"
    ]
    assert all(result == (2, expected) for result in results.values()), results
    script = subprocess.run(
        ["bash", str(rr.RECIPES_DIR.parent / "scripts" / "run_grpo_lora.sh"), str(bad), "--dry-run"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert script.returncode == 2 and "Traceback" not in script.stderr, script.stderr[-2000:]
    assert expected[0] in script.stderr
    assert rr.load_run(fixed, []).setting("sync.mode") == "merge"  # the control


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
    # The control: the fixed input passes the same path, and the entry points that start nothing run on it
    # (the CPU runs and the launcher would start training, so they stop at the refusal above).
    rr.load_run(RECIPE, fixed)
    assert render_recipe.main([RECIPE, *fixed, "--dry-run"]) == 0
    sets = [token for override in fixed for token in ("--set", override)]
    fits = case != "adapter rank vLLM refuses"  # rank 512 LoRA layers in vLLM: the rollout does not fit
    assert memory_report.main(["--recipe", RECIPE, *sets]) == (0 if fits else 1)
    assert preflight.load_plan_run(RECIPE, fixed) is not None
    err = capsys.readouterr().err.splitlines()
    assert not [line for line in err if line.startswith(("render_recipe: ", "memory_budget: "))], err


@pytest.mark.parametrize(
    ("overrides", "fits"),
    [
        (["ckpt.save_steps=null"], True),
        # OpenRLHF's engine defaults instead of the recipe's 2 x TP2: the full sync does not fit (23.9 GiB)
        (["vllm.tensor_parallel_size=null", "vllm.num_engines=null"], False),
        (["eval.dataset=null"], True),
    ],
)
def test_null_never_crashes_an_entry_point(overrides, fits, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", "/nonexistent")
    assert render_recipe.main([RECIPE, *overrides, "--dry-run"]) == 0  # null: OpenRLHF's default applies
    sets = [token for override in overrides for token in ("--set", override)]
    assert memory_report.main(["--recipe", RECIPE, *sets]) == (0 if fits else 1)  # judged, never refused
    plan = preflight.Plan(preflight.load_plan_run(RECIPE, overrides), output_dir=tmp_path, stack="cpu")
    assert {result.name for result in preflight.run_checks(plan)} >= {"memory", "disk", "lora_config"}


def test_base_recipe_and_bare_names_load_everywhere(capsys):
    assert memory_report.main(["--recipe", "base", "--model", "Qwen/Qwen2.5-VL-7B-Instruct"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert preflight.load_plan_run("base", [], model="Qwen/Qwen2.5-VL-7B-Instruct") is not None


def test_entry_points_print_no_third_party_import_noise():
    """pynvml's deprecation FutureWarning (torch.cuda's import) and bitsandbytes' kernels-community
    message are silenced at their source by the package (openrlhf_lora_sync/__init__.py); the control, the
    same imports without the package, shows the noise is there to silence."""
    import subprocess
    import sys

    noise = ("The pynvml package is deprecated", "gemm_4bit_forward")
    control = subprocess.run(
        [sys.executable, "-c", "import torch, peft"], capture_output=True, text=True, timeout=300
    )
    assert noise[0] in control.stderr, control.stderr[-2000:]
    scripts = rr.RECIPES_DIR.parent / "scripts"
    for argv in (
        [scripts / "render_recipe.py", RECIPE, "--dry-run"],
        [scripts / "memory_budget.py", "--recipe", "qwen3_5-27b-4x4090"],
    ):
        done = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and not any(text in done.stderr for text in noise), done.stderr[-2000:]
