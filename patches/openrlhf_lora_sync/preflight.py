#!/usr/bin/env python3
"""Preflight: checks this machine for a GRPO + LoRA run, one line per check (PASS/WARN/FAIL/N/A) with a fix.

    python scripts/preflight.py [--recipe recipes/R.yaml] [--model PATH_OR_HUB_ID] [--gpus N]
                                [--gpu-mem-gib G] [--output-dir DIR] [--stack cpu|gpu]
                                [--set FLAG=VALUE ...] [--json]

Hardware: any Linux machine; GPU checks report N/A (no recipe) or FAIL (a recipe that needs GPUs) without
one. Takes a few seconds: two short probe processes, the package check, torch's import where an NVIDIA
driver is present, and `datasets`' import where the run's data is local. Exits 1 when any check FAILs, else
0. Makes no network calls.

Covers
- gpus: count and memory against the recipe and its memory budget (torch.cuda, else nvidia-smi).
- ptrace_scope and cap_sys_ptrace: kernel.yama.ptrace_scope and CAP_SYS_PTRACE (CapEff bit 19), which
  decide whether one process may take a file descriptor from a sibling.
- pidfd_getfd: a real probe of the call CUDA IPC makes for expandable-segment memory: process A opens a
  file descriptor and waits, its sibling B calls pidfd_open(A) then pidfd_getfd(pidfd, fd) (syscalls
  434 and 438 on x86_64 and aarch64). `force_denied=True` (or PREFLIGHT_FORCE_PIDFD_DENIED=1) makes the
  denial real rather than simulated: A marks itself non-dumpable (prctl PR_SET_DUMPABLE 0) and B drops
  CAP_SYS_PTRACE from its effective set first. Measured here as root: PR_SET_DUMPABLE 0 alone does not
  deny (CAP_SYS_PTRACE overrides it), the pair does, with EPERM, which is what an unprivileged user or a
  container without `cap_add: [SYS_PTRACE]` sees.
- alloc_conf: PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF expandable segments (the former wins in torch).
- dev_shm: /dev/shm size against Ray's object store (30% of RAM by default; Ray falls back to /tmp
  with a warning when /dev/shm is smaller) and NCCL's shared-memory transport.
- nccl_p2p: GeForce cards (RTX 4090) have no peer-to-peer: NCCL_P2P_DISABLE=1 is recommended.
- wandb: WANDB_API_KEY, ~/.netrc for api.wandb.ai, the recipe's logger.wandb.key, or offline mode.
- disk: free space at the output directory against the checkpoints the recipe keeps.
- model: a local directory with config.json, or a hub id in the local Hugging Face cache.
- data: each entry of data.prompt_dataset and eval.dataset (comma-separated, `path@data_dir`) opened by
  `datasets` as openrlhf.datasets.utils.blending_datasets opens it (builder by extension, save_to_disk
  directory, folder of data files; streamed) with its split, and its first rows (data.max_samples, at most
  1000): data.input_key and data.label_key present; in a VLM run (data.max_images_per_prompt > 0)
  data.image_key present, local image files found relative to the working directory (the launcher's, which
  every Ray actor enters: LORA_SYNC_WORKDIR), and no row over data.max_images_per_prompt. FAILs what stops
  the run (no file, unreadable, no such split or key, a row none of whose images exist, a row over the
  image limit, which vLLM refuses); WARNs rows missing some images or a label, and hub ids (not checked).
- packages: `pins.py check --stack cpu|gpu` (installed versions against versions.toml), run by the Python
  that will train (`python`), which need not be this one.
- transport: the recipe's sync.transport (or LORA_SYNC_TRANSPORT) against this host: cuda_ipc FAILs
  without GPUs or where the pidfd_getfd probe is denied, naming shm as the fix.
- lora_config: openrlhf_lora_sync.config_checks on the recipe (DoRA, no LoRA, the rank against the sync
  mode, ds.lora.target_modules matched by peft against the model built from its config without weights).
- memory: scripts/memory_budget.py's per-GPU estimate of rollout, train and weight sync; a setting that
  does not fit FAILs with the numbers and the knobs that make it fit.
- host_memory: the estimator's host RAM for the run (vLLM's weights at sleep level 1, the trainer base
  offload, the LoRA optimizer, the processes) against MemAvailable in /proc/meminfo; FAILs naming the
  settings that need less (vLLM sleep level 2, less offload) and whether the GPUs still fit with them.

Does not cover: network reachability (hub, wandb), NCCL itself, the driver/CUDA version match (torch
reports that on first use), multi-node setups, hub datasets, rows after the first 1000, whether images
decode, prompt lengths against data.max_len, or blended datasets' features matching. Recipes are read as
YAML mappings whose keys are OpenRLHF flags without dashes, nested (`vllm: {tensor_parallel_size: 4}`) or
dotted; a `base:` key names a recipe (path relative to this one) that it overrides.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import netrc
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from openrlhf_lora_sync import config_checks, memory_budget, pins, settings
from openrlhf_lora_sync.recipe import RecipeError, Run, load_run

GIB = 1024**3
PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "N/A"
CAP_SYS_PTRACE_BIT = 19
FORCE_DENIED_ENV = "PREFLIGHT_FORCE_PIDFD_DENIED"
# pidfd_open and pidfd_getfd sit in the syscall table that x86_64 and the generic (arm64) ABI share.
SYSCALLS = {"x86_64": (434, 438), "aarch64": (434, 438), "arm64": (434, 438)}
PTRACE_FIX = (
    "in Docker add `cap_add: [SYS_PTRACE]` (compose.yaml has it: Docker's seccomp profile blocks "
    "pidfd_getfd without it, whatever the host sysctl says); on a host give the processes CAP_SYS_PTRACE, "
    "or as a fallback `sudo sysctl -w kernel.yama.ptrace_scope=0`; and keep "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False so CUDA IPC does not need pidfd_getfd at all"
)


@dataclass
class CheckResult:
    name: str
    status: str
    summary: str
    fix: str = ""
    details: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"{self.status:4s}  {self.name:15s} {self.summary}"]
        if self.fix and self.status in (FAIL, WARN):
            out.append(f"{'':21s}fix: {self.fix}")
        return out


@dataclass(frozen=True)
class GpuInfo:
    name: str
    memory_gib: float


# ---------------------------------------------------------------------------------------------- GPUs


def detect_gpus() -> tuple[list[GpuInfo], str]:
    """Visible CUDA GPUs and how they were found (or why none were)."""
    has_driver = shutil.which("nvidia-smi") is not None or Path("/dev/nvidiactl").exists()
    if not has_driver:
        return [], "no NVIDIA driver: neither nvidia-smi nor /dev/nvidiactl"
    try:
        import torch

        if torch.cuda.is_available():
            gpus = []
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                gpus.append(GpuInfo(props.name, props.total_memory / GIB))
            return gpus, "torch.cuda"
        reason = f"torch {torch.__version__} sees no CUDA device"
    except ImportError:
        reason = "torch is not installed"
    try:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return [], f"{reason}; nvidia-smi failed: {error}"
    if query.returncode != 0:
        return [], f"{reason}; nvidia-smi: {query.stderr.strip() or query.stdout.strip()}"
    gpus = []
    for line in query.stdout.strip().splitlines():
        name, _, mib = line.rpartition(",")
        gpus.append(GpuInfo(name.strip(), float(mib) / 1024))
    return gpus, f"nvidia-smi ({reason})"


def check_gpus(
    gpus: list[GpuInfo], source: str, need_gpus: int | None, need_gib: float | None
) -> CheckResult:
    if not gpus:
        if need_gpus:
            return CheckResult(
                "gpus",
                FAIL,
                f"no CUDA GPU visible ({source}); the recipe needs {need_gpus}",
                "run on a GPU host with the NVIDIA driver (in Docker: the NVIDIA container toolkit and "
                "compose's GPU reservation), or use the CPU smoke recipe",
            )
        return CheckResult("gpus", NA, f"no CUDA GPU visible ({source}); only the CPU stack runs here")
    smallest = min(gpu.memory_gib for gpu in gpus)
    names = sorted({gpu.name for gpu in gpus})
    summary = f"{len(gpus)} x {', '.join(names)} ({smallest:.1f} GiB smallest) via {source}"
    if need_gpus and len(gpus) < need_gpus:
        return CheckResult(
            "gpus",
            FAIL,
            f"{summary}; the recipe needs {need_gpus}",
            "expose them (CUDA_VISIBLE_DEVICES, the compose GPU reservation) or pick a recipe for fewer GPUs",
        )
    if need_gib and smallest < need_gib:
        return CheckResult(
            "gpus",
            FAIL,
            f"{summary}; the memory budget peaks at {need_gib:.1f} GiB per GPU",
            "see the memory check below for the knob to turn",
        )
    return CheckResult("gpus", PASS, summary, details={"count": len(gpus), "min_gib": smallest})


def check_nccl_p2p(gpus: list[GpuInfo], env: dict) -> CheckResult:
    if not gpus:
        return CheckResult("nccl_p2p", NA, "no GPU")
    geforce = sorted({gpu.name for gpu in gpus if "geforce" in gpu.name.lower()})
    setting = env.get("NCCL_P2P_DISABLE")
    if not geforce:
        return CheckResult("nccl_p2p", PASS, "no GeForce card; NCCL decides peer-to-peer itself")
    if setting == "1":
        return CheckResult("nccl_p2p", PASS, f"{', '.join(geforce)} with NCCL_P2P_DISABLE=1")
    return CheckResult(
        "nccl_p2p",
        WARN,
        f"{', '.join(geforce)}: GeForce cards have no peer-to-peer, and NCCL_P2P_DISABLE is "
        f"{'unset' if setting is None else repr(setting)} (NCCL can hang or fail trying P2P)",
        "export NCCL_P2P_DISABLE=1 (compose.yaml sets it)",
    )


# ------------------------------------------------------------------------------------ ptrace, pidfd


def read_ptrace_scope(path: Path = Path("/proc/sys/kernel/yama/ptrace_scope")) -> int | None:
    try:
        return int(path.read_text().strip())
    except FileNotFoundError:
        return None


def has_cap_sys_ptrace(status_path: Path = Path("/proc/self/status")) -> bool:
    for line in status_path.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE_BIT & 1)
    raise ValueError(f"{status_path} has no CapEff line")


def check_ptrace_scope(path: Path = Path("/proc/sys/kernel/yama/ptrace_scope")) -> CheckResult:
    scope = read_ptrace_scope(path)
    if scope is None:
        return CheckResult(
            "ptrace_scope", NA, "Yama is not active (no kernel.yama.ptrace_scope): only same-user rules apply"
        )
    meaning = {
        0: "any process of the same user may attach",
        1: "only ancestors may attach: sibling processes (Ray actors, vLLM workers) need CAP_SYS_PTRACE",
        2: "only processes with CAP_SYS_PTRACE may attach",
        3: "nobody may attach, whatever their capabilities",
    }.get(scope, "unknown value")
    status = PASS if scope == 0 else FAIL if scope == 3 else WARN
    fix = (
        "Yama 3 cannot be lowered without a reboot; keep expandable segments off (the sync then uses shm)"
        if scope == 3
        else "decisive is the pidfd_getfd probe below; if it fails: " + PTRACE_FIX
    )
    summary = f"kernel.yama.ptrace_scope={scope}: {meaning}"
    return CheckResult("ptrace_scope", status, summary, fix, {"scope": scope})


def check_cap_sys_ptrace(status_path: Path = Path("/proc/self/status")) -> CheckResult:
    if has_cap_sys_ptrace(status_path):
        return CheckResult("cap_sys_ptrace", PASS, "CAP_SYS_PTRACE is in the effective set (CapEff bit 19)")
    return CheckResult(
        "cap_sys_ptrace",
        WARN,
        "CAP_SYS_PTRACE is not in the effective set (CapEff bit 19): siblings can take each other's file "
        "descriptors only when kernel.yama.ptrace_scope=0 and no seccomp profile blocks pidfd_getfd",
        "decisive is the pidfd_getfd probe below; if it fails: " + PTRACE_FIX,
    )


_PROBE_TARGET = """
import ctypes, os, sys
if sys.argv[1] == "undumpable":
    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
