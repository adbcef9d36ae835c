"""Adapter checkpoints: atomic saves through OpenRLHF's own save code, a kill midway, and resuming a run.

Covers
- checkpoint.atomic_directory: a clean exit replaces the target, an exception leaves it as it was, the
  staging directory of a killed save is removed by the next save.
- Killing a save: worker processes run OpenRLHF 0.11.2's `DeepspeedStrategy.save_model` (world size 1,
  gloo) wrapped the way openrlhf_patch.apply wraps it, on a tiny Qwen3 with a large LoRA adapter
  (rank 8192, ~128 MB). One save is SIGKILLed as soon as its staging directory appears (while writing),
  one after writing and before publishing; after each the previous adapter still loads with peft and
  equals what it was. A later save replaces it (negative control: the comparison sees a new adapter).
  A subdirectory of the target (ckpt.path inside ckpt.output_dir, as in the recipes) survives all of
  it, also a kill between moving it aside and the swap.
- Cadence and resume: a worker applies the patch, trains one step under DeepSpeed ZeRO-3 (CPU, bf16,
  world size 1) on OpenRLHF's own Actor with LoRA, and calls OpenRLHF's own
  `PolicyModelActor.save_checkpoint` (what `save_logs_and_checkpoints` calls every ckpt.save_steps):
  the DeepSpeed checkpoint and, with ckpt.save_hf, the peft adapter. A second process builds a fresh
  policy and resumes with OpenRLHF's `strategy.load_ckpt` (what --ckpt.load_enable does): the adapter
  is restored bit for bit (negative control: the fresh adapter differs before the load), and the peft
  directory loads with peft and holds the trained adapter. base.yaml renders ckpt.save_steps and
  ckpt.save_hf.

Does not cover: Ray, nor upstream's `save_logs_and_checkpoints` (its `global_step % ckpt.save_steps`
rule is not run here; the recipe's cadence flags are checked as rendered), world sizes above 1, GPUs.
CPU-only torch has no CUDA: the workers make `torch.cuda.synchronize` (which OpenRLHF's barrier helper
calls after its real barrier) a no-op. Workers are subprocesses running this
file, as in tests/sync/test_zero3_sync.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from openrlhf_lora_sync.testing.cpu_deepspeed import process_env

ROOT = Path(__file__).resolve().parents[2]
KILL_RANK = 8192  # ~128 MB of fp32 adapter on the tiny Qwen3: writing it takes long enough to kill midway
WORKER_TIMEOUT_S = 600
ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}


# ---------------------------------------------------------------------------------------------------
# Workers: each runs in its own process (world size 1).
# ---------------------------------------------------------------------------------------------------


def _init_world() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.cuda.synchronize = lambda *args, **kwargs: None  # CPU torch: no CUDA stream to wait for


def _strategy(zero_stage: int, ckpt_path: str = ""):
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    args = SimpleNamespace(
        ds=SimpleNamespace(param_dtype="bf16", zero_stage=zero_stage, tensor_parallel_size=1),
        train=SimpleNamespace(enable_ema=False),
        ckpt=SimpleNamespace(path=ckpt_path, max_num=2, max_mem=1000),
    )
    return DeepspeedStrategy(zero_stage=zero_stage, args=args)


def worker_save(model_dir: str, target: str, seed: int, block_before_publish: bool) -> None:
    """Save a seeded rank-KILL_RANK adapter to `target` through the wrapped upstream save_model."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf_lora_sync.patch.checkpoint import atomic_save_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _init_world()
    upstream = DeepspeedStrategy.save_model

    def upstream_then_wait(self, model, tokenizer, output_dir, **kwargs):
        upstream(self, model, tokenizer, output_dir, **kwargs)
        print("written", flush=True)
        sys.stdin.read()  # the parent kills this process here: written, not yet published

    DeepspeedStrategy.save_model = atomic_save_model(upstream_then_wait if block_before_publish else upstream)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=KILL_RANK, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, config)
    print("saving", flush=True)
    _strategy(zero_stage=0).save_model(model, AutoTokenizer.from_pretrained(model_dir), target)
    print("saved", flush=True)


