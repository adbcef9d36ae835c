"""scripts/preflight.py: each check against fake inputs (proc files, environments, caches, GPU lists, tiny
datasets with PNGs, each broken way next to its fixed twin), the shipped sample data, the real pidfd_getfd
probe between two sibling processes, a really denied probe, and the command line.

Not covered: a machine with GPUs (the GPU checks take a GPU list, so they are tested with fake ones) and a
kernel with Yama active (this one has none; the ptrace_scope check reads a fake file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from openrlhf_lora_sync.base import pins
from openrlhf_lora_sync.config import host_checks, memory_budget, memory_report, model_inventory, preflight
from openrlhf_lora_sync.config import recipe as render_recipe
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
RTX_4090 = host_checks.GpuInfo("NVIDIA GeForce RTX 4090", 23.99)
H100 = host_checks.GpuInfo("NVIDIA H100 80GB HBM3", 79.1)
# The user's flags, plus what OpenRLHF's own checks need to accept them: GRPO groups, a reward, and the
# KL reference on the actor's 4 GPUs (upstream train() asserts it; its default is 8).
USER_27B_FLAGS = {
    **memory_report.USER_27B_FLAGS,
    "rollout.n_samples_per_prompt": 8,
    "reward.remote_url": "rewards/math_answer.py",
    "ref.num_gpus_per_node": 4,
}
RECIPE_27B = ROOT / "recipes" / "qwen3_5-27b-4x4090.yaml"


def user_27b_run():
    return render_recipe.load_run(None, [f"{key}={value}" for key, value in USER_27B_FLAGS.items()], {})


@pytest.mark.parametrize(
    ("gpus", "need_gpus", "need_gib", "status"),
    [
        ([], None, None, preflight.NA),
        ([], 4, None, preflight.FAIL),
        ([RTX_4090] * 2, 4, None, preflight.FAIL),
        ([RTX_4090] * 4, 4, None, preflight.PASS),
        ([RTX_4090] * 4, 4, 48.0, preflight.FAIL),
        ([H100], 1, 48.0, preflight.PASS),
    ],
)
def test_gpus(gpus, need_gpus, need_gib, status):
    result = host_checks.check_gpus(gpus, "test", need_gpus, need_gib)
    assert result.status == status
    assert result.status in (preflight.PASS, preflight.NA) or result.fix


def test_no_gpu_here_is_reported_with_the_reason():
    gpus, source = host_checks.detect_gpus()
    if gpus:
        pytest.skip("this machine has a GPU")
    result = host_checks.check_gpus(gpus, source, None, None)
    assert result.status == preflight.NA and "no CUDA GPU" in result.summary and source in result.summary


def test_gpus_from_nvidia_smi_when_torch_sees_none(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'NVIDIA GeForce RTX 4090, 24564'\necho 'NVIDIA GeForce RTX 4090, 24564'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus, source = host_checks.detect_gpus()
    if source == "torch.cuda":
        pytest.skip("torch sees a real GPU here")
    assert gpus == [host_checks.GpuInfo("NVIDIA GeForce RTX 4090", 24564 / 1024)] * 2
    assert source.startswith("nvidia-smi")


@pytest.mark.parametrize(
    ("gpus", "env", "status"),
    [
        ([], {}, preflight.NA),
        ([RTX_4090] * 4, {}, preflight.WARN),
        ([RTX_4090] * 4, {"NCCL_P2P_DISABLE": "0"}, preflight.WARN),
        ([RTX_4090] * 4, {"NCCL_P2P_DISABLE": "1"}, preflight.PASS),
        ([H100] * 8, {}, preflight.PASS),
    ],
)
def test_nccl_p2p(gpus, env, status):
    result = host_checks.check_nccl_p2p(gpus, env)
    assert result.status == status
    if status == preflight.WARN:
        assert "NCCL_P2P_DISABLE=1" in result.fix


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (None, preflight.NA),
        ("0", preflight.PASS),
        ("1", preflight.WARN),
        ("2", preflight.WARN),
        ("3", preflight.FAIL),
    ],
)
def test_ptrace_scope(tmp_path, content, status):
    path = tmp_path / "ptrace_scope"
    if content is not None:
        path.write_text(content + "\n")
    result = host_checks.check_ptrace_scope(path)
    assert result.status == status
    if status in (preflight.WARN, preflight.FAIL):
        assert f"ptrace_scope={content}" in result.summary


@pytest.mark.parametrize(
    ("capeff", "status"),
    [
        ("000001fffeffffff", preflight.PASS),  # root on a host: every capability
        ("00000000a80425fb", preflight.WARN),  # Docker's default set: no CAP_SYS_PTRACE
        ("00000000a80c25fb", preflight.PASS),  # Docker's default set plus cap_add SYS_PTRACE
        ("0000000000000000", preflight.WARN),  # an unprivileged user
    ],
)
def test_cap_sys_ptrace(tmp_path, capeff, status):
    status_file = tmp_path / "status"
    status_file.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{capeff}\n")
    result = host_checks.check_cap_sys_ptrace(status_file)
    assert result.status == status
    if status == preflight.WARN:
        assert "SYS_PTRACE" in result.fix


def test_pidfd_getfd_probe_is_real_and_consistent():
    probe = host_checks.probe_pidfd_getfd()
    result = host_checks.check_pidfd_getfd({})
    assert probe.ok == (result.status == preflight.PASS)
    assert result.details["errno"] == probe.errno_name
    if not probe.ok:
        assert probe.errno_name in ("EPERM", "EACCES", "ENOSYS")


@pytest.mark.parametrize(
    ("env", "status"),
    [
        ({}, preflight.WARN),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, preflight.FAIL),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"}, preflight.FAIL),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, preflight.WARN),
    ],
)
def test_denied_pidfd_getfd_names_the_fix(env, status):
    result = host_checks.check_pidfd_getfd(env, force_denied=True)
    assert result.details == {"errno": "EPERM", "stage": "pidfd_getfd", "forced": True}
    assert result.status == status
    assert "EPERM" in result.summary
    assert "SYS_PTRACE" in result.fix and "ptrace_scope" in result.fix


def test_denial_can_be_forced_through_the_environment():
    result = host_checks.check_pidfd_getfd({host_checks.FORCE_DENIED_ENV: "1"})
    assert result.details["errno"] == "EPERM" and result.details["forced"]


@pytest.mark.parametrize(
    ("env", "status", "expandable"),
    [
        ({}, preflight.PASS, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, preflight.PASS, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, preflight.WARN, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, preflight.WARN, True),
        # torch reads PYTORCH_ALLOC_CONF first
        (
            {
                "PYTORCH_ALLOC_CONF": "expandable_segments:False",
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            },
            preflight.WARN,
            False,
        ),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}, preflight.PASS, False),
    ],
)
def test_alloc_conf(env, status, expandable):
    assert host_checks.expandable_segments(env)[0] == expandable
    assert host_checks.check_alloc_conf(env).status == status


class FakeStatvfs:
    def __init__(self, size, free):
        self.f_frsize, self.f_blocks, self.f_bavail = 1, size, free


@pytest.mark.parametrize(
    ("size", "free", "ram", "status"),
    [
        (64 * 2**20, 64 * 2**20, 128 * 2**30, preflight.FAIL),  # Docker's default /dev/shm
        (8 * 2**30, 8 * 2**30, 128 * 2**30, preflight.WARN),  # under Ray's 30% of RAM
        (64 * 2**30, 64 * 2**30, 128 * 2**30, preflight.PASS),  # ipc: host
    ],
)
def test_dev_shm(tmp_path, monkeypatch, size, free, ram, status):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {ram // 1024} kB\nMemFree:        1 kB\n")
    monkeypatch.setattr(host_checks.os, "statvfs", lambda path: FakeStatvfs(size, free))
    result = host_checks.check_dev_shm(Path("/dev/shm"), meminfo)
    assert result.status == status
    if status != preflight.PASS:
        assert "ipc: host" in result.fix


@pytest.mark.parametrize(
    ("env", "flags", "netrc", "status"),
    [
        ({"WANDB_API_KEY": "k"}, {}, None, preflight.PASS),
        ({}, {"logger.wandb.key": "k"}, None, preflight.PASS),
        ({}, {}, "machine api.wandb.ai\n  login user\n  password k\n", preflight.PASS),
        ({}, {}, "machine example.com\n  login user\n  password k\n", preflight.WARN),
        ({"WANDB_MODE": "offline"}, {}, None, preflight.PASS),
        ({}, {}, None, preflight.WARN),
    ],
)
def test_wandb(tmp_path, env, flags, netrc, status):
    if netrc is not None:
        (tmp_path / ".netrc").write_text(netrc)
        (tmp_path / ".netrc").chmod(0o600)
    assert host_checks.check_wandb(env, flags, home=tmp_path).status == status


def test_disk(tmp_path):
    assert host_checks.check_disk(tmp_path / "not" / "yet", 1, "test").status == preflight.PASS
    result = host_checks.check_disk(tmp_path, 2**60, "test")
    assert result.status == preflight.FAIL and "ckpt" in result.fix


@pytest.fixture
def hub_cache(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3.5-9B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(model_inventory.REFERENCE_CONFIGS["Qwen/Qwen3.5-9B"]))
    return tmp_path / "hub"


@pytest.mark.parametrize(
    ("model", "env", "status"),
    [
        (None, {}, preflight.NA),
        ("Qwen/Qwen3.5-9B", {}, preflight.PASS),
        ("Qwen/Qwen3.5-27B", {}, preflight.WARN),
        ("Qwen/Qwen3.5-27B", {"HF_HUB_OFFLINE": "1"}, preflight.FAIL),
        ("not a model", {}, preflight.FAIL),
        ("/nonexistent/model", {}, preflight.FAIL),
    ],
)
def test_model_by_hub_id_or_path(hub_cache, model, env, status):
    result = preflight.check_model(model, {"HF_HUB_CACHE": str(hub_cache), **env})
    assert result.status == status
    if status == preflight.WARN:
        assert "cannot be checked offline" in result.summary


def test_model_directory(tmp_path):
    assert preflight.check_model(str(tmp_path), {}).status == preflight.FAIL  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    result = preflight.check_model(str(tmp_path), {})
    assert result.status == preflight.PASS and result.details["config"] == str(tmp_path)


def test_model_directory_with_unreadable_weights(tmp_path, tiny_model_dir):
    """A checkpoint cut off mid-download FAILs naming the file (weights_check.py); the intact copy passes."""
    import shutil

    model = shutil.copytree(tiny_model_dir("qwen3"), tmp_path / "qwen3")
    assert preflight.check_model(str(model), {}).status == preflight.PASS  # the fixed twin
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 3])
    result = preflight.check_model(str(model), {})
    assert result.status == preflight.FAIL, result
    assert f"{model / 'model.safetensors'}: cannot be read as safetensors" in result.summary


def image_row(*images: str, **keys) -> dict:
    """A prompt row as prepare_data.py writes it (data/sample/train.jsonl) with these image paths; `keys`
    replace or add keys (a key set to None is left out)."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Find x."}]
    row = {"prompt": [{"role": "user", "content": content}], "images": list(images), "label": "5"}
    return {key: value for key, value in {**row, **keys}.items() if value is not None}