fd = os.open(os.devnull, os.O_RDONLY)
print(os.getpid(), fd, flush=True)
sys.stdin.read()
"""

_PROBE_CALLER = """
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
pid, fd, nr_open, nr_getfd = (int(arg) for arg in (sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5]))
drop = sys.argv[3] == "drop"

def report(stage, code):
    print(json.dumps({"stage": stage, "errno": errno.errorcode.get(code, str(code)) if code else None}))
    sys.exit()

if drop:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        report("capget", ctypes.get_errno())
    data[0].effective &= ~(1 << 19)  # CAP_SYS_PTRACE
    if libc.capset(ctypes.byref(header), data) != 0:
        report("capset", ctypes.get_errno())
pidfd = libc.syscall(nr_open, pid, 0)
if pidfd < 0:
    report("pidfd_open", ctypes.get_errno())
if libc.syscall(nr_getfd, pidfd, fd, 0) < 0:
    report("pidfd_getfd", ctypes.get_errno())
report("pidfd_getfd", 0)
"""


@dataclass(frozen=True)
class PidfdProbeResult:
    ok: bool
    stage: str  # the call that answered: pidfd_open, pidfd_getfd (or capget/capset when forcing a denial)
    errno_name: str | None

    @property
    def message(self) -> str:
        if self.ok:
            return "pidfd_getfd from a sibling process succeeded"
        code = getattr(errno, self.errno_name or "", None)
        text = os.strerror(code) if code else "unknown error"
        return f"{self.stage} from a sibling process failed: {self.errno_name} ({text})"


def probe_pidfd_getfd(force_denied: bool = False) -> PidfdProbeResult:
    """Run the two sibling processes (both children of this one) and report what pidfd_getfd answered."""
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(f"no pidfd syscall numbers known for {platform.machine()}")
    python = [sys.executable, "-I", "-S", "-c"]
    target = subprocess.Popen(
        [*python, _PROBE_TARGET, "undumpable" if force_denied else "plain"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        announced = target.stdout.readline().split()
        if len(announced) != 2:
            raise OSError("the probe's target process did not start")
        pid, fd = announced
        caller = subprocess.run(
            [*python, _PROBE_CALLER, pid, fd, "drop" if force_denied else "keep", *map(str, numbers)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        target.stdin.close()
        target.wait(timeout=60)
    if caller.returncode != 0:
        raise OSError(f"pidfd probe crashed: {caller.stderr.strip()}")
    answer = json.loads(caller.stdout)
    return PidfdProbeResult(answer["errno"] is None, answer["stage"], answer["errno"])


def expandable_segments(env: dict) -> tuple[bool, str]:
    """Whether PyTorch's CUDA allocator will use expandable segments, and the variable that says so."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # torch reads the first one first
        value = env.get(name)
        if value:
            match = re.search(r"expandable_segments\s*:\s*(\w+)", value)
            return bool(match and match.group(1).lower() == "true"), name
    return False, ""