def _lora_state(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    state = {}
    for name, param in engine.module.named_parameters():
        if "lora_" in name:
            with deepspeed.zero.GatheredParameters([param]):
                state[name] = param.detach().clone()
    return state


def _zero3_policy(model_dir: str):
    """OpenRLHF's Actor with LoRA on q/v under DeepSpeed ZeRO-3, wired the way strategy.prepare wires it."""
    import deepspeed
    from openrlhf.models import Actor

    actor = Actor(
        model_dir,
        attn_implementation="sdpa",
        param_dtype="bf16",
        lora_rank=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        ds_config=ZERO3_CONFIG,
    )
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=actor.model, optimizer=torch.optim.SGD(trainable, lr=1.0), config=ZERO3_CONFIG
    )
    actor.model = engine
    return actor, engine


def worker_train_and_save(model_dir: str, ckpt_path: str, out: str) -> None:
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf_lora_sync.patch import openrlhf_patch
    from transformers import AutoTokenizer

    _init_world()
    openrlhf_patch.apply()
    assert hasattr(DeepspeedStrategy.save_model, "__wrapped__"), "apply() did not wrap save_model"
    actor, engine = _zero3_policy(model_dir)
    torch.manual_seed(0)
    loss = engine(input_ids=torch.randint(0, 256, (1, 16))).logits.float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    trained = _lora_state(engine)
    # OpenRLHF's own method, unwrapped from its Ray actor class, on the attributes it reads.
    policy_actor = SimpleNamespace(
        strategy=_strategy(3, ckpt_path),
        actor=actor,
        ema_model=None,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        disable_ds_ckpt=False,
        save_hf_ckpt=True,
    )
    PolicyModelActor.__ray_metadata__.modified_class.save_checkpoint(
        policy_actor, "global_step1", client_states={"global_step": 1}
    )
    torch.save(trained, Path(out) / "trained.pt")


def worker_resume(model_dir: str, ckpt_path: str, out: str) -> None:
    _init_world()
    _, engine = _zero3_policy(model_dir)
    fresh = _lora_state(engine)
    load_path, states = _strategy(3, ckpt_path).load_ckpt(engine, os.path.join(ckpt_path, "_actor"))
    assert load_path is not None and states.get("global_step") == 1, (load_path, states)
    torch.save({"fresh": fresh, "resumed": _lora_state(engine)}, Path(out) / "resumed.pt")


# ---------------------------------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------------------------------


def _start(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        env=process_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )


