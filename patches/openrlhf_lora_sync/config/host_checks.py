"""Preflight's checks of the machine itself, and the result every preflight check returns (CheckResult:
PASS/WARN/FAIL/N/A, a one-line summary and a fix). preflight.py runs them beside its checks of the run's
model, data, memory and configuration.

Hardware: any Linux machine; the GPU checks report N/A without one. The pidfd probe starts two short
processes, the package check one, torch is imported where an NVIDIA driver is present. No network calls.

Covers
- gpus: count and memory against the recipe and its memory budget (torch.cuda, else nvidia-smi).
- ptrace_scope and cap_sys_ptrace: kernel.yama.ptrace_scope and CAP_SYS_PTRACE (CapEff bit 19), which
  decide whether one process may take a file descriptor from a sibling.
- pidfd_getfd: a real probe of the call CUDA IPC makes for expandable-segment memory: process A opens a
  file descriptor and waits, its sibling B calls pidfd_open(A) then pidfd_getfd(pidfd, fd) (syscalls
  434 and 438 on x86_64 and aarch64). `force_denied=True` (or PREFLIGHT_FORCE_PIDFD_DENIED=1) makes the
  denial real rather than simulated: A marks itself non-dumpable (prctl PR_SET_DUMPABLE 0) and B drops
  CAP_SYS_PTRACE from its effective set first (why both: docs/troubleshooting.md, "Forcing the
  pidfd_getfd denial").
- alloc_conf: PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF expandable segments (the former wins in torch).
- dev_shm: /dev/shm size against Ray's object store (30% of RAM by default; Ray falls back to /tmp
  with a warning when /dev/shm is smaller) and NCCL's shared-memory transport.
- nccl_p2p: GeForce cards (RTX 4090) have no peer-to-peer: NCCL_P2P_DISABLE=1 is recommended.
- wandb: WANDB_API_KEY, ~/.netrc for api.wandb.ai, the recipe's logger.wandb.key, or offline mode.
- disk: free space at the output directory against the checkpoints the recipe keeps.
- packages: `pins.py supported` (OpenRLHF, vLLM, peft, DeepSpeed: tested, in range or refused) and
  `pins.py check --stack cpu|gpu` (every pin), run by the Python that will train (`python`), which need not
  be this one.
Does not cover: network reachability (hub, wandb), NCCL itself, the driver/CUDA version match (torch
reports that on first use), multi-node setups.
"""

from __future__ import annotations

import errno
import json
import netrc
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from openrlhf_lora_sync.base import pins, settings

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


# -------------------------------------------------------------------------------------- packages


def check_packages(stack: str, python: str = sys.executable) -> CheckResult:
    """The releases the training Python (`python`) has: each of OpenRLHF, vLLM, peft and DeepSpeed tested
    (a stack of versions.toml pins it), in range ([supported]) or refused (pins.check_versions refuses it
    at run time: FAIL), then every pin of `stack` (a difference is a WARN: untested, not refused)."""
    ranges = subprocess.run([python, pins.__file__, "supported"], capture_output=True, text=True, timeout=300)
    found = "; ".join(ranges.stdout.strip().splitlines()) or ranges.stderr.strip()
    if ranges.returncode != 0:
        allowed = settings.read(pins.ALLOW_UNTESTED)  # the run's environment (preflight runs in it)
        return CheckResult(
            "packages",
            WARN if allowed else FAIL,
            f"{found}: outside versions.toml [supported]",
            f"bash scripts/setup_env.sh --{stack} (the tested stack), or install releases in range"
            + ("" if allowed else f", or {pins.ALLOW_UNTESTED}=1 to run untested"),
            {"versions": found},
        )
    result = subprocess.run(
        [python, pins.__file__, "check", "--stack", stack], capture_output=True, text=True, timeout=300
    )
    problems = result.stdout.strip().splitlines()
    if result.returncode == 0:
        return CheckResult(
            "packages", PASS, f"{found}; installed versions match versions.toml ({stack} stack)"
        )
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    return CheckResult(
        "packages",
        WARN,
        f"{found}; {stack} stack differs from versions.toml: {shown or result.stderr.strip()}",
        f"none needed to run; bash scripts/setup_env.sh --{stack} builds the tested stack",
        {"mismatches": problems, "versions": found},
    )