def check_pidfd_getfd(env: dict, force_denied: bool = False) -> CheckResult:
    force_denied = force_denied or env.get(FORCE_DENIED_ENV) == "1"
    try:
        probe = probe_pidfd_getfd(force_denied)
    except OSError as error:
        return CheckResult("pidfd_getfd", NA, f"probe not run: {error}")
    forced = " (denial forced: non-dumpable target, caller without CAP_SYS_PTRACE)" if force_denied else ""
    details = {"errno": probe.errno_name, "stage": probe.stage, "forced": force_denied}
    if probe.ok:
        summary = probe.message + ": CUDA IPC of expandable-segment memory can work"
        return CheckResult("pidfd_getfd", PASS, summary, details=details)
    if probe.errno_name == "ENOSYS":
        return CheckResult(
            "pidfd_getfd",
            WARN,
            probe.message + ": this kernel predates pidfd_getfd (Linux 5.6)",
            "keep PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False",
            details,
        )
    expandable, variable = expandable_segments(env)
    scope = read_ptrace_scope()
    why = (
        f"kernel.yama.ptrace_scope={scope if scope is not None else 'absent'}, CAP_SYS_PTRACE "
        f"{'present' if has_cap_sys_ptrace() else 'absent'}{forced}"
    )
    if expandable:
        return CheckResult(
            "pidfd_getfd",
            FAIL,
            f"{probe.message} ({why}) while {variable} enables expandable segments: CUDA IPC will fail "
            "with 'pidfd_getfd: Operation not permitted'",
            PTRACE_FIX,
            details,
        )
    return CheckResult(
        "pidfd_getfd",
        WARN,
        f"{probe.message} ({why}); harmless while expandable segments stay off, but CUDA IPC of "
        "expandable-segment memory would fail (the sync then uses its shared-memory transport)",
        PTRACE_FIX,
        details,
    )


