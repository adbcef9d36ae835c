"""Weights and adapters that cannot be read get one line naming the file, never a loader's traceback.

Covers (weights_check.py through the tools users run): a model.safetensors cut off mid-download, an
adapter_model.safetensors that is not safetensors, a sharded checkpoint whose index names a shard that is
not there, and weights of another shape than config.json builds; each through verify_sync and
export_merged in a fresh process: exit 2, stdout exactly one JSON line {"ok": false, "error": ...} naming
the file and what is wrong, stderr that line behind the tool's name and no traceback. Each case's fixed
twin (the intact files) passes weights_problem and exports.
Does not cover: `.bin` weights (not checked: reading them means unpickling them), nor preflight's model
check (tests/inputs/test_preflight.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openrlhf_lora_sync.config.weights_check import expected_shapes, weights_problem
from openrlhf_lora_sync.testing.user_checkpoints import TEXT, save_adapter, save_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """A Qwen3 checkpoint and its adapter as transformers and peft save them, plus the same checkpoint
    sharded (save_pretrained with a small max_shard_size) and one of another width."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("bad-weights")
    config = Qwen3Config(**TEXT, head_dim=32)
    model = save_model(config, root / "qwen3", vlm=False)
    sharded = root / "qwen3-sharded"
    AutoModelForCausalLM.from_pretrained(model).save_pretrained(sharded, max_shard_size="100KB")
    wider = save_model(
        Qwen3Config(**{**TEXT, "intermediate_size": 192}, head_dim=32), root / "wider", vlm=False
    )
    adapter = save_adapter(model, root / "qwen3-adapter", vlm=False)
    return {"model": model, "sharded": sharded, "wider": wider, "adapter": adapter, "root": root}


def truncated_model(files, work: Path):
    model = shutil.copytree(files["model"], work / "model")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    return model, files["adapter"], "model.safetensors: cannot be read as safetensors"


def adapter_not_safetensors(files, work: Path):
    adapter = shutil.copytree(files["adapter"], work / "adapter")
    (adapter / "adapter_model.safetensors").write_text("<html>rate limited</html>" * 40)
    return files["model"], adapter, "adapter_model.safetensors: cannot be read as safetensors"


def index_names_a_missing_shard(files, work: Path):
    model = shutil.copytree(files["sharded"], work / "sharded")
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) > 1, "the checkpoint did not shard"
    shards[-1].unlink()
    return model, files["adapter"], f"names 1 shard(s) that are not there: {shards[-1].name}"


def weights_of_another_shape(files, work: Path):
    model = shutil.copytree(files["model"], work / "model")
    shutil.copy(files["wider"] / "model.safetensors", model / "model.safetensors")
    return model, files["adapter"], "tensor(s) of another shape than its config.json builds"


CASES = [truncated_model, adapter_not_safetensors, index_names_a_missing_shard, weights_of_another_shape]


def run_tool(script: str, *argv) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *map(str, argv)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
@pytest.mark.parametrize("tool", ["verify_sync", "export_merged"])
def test_unreadable_weights_get_one_line_naming_the_file(case, tool, intact, tmp_path):
    model, adapter, says = case(intact, tmp_path)
    if tool == "verify_sync":
        code, out, err = run_tool("verify_sync.py", "--model", model, "--adapter", adapter)
    else:
        code, out, err = run_tool(
            "export_merged.py", "--base", model, "--adapter", adapter, "--out", tmp_path / "o"
        )
    assert code == 2, err[-3000:]
    (line,) = out.splitlines()
    result = json.loads(line)
    assert result["ok"] is False and says in result["error"], result
    assert f"{tool}: " in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("name", ["model", "sharded"])
def test_the_intact_files_pass(name, intact, tmp_path):
    """The fixed twins: the same files uncut pass the check and export."""
    from transformers import AutoConfig

    model = intact[name]
    assert weights_problem(model, expected=expected_shapes(AutoConfig.from_pretrained(model))) is None
    assert weights_problem(intact["adapter"], "adapter_model") is None
    code, out, err = run_tool(
        "export_merged.py", "--base", model, "--adapter", intact["adapter"], "--out", tmp_path / "o"
    )
    assert code == 0 and json.loads(out)["ok"], err[-3000:]
