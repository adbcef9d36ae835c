"""CPU stand-ins: the answers OpenRLHF 0.11.2 needs to run its real `train_ppo_ray` on a machine without CUDA.

OpenRLHF, DeepSpeed and vLLM run on CPU (DeepSpeed's CPU accelerator, gloo, vLLM-CPU), but OpenRLHF calls a
few CUDA functions unconditionally. `install()` answers exactly those, and only where CUDA is absent
(`torch.cuda.is_available()` is False); where CUDA exists it does nothing, so a GPU run is upstream's code.
`openrlhf_patch.apply()` calls it, so the driver and every Ray worker get the same answers. Each entry of
STAND_INS names the upstream call sites it answers (file:line in the pinned releases) and why; none touches
what GRPO computes (advantages, losses, log-probs: the flash-attn entry selects OpenRLHF's own torch
log-prob path, which computes the same log-softmax as the Triton kernel the CPU cannot run).

What vLLM-CPU cannot do is switched off at the engine actor (ENGINE_SWITCHES, applied by the patched
RolloutRayActor through `engine_kwargs`): sleep mode (vLLM-CPU refuses `enable_sleep_mode`; the actor then
answers OpenRLHF's sleep/wake_up calls without freeing anything) and eager mode (a bf16 vLLM-CPU worker
with `enforce_eager` died with SIGILL on the CI machines' CPU). CUDA IPC needs nothing: the sync's
transport on CPU is shm or broadcast (settings.resolved_transport). `summary()` is the one log line that
lists all of it, printed once by the launcher.

Also needed, outside this module: Ray started with GPU resources declared (launch.py: OpenRLHF's placement
groups ask for GPUs) and `DS_ACCELERATOR=cpu` in every actor (DeepSpeed's CPU accelerator, whose op
builder compiles its fused Adam once per machine, cached under ~/.cache/torch_extensions: docs/cpu-run.md).
Does not cover: GPUs (nothing here runs there), or making a CPU run fast.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

FLASH_ATTN_TRITON_CROSS_ENTROPY = "flash_attn.ops.triton.cross_entropy"
DS_ACCELERATOR_ENV = {"DS_ACCELERATOR": "cpu"}


@dataclasses.dataclass(frozen=True)
class StandIn:
    target: str  # what is replaced: "module:attribute", or "sys.modules[name]"
    answer: str  # what it does instead
    sites: tuple[str, ...]  # upstream call sites (pinned releases), the reason it is needed
    why: str
    install: Callable[[], None]

    def line(self) -> str:
        return f"{self.target} -> {self.answer} ({', '.join(self.sites)})"


def torch_cuda_answer(name: str, result) -> Callable[[], None]:
    """Installs torch.cuda.<name> as a function of its own returning `result`. One function object per
    name: torch.dynamo keys its trace rules by the objects torch.cuda's names hold, and refuses one object
    under two names with different rules (an in-process vLLM engine compiles after install())."""

    def install() -> None:
        import torch

        def stand_in(*args, **kwargs):
            return result

        stand_in.__name__ = stand_in.__qualname__ = f"{name}_on_cpu"
        setattr(torch.cuda, name, stand_in)

    return install


def _block_triton_cross_entropy() -> None:
    # A None entry makes `import` raise ImportError, the failure OpenRLHF's try/except expects.
    sys.modules[FLASH_ATTN_TRITON_CROSS_ENTROPY] = None


def _replay_buffer_on_cpu() -> None:
    import torch
    from openrlhf.trainer.ppo_utils import replay_buffer

    upstream = replay_buffer.NaiveReplayBuffer.__init__

    def __init__(self, *args, **kwargs):
        # Upstream builds the string "cuda:<current_device()>"; index 0 makes it parse, and the device
        # is then set to the CPU, where the buffer's items are moved to.
        current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: 0
        try:
            upstream(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current_device
        self.target_device = torch.device("cpu")

    replay_buffer.NaiveReplayBuffer.__init__ = __init__


STAND_INS: tuple[StandIn, ...] = (
    StandIn(
        "torch.cuda:set_device",
        "no-op",
        ("openrlhf/utils/deepspeed/deepspeed.py:97",),
        "setup_distributed pins the local rank's GPU before deepspeed.init_distributed; a CPU rank has none",
        torch_cuda_answer("set_device", None),
    ),
    StandIn(
        "torch.cuda:synchronize",
        "no-op",
        (
            "openrlhf/utils/distributed_util.py:10",
            "openrlhf/utils/deepspeed/deepspeed_utils.py:189,211",
            "openrlhf/trainer/ray/ppo_actor.py:605",
            "openrlhf/trainer/ray/launcher.py:65",
        ),
        "waits for CUDA streams after barriers and state offloads; CPU work is already done when it returns",
        torch_cuda_answer("synchronize", None),
    ),
    StandIn(
        "torch.cuda:current_device",
        '"cpu"',
        (
            "openrlhf/trainer/ray/ppo_actor.py:171,627",
            "openrlhf/trainer/ray/launcher.py:136,190",
            "openrlhf/trainer/ray/utils.py:46",
            "openrlhf/trainer/ppo_utils/replay_buffer.py:104,129,159,165",
            "openrlhf/utils/deepspeed/deepspeed.py:614,633",
        ),
        "used as the device tensors are moved to (experiences, all-reduced counts); on CPU that is the CPU",
        torch_cuda_answer("current_device", "cpu"),
    ),
    StandIn(
        f"sys.modules[{FLASH_ATTN_TRITON_CROSS_ENTROPY}]",
        "ImportError",
        ("openrlhf/models/utils.py:180",),
        "log_probs_from_logits tries flash-attn's Triton cross-entropy first; the CPU stack ships "
        "flash-attn's "
        "Python files without kernels, so the import succeeds and the kernel fails; on ImportError OpenRLHF "
        "takes its torch path (the same log-softmax)",
        _block_triton_cross_entropy,
    ),
    StandIn(
        "openrlhf.trainer.ppo_utils.replay_buffer:NaiveReplayBuffer.__init__",
        "target_device = cpu",
        ("openrlhf/trainer/ppo_utils/replay_buffer.py:40",),
        'builds torch.device(f"cuda:{current_device()}"), which is "cuda:cpu" even with the answer above',
        _replay_buffer_on_cpu,
    ),
)

# Engine options vLLM-CPU cannot honour: (vLLM engine argument, value on CPU, why).
ENGINE_SWITCHES: tuple[tuple[str, object, str], ...] = (
    (
        "enable_sleep_mode",
        False,
        'vLLM-CPU refuses it ("Sleep mode is not supported on current platform"); OpenRLHF\'s sleep and '
        "wake_up calls are answered without freeing memory",
    ),
    ("enforce_eager", False, "a bf16 vLLM-CPU worker in eager mode died with SIGILL (vLLM 0.29.0)"),
)

_installed: list[StandIn] = []


def needed() -> bool:
    """True where there is no CUDA: the only place any stand-in is installed."""
    import torch

    return not torch.cuda.is_available()


def install() -> list[StandIn]:
    """Install every stand-in, once per process, where CUDA is absent; returns what is installed."""
    if not _installed and needed():
        for stand_in in STAND_INS:
            stand_in.install()
            _installed.append(stand_in)
    return list(_installed)


def engine_kwargs(kwargs: dict) -> dict:
    """The engine actor's vLLM arguments with ENGINE_SWITCHES applied where CUDA is absent."""
    if not needed():
        return kwargs
    return {**kwargs, **{name: value for name, value, _ in ENGINE_SWITCHES}}


def summary() -> str:
    """One line: every stand-in and switch, for the run's log."""
    answers = "; ".join(stand_in.line() for stand_in in STAND_INS)
    switches = "; ".join(f"{name}={value} ({why})" for name, value, why in ENGINE_SWITCHES)
    return f"no CUDA: CPU stand-ins in every process: {answers}. vLLM engines: {switches}"