def write_data(directory: Path, files: dict, pngs: tuple[str, ...]) -> None:
    """Each file: a list of rows (JSONL) or raw text; each PNG a real 8x8 image (made with PIL)."""
    for name, content in files.items():
        text = content if isinstance(content, str) else "".join(json.dumps(row) + "\n" for row in content)
        (directory / name).write_text(text)
    for name in pngs:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), "white").save(directory / name)


def data_check(directory: Path, dataset: str, *overrides: str) -> preflight.CheckResult:
    """The data check of the CPU smoke recipe (4 rows read, one image per prompt, no eval set) on
    `dataset`, relative paths resolved from `directory` (the launcher's, in a real run)."""
    run = render_recipe.load_run("smoke-cpu", [f"data.prompt_dataset={dataset}", *overrides], {"HOME": "/no"})
    return preflight.check_data(run, directory)


ONE_IMAGE = {"train.jsonl": [image_row("images/0.png")]}
TWO_IMAGES = {"train.jsonl": [image_row("images/0.png", "images/1.png")]}
QUESTION = {"train.jsonl": [image_row("images/0.png", prompt=None, question="Find x.")]}
NO_LABEL = {"train.jsonl": [image_row("images/0.png", label=None)]}
ONE_PNG, BOTH_PNGS = ("images/0.png",), ("images/0.png", "images/1.png")
FINE = ("train.jsonl", ONE_IMAGE, ONE_PNG, ())

