"""verify_sync --fault on a checkpoint as users have it: a Qwen3-VL saved by transformers with its
tokenizer files and no processor files (what `model.save_pretrained` + `tokenizer.save_pretrained` leave).

Covers: each of the four faults (stale, sleep2, drop-bucket, transport) is detected (and sleep2
recovered) on that checkpoint, with the family's default processor and with `--processor DIR` (a
processor saved by transformers' own classes); the checkpoint directory is never written. The fault
path starts its engine the way the plain check does (logprob_check.start_checkpoint_engine); before, it
ended in "OSError: Can't load image processor" with a traceback.
Does not cover: the faults' detection logic itself on the repo's tiny models (tests/sync/test_faults.py).
"""

from __future__ import annotations

import json

import pytest
from openrlhf_lora_sync.testing import user_checkpoints
from openrlhf_lora_sync.tools import verify_sync

FAULTS = ("stale", "sleep2", "drop-bucket", "transport")


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """(checkpoint with tokenizer and no processor files, a processor directory) built by transformers."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    root = tmp_path_factory.mktemp("user-faults")
    model = user_checkpoints.save_model(user_checkpoints.qwen3_vl_config(), root / "qwen3_vl", vlm=True)
    user_checkpoints.qwen_tokenizer().save_pretrained(model)
    sizes = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}  # Qwen3-VL's vision defaults
    processor = root / "qwen3_vl-processor"
    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen3VLVideoProcessor(**sizes),
        tokenizer=user_checkpoints.qwen_tokenizer(),
        chat_template=user_checkpoints.CHAT_TEMPLATE,
    ).save_pretrained(processor)
    assert not (model / "preprocessor_config.json").exists() and (model / "tokenizer.json").exists()
    return model, processor


@pytest.mark.parametrize("with_processor", [False, True], ids=["default_processor", "processor_dir"])
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_is_detected_on_a_user_checkpoint(fault, with_processor, qwen3_vl, capfd):
    model, processor = qwen3_vl
    files_before = {path.name: path.read_bytes() for path in model.iterdir()}
    argv = [
        "--model",
        str(model),
        "--fault",
        fault,
        *(["--processor", str(processor)] if with_processor else []),
    ]
    capfd.readouterr()
    code = verify_sync.main(argv)
    # In this process main() returns its JSON line or raises (the OSError this test was written for).
    result = json.loads(capfd.readouterr().out.splitlines()[-1])
    assert code == 0 and result["detected"], result
    assert result["probe_ratio"]["correct"] <= result["fail_ratio"]  # the correct sync passed first
    if fault == "sleep2":
        assert result["recovered"] and result["recovery_sync"] == "full", result
    assert {path.name: path.read_bytes() for path in model.iterdir()} == files_before  # not written
