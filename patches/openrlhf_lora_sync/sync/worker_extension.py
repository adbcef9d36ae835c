"""vLLM worker extension: the engine side of a weight sync, run inside each vLLM worker.

Covers:
- a reload session across buckets: `begin_weight_sync` puts the model into vLLM's layerwise reload
  (vLLM-CPU and quantized layers repack weights after loading, so a plain `model.load_weights` into
  a live engine fails or skips post-processing; the reload buffers each layer's tensors and re-runs
  its post-load processing once the whole layer has arrived), each bucket is loaded as it comes,
  `finish_weight_sync` finalizes and reports;
- receiving a bucket from a /dev/shm file, a CUDA IPC handle or a broadcast (transport.py),
  casting to the engine dtype when the sender's differs;
- errors instead of silent skips: a name the model does not know raises (vLLM's loader), a received
  tensor that vLLM's loader skipped without reading it (a `.bias` the layer lacks, rotary `inv_freq`)
  fails the sync, and so does a layer that received only part of its tensors (a fused group split, a
  bucket lost);
- quiet reloads: vLLM's reload warns "Failed to load weights" for every layer that received nothing,
  which a delta sync does on purpose for every layer LoRA leaves alone (and every sync for layers holding
  only buffers, e.g. rotary caches); those warnings are dropped, one per such layer, while a full sync
  that misses a layer with parameters still raises (and vLLM's warning for it still shows);
- `load_weights_in_place`: the single-call form of the above, for tests and verify_sync.py;
- `time_reload_from_file`: the benchmark's floor (scripts/bench_sync.py): the same in-place reload of a
  bucket the worker first copies into its own memory, timed inside the worker, so it counts neither
  the trainer's merge nor the transport. `finish_weight_sync` also reports the seconds spent loading;
- adapter sync mode (adapter_mode.py): `install_lora_adapter` (and `_broadcast`) builds vLLM's
  LoRAModel from a bucket of peft-named LoRA tensors and makes it the engine's only adapter, refusing
  modules vLLM has no LoRA layer for; `lora_adapter_ids` says what the engine holds.
Does not cover: cache resets. Those must go through the engine (scheduler-aware) rather than the
worker: resetting only the worker's encoder cache makes the next image request fail with
"Encoder cache miss". See sync.py.

Engines load this class by import name (`worker_extension_cls`), which also reaches vLLM's
engine-core process under V1 multiprocessing: that process is not a Ray worker.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from openrlhf_lora_sync.sync.bucket import TensorMeta, unpack
from openrlhf_lora_sync.sync.upstream_versions import (
    backport_lora_layer_loading,
    is_deferred_attention_layer,
    lora_weights_mapper,
)

WORKER_EXTENSION_CLS = f"{__name__}.LoraSyncWorkerExtension"


class WeightSyncError(RuntimeError):
    """A sync left the engine in a state that does not match what the trainer sent."""


class _ReadTracker(TorchDispatchMode):
    """Which received tensors no torch op read while vLLM loaded them.

    vLLM's loaders skip some names without a word (a `.bias` the layer does not have, rotary
    `inv_freq`, a tied `lm_head`): such a tensor reaches no weight loader, so no op ever reads its bytes.
    A tensor counts as read when any op takes it or a view of it (narrowed shards, transposes) as input;
    views share the received tensor's memory, so reads are matched by address range."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        spans = sorted(
            (tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), name)
            for name, tensor in named
            if tensor.numel()
        )
        self._starts = [start for start, _, _ in spans]
        self._spans = spans
        self._read = [False] * len(spans)

    def _mark(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or not tensor.numel():
            return
        address = tensor.data_ptr()
        index = bisect.bisect_right(self._starts, address) - 1
        if index >= 0 and address < self._spans[index][1]:
            self._read[index] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor):
                self._mark(leaf)
        return func(*args, **(kwargs or {}))

    def unread(self) -> list[str]:
        return [name for (_, _, name), read in zip(self._spans, self._read, strict=True) if not read]


# vLLM 0.29's finalize_layerwise_processing (model_loader/reload/layerwise.py) logs this, with the layer's
# class name, for each layer a reload left without weights.
_UNLOADED_LAYER_WARNING = "%s: Failed to load weights"


class _ExpectedUnloadedLayers(logging.Filter):
    """Drops vLLM's "Failed to load weights" warning once per layer this sync left alone on purpose.
    vLLM's record names only the layer's class, so the allowance is counted per class name: a layer
    beyond it (one the sync really missed) still gets its warning."""

    def __init__(self, class_names: Iterable[str]) -> None:
        super().__init__()
        self._allowance = Counter(class_names)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _UNLOADED_LAYER_WARNING or not record.args:
            return True
        class_name = record.args[0]
        if self._allowance[class_name] <= 0:
            return True
        self._allowance[class_name] -= 1
        return False