def check_alloc_conf(env: dict) -> CheckResult:
    expandable, variable = expandable_segments(env)
    both = {name: env[name] for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if env.get(name)}
    if expandable:
        return CheckResult(
            "alloc_conf",
            WARN,
            f"{variable}={env[variable]}: CUDA IPC of expandable segments hands file descriptors over with "
            "pidfd_getfd (ptrace rules), and vLLM's sleep-mode pool switches them off only when set through "
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (compose.yaml sets it)",
        )
    if len(both) == 2 and len(set(both.values())) == 2:
        return CheckResult(
            "alloc_conf",
            WARN,
            f"PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF differ; torch uses PYTORCH_ALLOC_CONF ({both})",
            "set only one of them",
        )
    shown = f"{variable}={env[variable]}" if variable else "unset (PyTorch default: off)"
    return CheckResult("alloc_conf", PASS, f"expandable segments off: {shown}")


# ------------------------------------------------------------------------------- host resources


def mem_total_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemTotal line")


def check_dev_shm(shm: Path = Path("/dev/shm"), meminfo: Path = Path("/proc/meminfo")) -> CheckResult:
    try:
        stats = os.statvfs(shm)
    except FileNotFoundError:
        return CheckResult(
            "dev_shm", FAIL, f"{shm} does not exist", "mount a tmpfs there (compose: ipc: host)"
        )
    size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    object_store = 0.3 * mem_total_bytes(meminfo)
    summary = (
        f"{shm}: {size / GIB:.1f} GiB ({free / GIB:.1f} free); Ray's object store wants 30% of RAM = "
        f"{object_store / GIB:.1f} GiB"
    )
    fix = "compose: `ipc: host` (or shm_size: 32gb); docker run: --ipc=host"
    if free < GIB:
        return CheckResult(
            "dev_shm",
            FAIL,
            summary + "; under 1 GiB free, NCCL's shared-memory transport and the sync's shm buckets fail",
            fix,
        )
    if free < object_store:
        return CheckResult(
            "dev_shm", WARN, summary + "; Ray will spill its object store to /tmp (slower) and warn", fix
        )
    return CheckResult("dev_shm", PASS, summary)


def check_wandb(env: dict, flags: dict, home: Path | None = None) -> CheckResult:
    mode = env.get("WANDB_MODE", "")
    if env.get("WANDB_API_KEY"):
        return CheckResult("wandb", PASS, "WANDB_API_KEY is set")
    if flags.get("logger.wandb.key"):
        return CheckResult("wandb", PASS, "the recipe sets logger.wandb.key")
    netrc_path = Path(env["NETRC"]) if env.get("NETRC") else (home or Path.home()) / ".netrc"
    try:
        if netrc_path.is_file() and netrc.netrc(netrc_path).authenticators("api.wandb.ai"):
            return CheckResult("wandb", PASS, f"{netrc_path} has credentials for api.wandb.ai")
    except (netrc.NetrcParseError, OSError) as error:
        return CheckResult(
            "wandb", WARN, f"{netrc_path} is unreadable: {error}", "fix it or set WANDB_API_KEY"
        )
    if mode in ("offline", "disabled", "dryrun"):
        return CheckResult(
            "wandb", PASS, f"WANDB_MODE={mode}: no credentials needed (upload with `wandb sync`)"
        )
    return CheckResult(
        "wandb",
        WARN,
        "no wandb credentials (WANDB_API_KEY, ~/.netrc api.wandb.ai) and WANDB_MODE is not offline",
        "put WANDB_API_KEY in .env (compose reads it) or export WANDB_MODE=offline",
    )


def check_disk(output_dir: Path, need_bytes: float, reason: str) -> CheckResult:
    existing = output_dir.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    summary = (
        f"{free / GIB:.0f} GiB free at {existing} (for {output_dir}); needs about {need_bytes / GIB:.0f} GiB"
    )
    summary += f" ({reason})"
    if free < need_bytes:
        return CheckResult(
            "disk",
            FAIL,
            summary,
            "free space, point --output-dir / ckpt.path elsewhere, or lower ckpt.max_num",
        )
    return CheckResult("disk", PASS, summary)


# ----------------------------------------------------------------------------------------- model


def hf_hub_cache(env: dict) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists()


def model_weights_problem(path: Path) -> str | None:
    """weights_check's line for a local checkpoint's weight files (readable, shaped as its config builds)."""
    from transformers import AutoConfig

    from openrlhf_lora_sync.weights_check import expected_shapes, weights_problem

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return weights_problem(path)  # a config this transformers cannot build: files checked, shapes not
    return weights_problem(path, expected=expected_shapes(config))


