"""vLLM worker extension: the engine side of a weight sync, run inside each vLLM worker.

Covers:
- a reload session across buckets: `begin_weight_sync` puts the model into vLLM's layerwise reload
  (vLLM-CPU and quantized layers repack weights after loading, so a plain `model.load_weights` into
  a live engine fails or skips post-processing; the reload buffers each layer's tensors and re-runs
  its post-load processing once the whole layer has arrived), each bucket is loaded as it comes,
  `finish_weight_sync` finalizes and reports;
- receiving a bucket from a /dev/shm file or a CUDA IPC handle (transport.py),
  casting to the engine dtype when the sender's differs;
- errors instead of silent skips: a name the model does not know raises (vLLM's loader), and a layer
  that received only part of its tensors (a fused group split, a bucket lost) fails the sync;
- `load_weights_in_place`: the single-call form of the above, for tests and verify_sync.py.
Does not cover: cache resets. Those must go through the engine (scheduler-aware) rather than the
worker: resetting only the worker's encoder cache makes the next image request fail with
"Encoder cache miss". See sync.py.

Engines load this class by import name (`worker_extension_cls`), which also reaches vLLM's
engine-core process under V1 multiprocessing: that process is not a Ray worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_lora_sync.bucket import TensorMeta, unpack

WORKER_EXTENSION_CLS = f"{__name__}.LoraSyncWorkerExtension"


class WeightSyncError(RuntimeError):
    """A sync left the engine in a state that does not match what the trainer sent."""


class LoraSyncWorkerExtension(WorkerWrap):
    def begin_weight_sync(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_lora_sync_open", False):
            raise WeightSyncError(
                "begin_weight_sync called while a sync is still open (a previous sync failed?)"
            )
        initialize_layerwise_reload(self.model_runner.get_model())
        self._lora_sync_open = True
        self._lora_sync_tensors = 0
        self._lora_sync_loaded: set[str] = set()

    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        if not getattr(self, "_lora_sync_open", False):
            raise WeightSyncError("bucket received outside begin_weight_sync/finish_weight_sync")
        dtype = self.model_config.dtype
        named = [(name, tensor if tensor.dtype == dtype else tensor.to(dtype)) for name, tensor in named]
        loaded = self.model_runner.get_model().load_weights(iter(named))
        self._lora_sync_tensors += len(named)
        self._lora_sync_loaded.update(loaded or ())
        return len(named)

    def load_bucket_from_file(self, path: str, total: int, metas: list[TensorMeta]) -> int:
        from openrlhf_lora_sync.transport import read_shm_bucket

        return self._load(unpack(read_shm_bucket(path, total), metas))

    def load_bucket_cuda_ipc(self, handles: dict, metas: list[TensorMeta]) -> int:
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        from openrlhf_lora_sync.transport import open_cuda_ipc_bucket

        buffer = open_cuda_ipc_bucket(handles[get_physical_gpu_id()], self.device.index)
        count = self._load(unpack(buffer, metas))
        torch.cuda.synchronize()
        return count

    def finish_weight_sync(self, expect_every_layer: bool = False) -> dict:
        """Finalize the reload and report what was loaded. Raises when a layer got only part of its
        tensors, or (full syncs: expect_every_layer) when a layer with parameters got none."""
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        partial, missing = [], []
        for name, layer in model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or not info.load_numel_total:
                continue  # processed already, or nothing to load
            # A fused layer short of elements got only some of its members. (Other layers may be short
            # legitimately: vLLM pads e.g. vocabularies, and processes those at finalize.)
            if info.load_numel > 0 and isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
                partial.append(f"{name} ({info.load_numel}/{info.load_numel_total} elements)")
            elif expect_every_layer and any(True for _ in layer.parameters(recurse=False)):
                missing.append(name)
        finalize_layerwise_reload(model, self.model_config)
        self._lora_sync_open = False
        if partial or missing:
            raise WeightSyncError(
                "the engine now holds mixed weights: "
                + (
                    f"layers received only part of their tensors (a fused group split, or a bucket lost): "
                    f"{', '.join(partial[:8])}. "
                    if partial
                    else ""
                )
                + (
                    f"layers received nothing in a full sync (a bucket lost?): {', '.join(missing[:8])}"
                    if missing
                    else ""
                )
            )
        return {"tensors": self._lora_sync_tensors, "params": sorted(self._lora_sync_loaded)}

    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load HF-named tensors in one reload; return the engine parameter names they filled."""
        self.begin_weight_sync()
        try:
            self._load(weights)
        finally:
            report = self.finish_weight_sync()
        return report["params"]

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """The engine model's fused modules (vLLM name -> HF member names), for delta-sync expansion."""
        model = self.model_runner.get_model()
        return {key: list(members) for key, members in getattr(model, "packed_modules_mapping", {}).items()}