@contextlib.contextmanager
def _expected_unloaded_layers(layers: list[torch.nn.Module]) -> Iterator[None]:
    """vLLM's reload does not warn about `layers` while this is open."""
    from vllm.model_executor.model_loader.reload import layerwise

    reload_logger = logging.getLogger(layerwise.__name__)
    quiet = _ExpectedUnloadedLayers(type(layer).__name__ for layer in layers)
    reload_logger.addFilter(quiet)
    try:
        yield
    finally:
        reload_logger.removeFilter(quiet)


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
        self._lora_sync_load_seconds = 0.0
        self._lora_sync_loaded: set[str] = set()
        self._lora_sync_unread: list[str] = []

    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        if not getattr(self, "_lora_sync_open", False):
            raise WeightSyncError("bucket received outside begin_weight_sync/finish_weight_sync")
        backport_lora_layer_loading()  # vLLM 0.27: base weights into LoRA-wrapped layers (adapter mode)
        start = time.perf_counter()
        dtype = self.model_config.dtype
        named = [(name, tensor if tensor.dtype == dtype else tensor.to(dtype)) for name, tensor in named]
        with _ReadTracker(named) as reads:
            loaded = self.model_runner.get_model().load_weights(iter(named))
        self._lora_sync_unread.extend(reads.unread())
        self._lora_sync_tensors += len(named)
        self._lora_sync_loaded.update(loaded or ())
        self._lora_sync_load_seconds += time.perf_counter() - start
        return len(named)

    def load_bucket_from_file(self, path: str, total: int, metas: list[TensorMeta]) -> dict:
        """Load a /dev/shm bucket; `holds_file` says whether vLLM still buffers views into the file
        afterwards (layers it processes only at finalize), so the sender must not overwrite it."""
        from openrlhf_lora_sync.sync.transport import read_shm_bucket

        buffer = read_shm_bucket(path, total)
        count = self._load(unpack(buffer, metas))
        return {"tensors": count, "holds_file": self._reload_buffers_storage(buffer)}

    def _reload_buffers_storage(self, buffer: torch.Tensor) -> bool:
        """Whether a tensor vLLM's layerwise reload buffers for a layer not processed yet lives in `buffer`.
        (An unknown shape of vLLM's buffering counts as yes: overwriting a held view corrupts silently.)"""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        storage = buffer.untyped_storage().data_ptr()
        for layer in self.model_runner.get_model().modules():
            pending = get_layerwise_info(layer).loaded_weights
            for _, bound in pending:
                arguments = getattr(bound, "arguments", None)
                if arguments is None:
                    return True
                if any(
                    isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage
                    for value in arguments.values()
                ):
                    return True
        return False

    def load_bucket_cuda_ipc(self, handles: dict, metas: list[TensorMeta]) -> int:
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        from openrlhf_lora_sync.sync.transport import open_cuda_ipc_bucket

        buffer = open_cuda_ipc_bucket(handles[get_physical_gpu_id()], self.device.index)
        count = self._load(unpack(buffer, metas))
        torch.cuda.synchronize()
        return count

    def join_broadcast_group(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str
    ) -> None:
        """Join the trainer's broadcast group (transport.BroadcastTransport) as rank_offset + this worker's
        rank in its engine."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        rank = rank_offset + torch.distributed.get_rank()
        self._lora_sync_group = stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, backend
        )
        self._lora_sync_group_device = self.device if backend == "nccl" else torch.device("cpu")

    def _receive_broadcast(self, total: int) -> torch.Tensor:
        buffer = torch.empty(total, dtype=torch.uint8, device=self._lora_sync_group_device)
        self._lora_sync_group.broadcast(buffer, root=0).wait()
        return buffer

    def load_bucket_broadcast(self, total: int, metas: list[TensorMeta]) -> int:
        return self._load(unpack(self._receive_broadcast(total), metas))

    def finish_weight_sync(self, expect_every_layer: bool = False) -> dict:
        """Finalize the reload and report what was loaded. Raises when a layer got only part of its
        tensors, or (full syncs: expect_every_layer) when a layer with parameters got none."""
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        partial, missing, left_alone = [], [], []
        for name, layer in model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or not info.load_numel_total:
                continue  # processed already, or nothing to load
            # A fused layer short of elements got only some of its members. (Other layers may be short
            # legitimately: vLLM pads e.g. vocabularies, and processes those at finalize.)
            if info.load_numel > 0 and isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
                partial.append(f"{name} ({info.load_numel}/{info.load_numel_total} elements)")
            elif info.load_numel == 0:
                if expect_every_layer and any(True for _ in layer.parameters(recurse=False)):
                    missing.append(name)
                elif not is_deferred_attention_layer(layer):  # (vLLM never warns about those)
                    left_alone.append(layer)
        with _expected_unloaded_layers(left_alone):
            finalize_layerwise_reload(model, self.model_config)
        self._lora_sync_open = False
        problems = []
        if partial:
            problems.append(
                "layers received only part of their tensors (a fused group split, or a bucket lost): "
                + ", ".join(partial[:8])
            )
        if missing:
            problems.append(
                "layers received nothing in a full sync (a bucket lost?): " + ", ".join(missing[:8])
            )
        if self._lora_sync_unread:
            problems.append(
                f"{len(self._lora_sync_unread)} received tensors were skipped by vLLM's loader (names the "
                "engine model has no parameter for: check the trainer-side names): "
                + ", ".join(self._lora_sync_unread[:8])
            )
        if problems:
            raise WeightSyncError("the engine may now hold mixed weights: " + "; ".join(problems))
        return {
            "tensors": self._lora_sync_tensors,
            "params": sorted(self._lora_sync_loaded),
            "load_seconds": self._lora_sync_load_seconds,
        }

    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load HF-named tensors in one reload; return the engine parameter names they filled."""
        self.begin_weight_sync()
        try:
            self._load(weights)
        finally:
            report = self.finish_weight_sync()
        return report["params"]

    def time_reload_from_file(
        self, path: str, total: int, metas: list[TensorMeta], repeats: int
    ) -> list[float]:
        """Copy a bucket (every weight of the model) into this process's memory, then reload it in place
        `repeats` times as one full sync; the seconds of each reload (begin, load, finish)."""
        from openrlhf_lora_sync.sync.transport import read_shm_bucket

        held = unpack(read_shm_bucket(path, total).clone(), metas)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.begin_weight_sync()
            try:
                self._load(held)
            finally:
                self.finish_weight_sync(expect_every_layer=True)
            seconds.append(time.perf_counter() - start)
        return seconds

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """The engine model's fused modules (vLLM name -> HF member names), for delta-sync expansion."""
        model = self.model_runner.get_model()
        return {key: list(members) for key, members in getattr(model, "packed_modules_mapping", {}).items()}

    # Adapter hot-swap mode (adapter_mode.py): the engine keeps its base weights and applies the policy's
    # adapter through vLLM's own LoRA layers; a sync installs the new adapter instead of merged weights.

    def install_lora_adapter(
        self, path: str, total: int, metas: list[TensorMeta], lora_id: int, peft_config: dict
    ) -> dict:
        """Install the adapter in a /dev/shm bucket (engines on the trainer's node)."""
        from openrlhf_lora_sync.sync.transport import read_shm_bucket

        return self._install_lora(dict(unpack(read_shm_bucket(path, total), metas)), lora_id, peft_config)

    def install_lora_adapter_broadcast(
        self, total: int, metas: list[TensorMeta], lora_id: int, peft_config: dict
    ) -> dict:
        """Install the adapter the trainer broadcasts over the sync group (engines on other nodes)."""
        tensors = dict(unpack(self._receive_broadcast(total).cpu(), metas))
        return self._install_lora(tensors, lora_id, peft_config)

    def _install_lora(self, tensors: dict[str, torch.Tensor], lora_id: int, peft_config: dict) -> dict:
        """Make peft-named LoRA tensors the engine's only adapter, as `lora_id`.

        The adapter is built in memory with vLLM's own LoRAModel.from_lora_tensors (the constructor its
        disk loader uses after reading the files) and registered in the worker's LoRA model manager, so a
        request carrying a LoRARequest with this id finds it loaded and never reads its path. vLLM offers
        no public call taking an in-memory adapter (LLM.add_lora reads lora_path from disk), hence the
        manager's `_adapter_manager`. Raises, instead of vLLM's silent skip, when a tensor names a module
        vLLM did not wrap with LoRA (e.g. the vision tower, which vLLM 0.29 leaves unwrapped by default)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker_manager = getattr(self.model_runner, "lora_manager", None)
        if worker_manager is None:
            raise WeightSyncError(
                "this engine runs without vLLM LoRA; adapter mode needs it started with "
                "adapter_mode.engine_lora_kwargs(...)"
            )
        manager = worker_manager._adapter_manager
        helper = PEFTHelper.from_dict(
            {**peft_config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings}
        )
        helper.validate_legal(worker_manager.lora_config)
        model = manager.model
        lora = LoRAModel.from_lora_tensors(
            lora_id,
            tensors,
            helper,
            device="cpu",
            dtype=worker_manager.lora_config.lora_dtype,
            model_vocab_size=worker_manager.vocab_size,
            weights_mapper=lora_weights_mapper(getattr(model, "hf_to_vllm_mapper", None)),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        wrapped = set(manager.modules) | {name for names in manager.packed_modules.values() for name in names}
        unknown = sorted(set(lora.loras) - wrapped)
        if unknown:
            raise WeightSyncError(
                f"{len(unknown)} adapter modules have no LoRA layer in this engine (vLLM would ignore them): "
                + ", ".join(unknown[:8])
            )
        worker_manager.remove_all_adapters()
        manager.add_adapter(lora)
        return {"lora_id": lora_id, "modules": len(lora.loras)}

    def lora_adapter_ids(self) -> list[int]:
        """Ids of the adapters the engine holds (adapter mode keeps exactly one after a sync)."""
        manager = getattr(self.model_runner, "lora_manager", None)
        return sorted(manager.list_adapters()) if manager is not None else []