def check_model(model: str | None, env: dict) -> CheckResult:
    if not model:
        return CheckResult("model", NA, "no model given (--model or the recipe's actor.model_name_or_path)")
    if looks_like_path(model):
        path = Path(model).expanduser()
        if (path / "config.json").is_file():
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
            unreadable = model_weights_problem(path)
            if unreadable:
                fix = "download the checkpoint again (or fix its files) before starting the run"
                return CheckResult("model", FAIL, unreadable, fix)
            return CheckResult(
                "model", PASS, f"{path}: config.json, model_type {model_type}", details={"config": str(path)}
            )
        return CheckResult(
            "model",
            FAIL,
            f"{path}: {'no config.json in it' if path.is_dir() else 'does not exist'}",
            "point actor.model_name_or_path at a Hugging Face checkpoint directory (mount it in compose)",
        )
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return CheckResult("model", FAIL, f"{model!r} is neither a path nor a hub id (org/name)", "fix it")
    cache = hf_hub_cache(env)
    snapshots = sorted((cache / f"models--{model.replace('/', '--')}" / "snapshots").glob("*/config.json"))
    if snapshots:
        snapshot = snapshots[-1].parent
        summary = f"{model} is in the Hugging Face cache ({snapshot})"
        return CheckResult("model", PASS, summary, details={"config": str(snapshot)})
    if env.get("HF_HUB_OFFLINE") == "1":
        return CheckResult(
            "model",
            FAIL,
            f"{model} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1",
            f"download it first (`hf download {model}`) or mount a cache that has it",
        )
    return CheckResult(
        "model",
        WARN,
        f"{model} is not in the Hugging Face cache {cache}; whether the hub has it cannot be checked "
        "offline (preflight makes no network calls); it will be downloaded at start",
        "pre-download it (`hf download " + model + "`); gated models need HF_TOKEN",
    )


# ------------------------------------------------------------------------------------------ data

DATA_ROW_CAP = 1000  # rows read per dataset, so that a large one is checked in seconds
# The extensions openrlhf.datasets.utils.blending_datasets loads with the `datasets` builder they name.
DATA_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
# Image references load_images fetches or decodes instead of opening as a file (the bare base64 it also
# accepts is not told apart: it counts as a missing file).
INLINE_IMAGE_PREFIXES = ("http://", "https://", "data:")


def image_references(row: dict, key: str) -> list:
    """A prompt row's images as OpenRLHF counts them (vlm_utils.process_prompt_with_images): the value under
    `key`, one reference or a list, without None entries (a text-only row has none)."""
    references = row.get(key)
    references = references if isinstance(references, list) else [references]
    return [reference for reference in references if reference is not None]


def load_local_dataset(path: Path, data_dir: str | None):
    """A local dataset opened the way blending_datasets opens it (the builder its extension names, else a
    save_to_disk directory, else a folder of data files), streamed where it is parsed, so that reading its
    first rows does not read the rest. Raises what `datasets` raises."""
    import datasets  # seconds to import on 2 cores: only where there is local data to check

    builder = DATA_FILE_BUILDERS.get(os.path.splitext(path)[1])
    if builder:
        return datasets.load_dataset(builder, data_files=str(path), streaming=True)
    if path.is_dir():
        try:
            return datasets.load_from_disk(str(path))
        except Exception:  # as in blending_datasets: not a save_to_disk directory, read its data files
            pass
    return datasets.load_dataset(str(path), data_dir=data_dir, streaming=True)


def row_problems(rows: list[dict], data, workdir: Path) -> tuple[list[tuple[str, str, str]], dict]:
    """What in `rows` the run would trip on, as (status, what, fix), and the counts: the keys the run reads
    (data.input_key, data.label_key), and in a VLM run (data.max_images_per_prompt > 0) each row's images,
    local paths opened from `workdir`, against the limit vLLM enforces."""
    keys = sorted({key for row in rows for key in row})
    problems = []
    missing_input = sum(row.get(data.input_key) is None for row in rows)
    if missing_input:
        what = f"{missing_input} rows have no {data.input_key!r} (data.input_key; keys: {keys})"
        problems.append((FAIL, what, "set data.input_key to the rows' prompt key, or fix those rows"))
    missing_label = sum(row.get(data.label_key) is None for row in rows) if data.label_key else 0
    if missing_label == len(rows):  # preprocess_data indexes every row by the key
        what = f"no row has {data.label_key!r} (data.label_key; keys: {keys})"
        problems.append((FAIL, what, "set data.label_key to the rows' answer key"))
    elif missing_label:
        what = f"{missing_label} rows have no {data.label_key!r}: the reward gets None as their label"
        problems.append((WARN, what, "fix those rows or drop them"))
    counts = {"rows": len(rows)}
    limit = data.max_images_per_prompt
    if limit <= 0:
        return problems, counts

    if not any(data.image_key in row for row in rows):
        what = f"no row has {data.image_key!r} (data.image_key; keys: {keys}) in a VLM run"
        problems.append((FAIL, what, "set data.image_key to the rows' image key"))
    images = found = none_found = some_missing = over_limit = 0
    example = None
    for row in rows:
        references = image_references(row, data.image_key)
        local = [r for r in references if isinstance(r, str) and not r.startswith(INLINE_IMAGE_PREFIXES)]
        missing = [r for r in local if not os.path.isfile(workdir / r)]
        images, found = images + len(references), found + len(references) - len(missing)
        example = example or (missing[0] if missing else None)
        none_found += bool(references) and len(missing) == len(references)
        some_missing += 0 < len(missing) < len(references)
        over_limit += len(references) > limit
    path_fix = (
        f"image paths open relative to the directory the launcher runs in ({workdir}, where preflight runs): "
        "make them relative to it (prepare_data.py --relative-to) or absolute"
    )
    if none_found:
        what = (
            f"{none_found} rows have none of their images (of {images - found} missing, e.g. {example}): "
            "OpenRLHF stops the run at such a row ('All images failed to load')"
        )
        problems.append((FAIL, what, path_fix))
    if some_missing:
        what = (
            f"{some_missing} rows miss some of their images (e.g. {example}): OpenRLHF leaves them out with "
            "a warning, and the prompt keeps their placeholders"
        )
        problems.append((WARN, what, path_fix))
    if over_limit:
        what = (
            f"{over_limit} rows have more than {limit} images (data.max_images_per_prompt): vLLM refuses "
            "such a prompt mid-run"
        )
        fix = "raise data.max_images_per_prompt, or drop those rows (prepare_data.py --max-images-per-prompt)"
        problems.append((FAIL, what, fix))
    return problems, {**counts, "images": images, "missing": images - found, "over_limit": over_limit}