# Each case: what is broken -> (status, words of the summary), then its fixed twin, which passes. A case is
# (data.prompt_dataset, files, PNGs, recipe overrides).
DATA_CASES = {
    "missing file": (
        ("train.jsonl", {}, (), ()),
        (preflight.FAIL, "train.jsonl: no such file or directory in"),
        FINE,
    ),
    "not parseable": (
        ("train.jsonl", {"train.jsonl": '{"prompt": "Find x."}\nnot json\n'}, (), ()),
        (preflight.FAIL, "`datasets` cannot read it as OpenRLHF does"),
        FINE,
    ),
    "missing input key": (
        ("train.jsonl", QUESTION, ONE_PNG, ()),
        (preflight.FAIL, "1 rows have no 'prompt' (data.input_key"),
        ("train.jsonl", QUESTION, ONE_PNG, ("data.input_key=question",)),
    ),
    "missing label key": (
        ("train.jsonl", NO_LABEL, ONE_PNG, ()),
        (preflight.FAIL, "no row has 'label' (data.label_key"),
        ("train.jsonl", NO_LABEL, ONE_PNG, ("data.label_key=null",)),
    ),
    "missing image key": (
        ("train.jsonl", ONE_IMAGE, ONE_PNG, ("data.image_key=image",)),
        (preflight.FAIL, "no row has 'image' (data.image_key"),
        FINE,
    ),
    "relative image missing": (
        ("train.jsonl", ONE_IMAGE, (), ()),
        (preflight.FAIL, "1 rows have none of their images (of 1 missing, e.g. images/0.png)"),
        FINE,
    ),
    "some images missing": (
        ("train.jsonl", TWO_IMAGES, ONE_PNG, ("data.max_images_per_prompt=2",)),
        (preflight.WARN, "1 rows miss some of their images (e.g. images/1.png)"),
        ("train.jsonl", TWO_IMAGES, BOTH_PNGS, ("data.max_images_per_prompt=2",)),
    ),
    "over the image limit": (
        ("train.jsonl", TWO_IMAGES, BOTH_PNGS, ()),
        (preflight.FAIL, "1 rows have more than 1 images (data.max_images_per_prompt)"),
        ("train.jsonl", TWO_IMAGES, BOTH_PNGS, ("data.max_images_per_prompt=2",)),
    ),
    "no such split": (
        ("train.jsonl", ONE_IMAGE, ONE_PNG, ("data.prompt_split=test",)),
        (preflight.FAIL, "no split 'test' (data.prompt_split); it has ['train']"),
        FINE,
    ),
    "hub id": (
        ("hiyouga/geometry3k", {}, (), ()),
        (preflight.WARN, "a hub dataset id: not checked offline"),
        FINE,
    ),
    "one of two datasets missing": (
        ("train.jsonl,more.jsonl", ONE_IMAGE, ONE_PNG, ()),
        (preflight.FAIL, "more.jsonl: no such file or directory"),
        ("train.jsonl,more.jsonl", {**ONE_IMAGE, "more.jsonl": ONE_IMAGE["train.jsonl"]}, ONE_PNG, ()),
    ),
}


