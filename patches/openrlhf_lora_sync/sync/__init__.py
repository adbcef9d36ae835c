"""The LoRA-aware weight sync, trainer to vLLM engines: what OpenRLHF's `broadcast_to_vllm` becomes.

- merge: the policy split into sync units, their effective weights (LoRA merged out of place) under the
  checkpoint's names; the adapters merge-then-sync refuses.
- plan: what a sync sends, full or delta. bucket: tensors packed into flat buffers.
- transport: moving a bucket to the engines (shm, CUDA IPC, broadcast).
- sync: one sync, plan -> merge -> bucket -> send -> reload, and its statistics.
- worker_extension: the engine side, inside each vLLM worker (vLLM loads it by import name).
- probe: the post-sync log-prob probe. adapter_mode: the adapter hot-swap sync mode.

Imports: `base` only (settings, upstream), never `config`, `patch`, `testing` or `tools`: the OpenRLHF
patch drives the sync through its `Engines` interface, and the checks before a run ask it what it refuses.
"""