def check_dataset(source: str, flags: tuple[str, str], split: str, data, workdir: Path) -> CheckResult:
    """One entry of a comma-separated dataset list (`path[@data_dir]`, as blending_datasets splits it):
    where it is (relative to `workdir`), whether `datasets` reads it, its split, then row_problems on its
    first rows (data.max_samples, at most DATA_ROW_CAP)."""
    dataset_flag, split_flag = flags
    name, _, data_dir = (part.strip() for part in source.partition("@"))
    shown = f"{dataset_flag} {name}"
    path = workdir / name
    if not path.exists():
        if os.path.splitext(name)[1] in DATA_FILE_BUILDERS or looks_like_path(name):
            return CheckResult(
                "data",
                FAIL,
                f"{shown}: no such file or directory" + ("" if os.path.isabs(name) else f" in {workdir}"),
                f"write it (`python scripts/prepare_data.py` writes data/geometry3k/) or point "
                f"{dataset_flag} at one (relative paths: from the launcher's directory, the repo root)",
            )
        if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
            return CheckResult(
                "data",
                WARN,
                f"{shown}: not a local path here, so a hub dataset id: not checked offline (preflight makes "
                "no network calls); OpenRLHF downloads it at start",
                f"convert it to local JSONL (`python scripts/prepare_data.py --dataset {name}`) and point "
                f"{dataset_flag} at that",
            )
        return CheckResult("data", FAIL, f"{shown}: neither a local path nor a hub id (org/name)", "fix it")

    limit = min(DATA_ROW_CAP, data.max_samples)
    try:
        loaded = load_local_dataset(path, data_dir or None)
        if isinstance(loaded, dict):  # a (Iterable)DatasetDict: blending_datasets takes the split by name
            if split not in loaded:
                summary = f"{shown}: no split {split!r} ({split_flag}); it has {sorted(loaded)}"
                return CheckResult("data", FAIL, summary, f"set {split_flag} to one of them")
            loaded = loaded[split]
        rows = list(itertools.islice(loaded, limit + 1))
    except Exception as error:  # datasets and pyarrow raise many types for data they cannot parse
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        return CheckResult(
            "data",
            FAIL,
            f"{shown}: `datasets` cannot read it as OpenRLHF does ({type(error).__name__}: {reason})",
            "fix or regenerate it (`python scripts/prepare_data.py`); JSONL is one JSON object per line",
        )
    if not rows:
        return CheckResult(
            "data", FAIL, f"{shown}: no rows", f"point {dataset_flag} at a dataset with prompts"
        )
    read = f"{len(rows)} rows"
    if len(rows) > limit:
        rows = rows[:limit]
        why = "data.max_samples: the run reads no more" if limit == data.max_samples else "preflight's cap"
        read = f"first {limit} rows ({why})"

    problems, details = row_problems(rows, data, workdir)
    if problems:
        status = FAIL if any(problem[0] == FAIL for problem in problems) else WARN
        summary = f"{shown}: {read}: " + "; ".join(problem[1] for problem in problems)
        return CheckResult("data", status, summary, "; ".join(problem[2] for problem in problems), details)
    named = " and ".join(repr(key) for key in (data.input_key, data.label_key) if key)
    summary = f"{shown}: {read}, each with {named}"
    if "images" in details:
        summary += f"; {details['images']} images, every local one found, none over the limit"
    return CheckResult("data", PASS, summary, details=details)


def check_data(run: Run | None, workdir: Path) -> CheckResult:
    """The run's prompt and eval datasets as OpenRLHF will read them in its Ray actors, which work in the
    launcher's directory (LORA_SYNC_WORKDIR): preflight runs there too, and passes it as `workdir`."""
    if run is None:
        return CheckResult("data", NA, "needs a recipe (or --set)")
    data, evaluation = run.args.data, run.args.eval
    lists = [
        (("data.prompt_dataset", "data.prompt_split"), data.prompt_dataset, data.prompt_split),
        (("eval.dataset", "eval.split"), evaluation.dataset, evaluation.split),
    ]
    results = [
        check_dataset(source, flags, split, data, workdir)
        for flags, sources, split in lists
        if sources
        for source in sources.split(",")
    ]
    if not results:
        return CheckResult("data", NA, "the run names no data.prompt_dataset")
    return CheckResult(
        "data",
        next((s for s in (FAIL, WARN) if any(r.status == s for r in results)), PASS),
        " | ".join(r.summary for r in results),
        "; ".join(r.fix for r in results if r.status != PASS),
        {"datasets": [r.details for r in results]},
    )


# -------------------------------------------------------------------------------------- packages