def data_case(directory: Path, dataset: str, files: dict, pngs: tuple, overrides: tuple):
    directory.mkdir()
    write_data(directory, files, pngs)
    return data_check(directory, dataset, *overrides)


@pytest.mark.parametrize("case", list(DATA_CASES), ids=list(DATA_CASES))
def test_data(tmp_path, case):
    broken, (status, said), fixed = DATA_CASES[case]
    result = data_case(tmp_path / "broken", *broken)
    assert (result.status, said in result.summary) == (status, True), result.summary
    assert result.fix
    passed = data_case(tmp_path / "fixed", *fixed)
    assert passed.status == preflight.PASS, passed.summary


def test_data_reads_the_rows_the_run_reads_and_at_most_the_cap(tmp_path, monkeypatch):
    write_data(tmp_path, {"train.jsonl": [image_row("images/0.png")] * 6}, ONE_PNG)
    result = data_check(tmp_path, "train.jsonl")
    assert result.status == preflight.PASS
    assert "first 4 rows (data.max_samples: the run reads no more)" in result.summary
    assert result.details == {"datasets": [{"rows": 4, "images": 4, "missing": 0, "over_limit": 0}]}
    assert "6 rows, each with" in data_check(tmp_path, "train.jsonl", "data.max_samples=10").summary
    monkeypatch.setattr(preflight, "DATA_ROW_CAP", 2)
    assert "first 2 rows (preflight's cap)" in data_check(tmp_path, "train.jsonl").summary