def _run(*args: str, log: Path) -> None:
    proc = _start(*args, log=log)
    try:
        proc.communicate(timeout=WORKER_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        pytest.fail(f"worker {args[0]} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")


def _wait_for_line(proc: subprocess.Popen, wanted: str, log: Path) -> None:
    for line in proc.stdout:
        if line.strip() == wanted:
            return
    pytest.fail(f"worker ended before printing {wanted!r}:\n{log.read_text()[-4000:]}")


def _peft_lora(model_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    from openrlhf_lora_sync.config.adapter_check import load_checked_adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = load_checked_adapter(base, adapter_dir)  # a save that lost tensors is refused, not half-loaded
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _staging_dirs(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.saving-*"))


def test_atomic_directory_replaces_on_success_and_keeps_the_target_on_error(tmp_path):
    from openrlhf_lora_sync.patch.checkpoint import atomic_directory

    target = tmp_path / "adapter"
    with atomic_directory(target) as staging:
        (staging / "weights").write_text("first")
        (staging / "stale").write_text("a file the next save does not write")
    with pytest.raises(RuntimeError), atomic_directory(target) as staging:
        (staging / "weights").write_text("half")
        raise RuntimeError("save failed")
    assert (target / "weights").read_text() == "first" and not _staging_dirs(target)
    with atomic_directory(target) as staging:
        (staging / "weights").write_text("second")
    assert sorted(p.name for p in target.iterdir()) == ["weights"]
    assert (target / "weights").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging, no previous copy


def test_subdirectories_of_the_target_survive_saves_and_a_kill_between_carry_and_swap(tmp_path):
    """ckpt.path inside ckpt.output_dir: the final adapter's save must not delete the checkpoints."""
    from openrlhf_lora_sync.patch.checkpoint import _carry_subdirectories, atomic_directory

    target = tmp_path / "grpo-lora"
    (target / "checkpoints" / "_actor").mkdir(parents=True)
    (target / "checkpoints" / "_actor" / "latest").write_text("global_step20")
    with atomic_directory(target) as staging:
        (staging / "adapter_model.bin").write_text("final")
    assert (target / "checkpoints" / "_actor" / "latest").read_text() == "global_step20"

    # A save killed after carrying the subdirectory out, before the swap (a dead pid's staging name).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    killed_staging = tmp_path / f".grpo-lora.saving-{int(dead.stdout)}"
    killed_staging.mkdir()
    (killed_staging / "adapter_model.bin").write_text("never published")
    _carry_subdirectories(target, killed_staging)
    assert not (target / "checkpoints").exists()
    with atomic_directory(target) as staging:
        (staging / "adapter_model.bin").write_text("next")
    assert (target / "checkpoints" / "_actor" / "latest").read_text() == "global_step20"
    assert (target / "adapter_model.bin").read_text() == "next" and not _staging_dirs(target)


def test_a_killed_save_leaves_the_previous_adapter_intact(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    target = tmp_path / "global_step1_hf"
    _run("save", str(model_dir), str(target), "1", "run", log=tmp_path / "save1.log")
    previous = _peft_lora(model_dir, target)
    assert next(iter(previous.values())).shape[0] == KILL_RANK
    (target / "checkpoints").mkdir()  # as ckpt.path sits inside ckpt.output_dir in the recipes
    (target / "checkpoints" / "latest").write_text("global_step20")

    # Killed while writing: as soon as its staging directory exists.
    log = tmp_path / "kill-writing.log"
    proc = _start("save", str(model_dir), str(target), "2", "run", log=log)
    _wait_for_line(proc, "saving", log)
    while not _staging_dirs(target) and proc.poll() is None:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the save ended before the kill:\n{log.read_text()[-2000:]}"
    assert _staging_dirs(target), "killed after publishing: no staging directory left"
    assert _equal(_peft_lora(model_dir, target), previous)

    # Killed after writing everything, before publishing.
    log = tmp_path / "kill-publish.log"
    proc = _start("save", str(model_dir), str(target), "3", "block", log=log)
    _wait_for_line(proc, "written", log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _equal(_peft_lora(model_dir, target), previous)

    # The next save replaces it and clears the killed saves' staging directories.
    _run("save", str(model_dir), str(target), "4", "run", log=tmp_path / "save4.log")
    assert not _equal(_peft_lora(model_dir, target), previous)
    assert not _staging_dirs(target)
    assert (target / "checkpoints" / "latest").read_text() == "global_step20"


def test_resume_restores_the_adapter_and_the_peft_checkpoint_holds_it(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    ckpt_path = tmp_path / "checkpoints"
    _run("train-and-save", str(model_dir), str(ckpt_path), str(tmp_path), log=tmp_path / "train.log")
    trained = torch.load(tmp_path / "trained.pt")
    assert any(name.endswith("lora_B.default.weight") and t.abs().max() > 0 for name, t in trained.items())

    _run("resume", str(model_dir), str(ckpt_path), str(tmp_path), log=tmp_path / "resume.log")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert not _equal(resumed["fresh"], trained), "a fresh policy already holds the trained adapter"
    assert _equal(resumed["resumed"], trained)

    # The peft-format adapter OpenRLHF wrote beside it (ckpt.save_hf), through the atomic save.
    peft_dir = ckpt_path / "global_step1_hf"
    assert (peft_dir / "adapter_config.json").is_file() and not _staging_dirs(peft_dir)
    saved = _peft_lora(model_dir, peft_dir)
    assert _equal({name: t.to(torch.bfloat16) for name, t in saved.items()}, trained)


def test_base_recipe_saves_the_peft_adapter_at_its_cadence():
    from openrlhf_lora_sync.config import recipe as render_recipe

    flags = render_recipe.load_recipe(ROOT / "recipes" / "qwen3_vl-8b-4x4090.yaml")
    argv = render_recipe.render(flags, environ={}).argv
    assert argv[argv.index("--ckpt.save_steps") + 1] == str(flags["ckpt.save_steps"])
    assert "--ckpt.save_hf" in argv


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "save":
        worker_save(rest[0], rest[1], int(rest[2]), rest[3] == "block")
    elif mode == "train-and-save":
        worker_train_and_save(*rest)
    elif mode == "resume":
        worker_resume(*rest)
    else:
        raise SystemExit(f"unknown worker mode {mode}")