def check_packages(stack: str, python: str = sys.executable) -> CheckResult:
    command = [python, pins.__file__, "check", "--stack", stack]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    problems = result.stdout.strip().splitlines()
    if result.returncode == 0:
        return CheckResult("packages", PASS, f"installed versions match versions.toml ({stack} stack)")
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    return CheckResult(
        "packages",
        FAIL,
        f"{stack} stack differs from versions.toml: {shown or result.stderr.strip()}",
        f"bash scripts/setup_env.sh --{stack}",
        {"mismatches": problems},
    )


# ---------------------------------------------------------------------------------- memory budget


def _peaks(budget: memory_budget.Budget) -> str:
    return ", ".join(
        f"{name} {memory_budget.gib(budget.phase(name).total)}" for name in ("rollout", "train", "sync")
    )


def check_memory(budget: memory_budget.Budget, spec: memory_budget.ModelSpec) -> CheckResult:
    summary = f"{budget.model}: per-GPU peaks {_peaks(budget)} GiB of {memory_budget.gib(budget.gpu_bytes)}"
    details = {
        "peaks_gib": {f"{p.name}/{p.role}": round(p.total / GIB, 2) for p in budget.phases},
        "kv_sequences": budget.kv_sequences,
    }
    if budget.fits():
        return CheckResult("memory", PASS, summary, "", details)
    fitting = memory_budget.find_fitting(spec, budget.settings)
    if fitting is None:
        fix = "no knob makes it fit: a smaller model (README memory table), more GPUs or larger ones"
    else:
        changes, tuned = fitting
        after = memory_budget.estimate(spec, tuned)
        fix = (
            f"turn: {'; '.join(changes)} (then {_peaks(after)} GiB per GPU, "
            f"host RAM about {memory_budget.gib(after.host_bytes)} GiB)"
        )
    summary += " -- " + " | ".join(budget.problems())
    return CheckResult("memory", FAIL, summary, fix, details)


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """What the kernel says can be allocated without swapping (MemAvailable), in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable line")


def check_host_memory(
    budget: memory_budget.Budget, spec: memory_budget.ModelSpec, meminfo: Path
) -> CheckResult:
    gib = memory_budget.gib
    available = mem_available_bytes(meminfo)
    parts = ", ".join(f"{name} {gib(size)}" for name, size in budget.host_parts.items())
    summary = (
        f"the run needs about {gib(budget.host_bytes)} GiB of host RAM ({parts}); "
        f"{gib(available)} GiB available (MemAvailable)"
    )
    details = {"need_gib": round(budget.host_bytes / GIB, 1), "available_gib": round(available / GIB, 1)}
    if budget.host_bytes <= available:
        return CheckResult("host_memory", PASS, summary, details=details)
    options = []
    for label, after in memory_budget.host_alternatives(spec, budget.settings):
        host = "fits" if after.host_bytes <= available else "still too much"
        failing = [
            f"{n} {gib(after.phase(n).total)}" for n in ("rollout", "train", "sync") if not after.fits(n)
        ]
        gpus = (
            f"but the GPUs do not fit ({', '.join(failing)} GiB per GPU)" if failing else "the GPUs still fit"
        )
        options.append(f"{label}: host RAM {gib(after.host_bytes)} GiB ({host}), {gpus}")
    options.append("or free host RAM / run on a host with more")
    return CheckResult("host_memory", FAIL, summary, " | ".join(options), details)


# ------------------------------------------------------------------------------- run configuration


def check_lora_config(run: Run | None, model: str | None) -> CheckResult:
    """ds.lora.target_modules matched by peft against a weightless copy of the model (its local config,
    else memory_budget's reference config of that hub id), and data.max_len against the model's length;
    the run's own checks (DoRA, no LoRA, the rank against the sync mode) already passed when the recipe
    loaded (recipe.load_run)."""
    if run is None:
        return CheckResult("lora_config", NA, "needs a recipe (or --set)")
    reference = memory_budget.REFERENCE_CONFIGS.get(str(model))
    problems = []
    if model:
        problems = config_checks.length_problems(run, model)
        problems += config_checks.target_problems(run, model, reference)
    fatal = [p for p in problems if p.fatal]
    shown = fatal or problems
    if shown:
        summary = " | ".join(f"{p.key}: {p.message}" for p in shown)
        return CheckResult("lora_config", FAIL if fatal else WARN, summary, "; ".join(p.fix for p in shown))
    targets = f"checked against {model}" if model else "not checked (no model)"
    return CheckResult(
        "lora_config",
        PASS,
        f"LoRA rank {run.args.ds.lora.rank}, sync mode {run.setting('sync.mode')}, target_modules {targets}",
    )


def check_transport(transport: str, gpus: list[GpuInfo], pidfd: CheckResult) -> CheckResult:
    """The sync transport the recipe asks for against this host: cuda_ipc needs GPUs, and is refused where
    the pidfd_getfd probe is denied (CUDA IPC of expandable-segment memory fails there, and the transport's
    way around it, plain cudaMalloc buckets, has not been measured on GPUs)."""
    if transport != "cuda_ipc":
        return CheckResult(
            "transport", PASS, f"sync transport {transport}: only cuda_ipc depends on pidfd_getfd"
        )
    fix = "sync.transport: shm (or auto; LORA_SYNC_TRANSPORT=shm): the /dev/shm transport needs neither"
    if not gpus:
        return CheckResult(
            "transport", FAIL, "sync.transport cuda_ipc needs CUDA GPUs; none visible", fix + " GPUs"
        )
    if pidfd.details.get("errno"):
        return CheckResult(
            "transport",
            FAIL,
            f"sync.transport cuda_ipc on a host that denies pidfd_getfd between sibling processes "
            f"({pidfd.summary})",
            f"{fix} ptrace permission; or allow it: {PTRACE_FIX}",
        )
    return CheckResult("transport", PASS, "sync transport cuda_ipc: pidfd_getfd between siblings works here")


# ------------------------------------------------------------------------------------------- run


@dataclass
class Plan:
    """What the checks are measured against: the run (recipe.load_run) and the command line."""

    run: Run | None = None
    gpu_mem_gib: float | None = None
    output_dir: Path = Path("outputs")
    stack: str | None = None
    meminfo: Path = Path("/proc/meminfo")  # where host RAM is read (tests give a fake one)


def run_checks(plan: Plan, env: dict | None = None) -> list[CheckResult]:
    env = dict(os.environ if env is None else env)
    run = plan.run
    flags = run.flags if run else {}
    model = run.args.actor.model_name_or_path if run else None
    gpus, source = detect_gpus()
    results = []

    model_result = check_model(model, env)
    config = None
    if model_result.details.get("config"):
        config = memory_budget.load_config(model_result.details["config"])
    elif model in memory_budget.REFERENCE_CONFIGS:
        config = memory_budget.REFERENCE_CONFIGS[model]

    estimate_settings = memory_budget.shape_from_run(run, plan.gpu_mem_gib or 24.0) if run else None
    budget = spec = None
    memory_result = CheckResult("memory", NA, "needs a recipe (or --set) and a model config")
    host_result = CheckResult("host_memory", NA, "needs a recipe (or --set) and a model config")
    if estimate_settings and config:
        if gpus and not plan.gpu_mem_gib:
            estimate_settings = replace(estimate_settings, gpu_mem_gib=min(gpu.memory_gib for gpu in gpus))
        try:
            spec = memory_budget.model_spec(config)
            budget = memory_budget.estimate(spec, estimate_settings, str(model))
            memory_result = check_memory(budget, spec)
            host_result = check_host_memory(budget, spec, plan.meminfo)
        except ValueError as error:
            memory_result = CheckResult("memory", NA, f"not estimated: {error}")
            host_result = CheckResult("host_memory", NA, f"not estimated: {error}")

    need_gpus = estimate_settings.gpus if estimate_settings else None
    results.append(check_gpus(gpus, source, need_gpus, plan.gpu_mem_gib))
    results.append(check_ptrace_scope())
    results.append(check_cap_sys_ptrace())
    pidfd_result = check_pidfd_getfd(env)
    results.append(pidfd_result)
    transport = run.setting("sync.transport") if run else settings.read("sync.transport", env)
    results.append(check_transport(transport, gpus, pidfd_result))
    results.append(check_alloc_conf(env))
    results.append(check_dev_shm())
    results.append(check_nccl_p2p(gpus, env))
    results.append(check_wandb(env, flags))

    ckpt = run.args.ckpt if run else None
    output_dir = Path((ckpt and (ckpt.path or ckpt.output_dir)) or plan.output_dir)
    if budget and ckpt.save_steps > 0:
        per_checkpoint = 2.0 * spec.total_parameters + 16.0 * budget.lora_parameters
        need = ckpt.max_num * per_checkpoint + 5 * GIB
        reason = f"{ckpt.max_num} DeepSpeed checkpoints of {per_checkpoint / GIB:.0f} GiB + 5"
    else:
        need, reason = 5 * GIB, "adapters and logs; no periodic DeepSpeed checkpoints"
    results.append(check_disk(output_dir, need, reason))
    results.append(model_result)
    results.append(check_data(run, Path.cwd()))
    results.append(check_packages(plan.stack or ("gpu" if gpus else "cpu")))
    results.append(memory_result)
    results.append(host_result)
    results.append(check_lora_config(run, model_result.details.get("config") or model))
    return results


def load_plan_run(recipe, overrides=(), model=None, gpus=None, environ=None) -> Run | None:
    """The run preflight checks: the recipe (path or name) with --set overrides, --model and --gpus as the
    recipe keys they stand for; None without a recipe or overrides. Raises recipe.RecipeError."""
    overrides = list(overrides)
    if model:
        overrides.append(f"actor.model_name_or_path={model}")
    if gpus:
        overrides += ["actor.num_nodes=1", f"actor.num_gpus_per_node={gpus}"]
    if recipe is None and not overrides:
        return None
    return load_run(recipe, overrides, environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", help="recipes/NAME.yaml, or NAME")
    parser.add_argument("--model", help="model directory or hub id (default: the recipe's)")
    parser.add_argument("--gpus", type=int, help="GPUs the run uses (default: the recipe's)")
    parser.add_argument("--gpu-mem-gib", type=float, help="memory per GPU (default: detected, else 24)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"), help="where checkpoints go")
    parser.add_argument("--stack", choices=("cpu", "gpu"), help="pinned stack (default: gpu where a GPU is)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe key")
    parser.add_argument("--json", action="store_true", help="one JSON object per check")
    args = parser.parse_args(argv)

    try:
        run = load_plan_run(args.recipe, args.set, args.model, args.gpus)
    except RecipeError as error:
        print("\n".join(f"preflight: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    results = run_checks(Plan(run, args.gpu_mem_gib, args.output_dir, args.stack))
    for result in results:
        if args.json:
            print(json.dumps(asdict(result), default=str))
        else:
            print("\n".join(result.lines()))
    failed = [r.name for r in results if r.status == FAIL]
    if not args.json:
        names = f" ({', '.join(failed)})" if failed else ""
        print(f"preflight: {len(results)} checks, {len(failed)} failed{names}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