def test_the_sample_data_passes_with_the_smoke_recipe_from_the_repo_root(tmp_path):
    run = render_recipe.load_run("smoke-cpu", [], {"HOME": "/no"})
    result = preflight.check_data(run, ROOT)
    assert result.status == preflight.PASS, result.summary
    assert "data/sample/train.jsonl" in result.summary and result.details["datasets"][0]["images"] == 4
    # Negative control: the same JSONL read from another directory, whose image paths resolve there.
    (tmp_path / "data" / "sample").mkdir(parents=True)
    shutil.copy(ROOT / "data" / "sample" / "train.jsonl", tmp_path / "data" / "sample")
    moved = preflight.check_data(run, tmp_path)
    assert moved.status == preflight.FAIL and "4 rows have none of their images" in moved.summary


def test_data_without_a_recipe_or_a_dataset_is_not_checked():
    assert preflight.check_data(None, ROOT).status == preflight.NA
    without = preflight.check_data(user_27b_run(), ROOT)  # flags without data.prompt_dataset
    assert without.status == preflight.NA and "no data.prompt_dataset" in without.summary


def test_packages_match_the_pins_here():
    result = host_checks.check_packages("cpu")
    assert result.status == preflight.PASS, result.summary
    installed = pins.installed_versions()
    assert f"OpenRLHF {installed['openrlhf']} (tested)" in result.summary and "(tested)" in result.summary


def fake_python(tmp_path, supported: str, supported_rc: int, pins_check: str, check_rc: int) -> str:
    """A `python` answering pins.py's two commands as another environment would."""
    path = tmp_path / "python"
    path.write_text(
        f'#!/bin/sh\nif [ "$2" = supported ]; then echo "{supported}"; exit {supported_rc}; fi\n'
        f'echo "{pins_check}"; exit {check_rc}\n'
    )
    path.chmod(0o755)
    return str(path)


