"""vLLM worker extension: what the engine side of a weight sync runs inside each vLLM worker.

Covers: loading named HF-checkpoint tensors into the running model in place through vLLM's layerwise
reload (vLLM-CPU repacks linear weights after loading, so a plain `model.load_weights` into a live
engine fails; the reload re-runs post-load processing), reporting which weights were consumed, and
listing the engine's weights. Fused groups (q/k/v, gate/up) must arrive in the same call.
Does not cover: receiving buckets over a transport, or cache resets (the sync patch adds those).

Engines load it by import name (`worker_extension_cls`), which also reaches vLLM's engine-core process
when V1 multiprocessing is on: that process is not a Ray worker and sees no Ray runtime hooks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

WORKER_EXTENSION_CLS = f"{__name__}.LoraSyncWorkerExtension"


class LoraSyncWorkerExtension(WorkerWrap):
    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load HF-named tensors into the live model; return the engine parameter names they filled."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        dtype = self.model_config.dtype
        initialize_layerwise_reload(model)
        try:
            loaded = model.load_weights((name, tensor.to(dtype)) for name, tensor in weights)
        finally:
            finalize_layerwise_reload(model, self.model_config)
        return sorted(loaded or ())

    def engine_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Engine parameter names (vLLM's, after fusing) and their shapes."""
        return {name: tuple(p.shape) for name, p in self.model_runner.get_model().named_parameters()}