# (pins.py supported's answer and exit code, pins.py check's, the status, fragments of summary and fix)
PACKAGE_CASES = [
    # a release outside [supported]: refused, naming the setup and the setting
    ("OpenRLHF 0.10.4 (refused)", 1, "", 0, {}, preflight.FAIL, ("OpenRLHF 0.10.4", "setup_env.sh --gpu")),
    # ... unless the run allows untested releases: a warning
    (
        "OpenRLHF 0.10.4 (refused)",
        1,
        "",
        0,
        {"LORA_SYNC_ALLOW_UNTESTED_VERSIONS": "1"},
        preflight.WARN,
        ("OpenRLHF 0.10.4",),
    ),
    # within range but not the pinned stack (a user's environment): runs, with a warning
    (
        "OpenRLHF 0.11.3 (in range)",
        0,
        "torch: installed 2.0.0, pinned 2.13.0",
        1,
        {},
        preflight.WARN,
        ("OpenRLHF 0.11.3 (in range)", "torch: installed 2.0.0", "setup_env.sh --gpu"),
    ),
    # control: the pinned stack
    ("OpenRLHF 0.11.2 (tested)", 0, "", 0, {}, preflight.PASS, ("OpenRLHF 0.11.2 (tested)",)),
]


@pytest.mark.parametrize(
    "supported, supported_rc, pins_check, check_rc, env, status, fragments", PACKAGE_CASES
)
def test_packages_report_each_release_and_the_fix(
    supported, supported_rc, pins_check, check_rc, env, status, fragments, tmp_path, monkeypatch
):
    monkeypatch.delenv("LORA_SYNC_ALLOW_UNTESTED_VERSIONS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    python = fake_python(tmp_path, supported, supported_rc, pins_check, check_rc)
    result = host_checks.check_packages("gpu", python=python)
    assert result.status == status
    assert all(fragment in f"{result.summary} {result.fix}" for fragment in fragments), result


def test_memory_fails_for_the_users_27b_with_the_knob():
    spec = model_inventory.model_spec(model_inventory.REFERENCE_CONFIGS["Qwen/Qwen3.5-27B"])
    budget = memory_budget.estimate(spec, memory_budget.shape_from_run(user_27b_run()), "27B")
    result = preflight.check_memory(budget, spec)
    assert result.status == preflight.FAIL
    assert "sync:" in result.summary and "vLLM weights 12.7" in result.summary
    assert "trainer.offload_params: true" in result.fix and "--vllm.gpu_memory_utilization" in result.fix


def fake_meminfo(tmp_path: Path, available_gib: float) -> Path:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {int(512 * 2**20)} kB\nMemFree:        1000 kB\n"
        f"MemAvailable:   {int(available_gib * 2**20)} kB\n"
    )
    return meminfo


def recipe_27b(*overrides: str) -> render_recipe.Run:
    return render_recipe.load_run(RECIPE_27B, overrides, {"HOME": "/nonexistent"})


def host_check(tmp_path: Path, run: render_recipe.Run, available_gib: float) -> preflight.CheckResult:
    spec = model_inventory.model_spec(model_inventory.REFERENCE_CONFIGS[run.args.actor.model_name_or_path])
    budget = memory_budget.estimate(spec, memory_budget.shape_from_run(run), "27B")
    return preflight.check_host_memory(budget, spec, fake_meminfo(tmp_path, available_gib))


def test_host_memory_against_memavailable(tmp_path):
    run = recipe_27b()
    passed = host_check(tmp_path, run, 100)
    assert passed.status == preflight.PASS
    assert "81.9 GiB of host RAM" in passed.summary and "trainer base (offload) 51.0" in passed.summary
    assert "100.0 GiB available" in passed.summary
    # Negative control: the same run on a host with 60 GiB available fails, naming less offload and what
    # that does to the GPUs.
    failed = host_check(tmp_path, run, 60)
    assert failed.status == preflight.FAIL
    assert "trainer.offload_params: false" in failed.fix and "the GPUs do not fit (rollout" in failed.fix
    assert "sync.vllm_sleep_level: 2" not in failed.fix  # the recipe is at level 2 already


def test_host_memory_at_sleep_level_1_names_level_2(tmp_path):
    result = host_check(tmp_path, recipe_27b("sync.vllm_sleep_level=1"), 100)
    assert result.status == preflight.FAIL and "vLLM weights (sleep level 1) 51.0" in result.summary
    level_2 = next(
        option for option in result.fix.split(" | ") if option.startswith("sync.vllm_sleep_level: 2")
    )
    assert "host RAM 81.9 GiB (fits), the GPUs still fit" in level_2
    assert host_check(tmp_path, recipe_27b("sync.vllm_sleep_level=1"), 140).status == preflight.PASS


def test_the_27b_recipe_passes_preflight_on_4_rtx_4090s_with_enough_host_ram(tmp_path, monkeypatch):
    """run_checks on the 27B recipe with a stand-in nvidia-smi listing four 24 GB RTX 4090s (as
    test_gpus_from_nvidia_smi_when_torch_sees_none fakes them) and a fake /proc/meminfo. The lora_config
    check is left out (it builds the 27B on the meta device, about a minute on 2 cores):
    tests/inputs/test_config_checks.py::test_shipped_recipes_target_modules_that_exist runs it on this
    recipe."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + "echo 'NVIDIA GeForce RTX 4090, 24564'\n" * 4)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    if host_checks.detect_gpus()[1] == "torch.cuda":
        pytest.skip("torch sees a real GPU here")
    monkeypatch.setattr(
        preflight, "check_lora_config", lambda *args: preflight.CheckResult("lora_config", preflight.NA, "")
    )

    def checks(available_gib: float, *overrides: str) -> dict[str, preflight.CheckResult]:
        plan = preflight.Plan(
            recipe_27b(*overrides), stack="cpu", meminfo=fake_meminfo(tmp_path, available_gib)
        )
        return {result.name: result for result in preflight.run_checks(plan, env={"HOME": str(tmp_path)})}

    results = checks(100)
    assert results["gpus"].status == preflight.PASS and results["gpus"].details["count"] == 4
    assert results["memory"].status == preflight.PASS, results["memory"].summary
    assert results["host_memory"].status == preflight.PASS, results["host_memory"].summary
    # Negative controls: too little host RAM, and the run without the trainer base offload.
    assert checks(60)["host_memory"].status == preflight.FAIL
    assert checks(100, "trainer.offload_params=false")["memory"].status == preflight.FAIL


def run_cli(*args, env=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "WANDB_", "PREFLIGHT_"))}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "preflight.py"), *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=ROOT,
        timeout=300,
    )


def test_cli_reports_every_check_and_fails_on_a_denied_probe_with_expandable_segments():
    completed = run_cli(
        "--json",
        "--stack",
        "cpu",
        env={host_checks.FORCE_DENIED_ENV: "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    results = {r["name"]: r for r in map(json.loads, completed.stdout.splitlines())}
    assert set(results) == {
        "gpus",
        "ptrace_scope",
        "cap_sys_ptrace",
        "pidfd_getfd",
        "alloc_conf",
        "dev_shm",
        "nccl_p2p",
        "wandb",
        "disk",
        "model",
        "packages",
        "memory",
        "host_memory",
        "transport",
        "lora_config",
        "data",
        "reward",
    }
    assert results["pidfd_getfd"]["status"] == preflight.FAIL
    assert "SYS_PTRACE" in results["pidfd_getfd"]["fix"]
    assert completed.returncode == 1


def test_cli_with_the_users_recipe(tmp_path):
    recipe = tmp_path / "user-27b.yaml"
    recipe.write_text(yaml.safe_dump(USER_27B_FLAGS))
    completed = run_cli("--recipe", str(recipe), "--stack", "cpu", "--output-dir", str(tmp_path))
    lines = completed.stdout.splitlines()
    memory = next(line for line in lines if line.startswith("FAIL  memory"))
    assert "Qwen/Qwen3.5-27B" in memory
    assert any("trainer.offload_params: true" in line for line in lines)
    assert lines[-1].startswith("preflight: 17 checks")
    assert completed.returncode == 1
