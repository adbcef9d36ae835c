"""Weight-sync benchmark: each way of bringing a vLLM engine to the policy, against the engine's own floor.

`python scripts/bench_sync.py [--quick]` builds a random Qwen2.5-VL-shaped checkpoint at the "bench" scale
of tiny_models.py (about 320M parameters, 345 tensors; or --model-dir DIR), puts LoRA r=64 on every
language-model linear of a bf16 policy (fp32 adapters, as OpenRLHF trains it), starts a bf16 vLLM engine
with V1 multiprocessing (the engine core in its own process, as in OpenRLHF's engine actors, so every RPC
crosses a process) and times, as medians of several repeats:
- floor: the engine reloading every weight it already holds in its own memory: vLLM's layerwise in-place
  reload alone, timed inside the worker (worker_extension.time_reload_from_file);
- full: this repo's merge-then-sync (sync.sync_weights, forced full: merge, bucket, /dev/shm, reload);
- delta_all / delta_qv: the delta syncs that follow a full one, with LoRA on all linears / on q and v;
- per_tensor: OpenRLHF 0.11's shape: the same merged tensors, one tensor per RPC (each its own /dev/shm
  file, all in one reload session; OpenRLHF itself sends one CUDA-IPC handle per parameter);
- adapter: adapter_mode.sync_adapter into a LoRA-enabled engine (the base stays, the adapter is swapped);
then generation throughput of the merged engine and of the LoRA engine with the adapter's request.
After each row the engine's prompt logprobs are compared with HF's merge_and_unload of the policy (and,
first, the unsynced engine is shown to differ): a row whose engine ends with wrong weights stops the run.
Prints a table and where the full sync's time goes (merge: no ZeRO-3 here, so no gather; pack;
transport; reload) on stderr, with the logs, and one JSON line alone on stdout (`| jq` reads it).
Bytes are what crosses to the engine; RPCs are engine calls per sync.
Does not cover: GPUs, ZeRO-3 gathering across ranks, several engines.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Throughput prompts: as many as the engine schedules at once (logprob_check.start_engine's max_num_seqs).
GENERATION_PROMPTS = 4
PROMPT_TOKENS = 64
ROWS = ("floor", "full", "delta_all", "delta_qv", "per_tensor", "adapter")
STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"[bench_sync +{time.perf_counter() - STARTED:.0f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    from openrlhf_lora_sync.sync.sync import DEFAULT_BUCKET_BYTES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats and shorter generations (< 10 min)")
    parser.add_argument("--repeats", type=int, help="timed repeats per row (default 3 quick, 5 otherwise)")
    parser.add_argument("--model-dir", help="an existing checkpoint instead of building the bench model")
    parser.add_argument("--family", default="qwen2_5_vl", help="tiny_models family to build")
    parser.add_argument("--scale", default="bench", help="tiny_models scale to build")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank")
    parser.add_argument("--lora-alpha", type=int, help="LoRA alpha (default 2 x rank)")
    parser.add_argument("--gen-tokens", type=int, help="tokens generated per prompt (default 16 quick, 64)")
    parser.add_argument(
        "--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help="sync bucket size"
    )
    parser.add_argument("--skip-adapter", action="store_true", help="no adapter row or LoRA engine")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.gen_tokens = args.gen_tokens or (16 if args.quick else 64)
    args.gen_rounds = 1 if args.quick else 3
    args.lora_alpha = args.lora_alpha or 2 * args.rank
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


class CountingEngines:
    """sync.LocalEngines that counts the engine calls a sync makes."""

    def __init__(self, llm) -> None:
        from openrlhf_lora_sync.sync.sync import LocalEngines

        self.local = LocalEngines(llm)
        self.rpcs = 0

    def rpc(self, method: str, *args) -> list:
        self.rpcs += 1
        return self.local.rpc(method, *args)

    def rpc_each(self, method: str, per_engine_args: list[tuple]) -> list:
        self.rpcs += 1
        return self.local.rpc_each(method, per_engine_args)

    def __len__(self) -> int:
        return len(self.local)

    def reset_caches(self) -> None:
        self.local.reset_caches()


class Reference:
    """HF's merge_and_unload of a policy: the prompt logprobs a correctly synced engine computes."""

    def __init__(self, policy, token_ids: list[int]) -> None:
        from openrlhf_lora_sync.testing.logprob_check import hf_prompt_logprobs

        # Forward in fp32: what is left is the engine's own bf16 error, not HF's on top of it.
        merged = copy.deepcopy(policy).merge_and_unload().float().eval()
        self.logprobs = hf_prompt_logprobs(merged, token_ids)
        self.token_ids = token_ids
        del merged
        gc.collect()

    def diff(self, llm, lora_request=None) -> float:
        from openrlhf_lora_sync.testing.logprob_check import max_abs_diff, vllm_prompt_logprobs

        return max_abs_diff(
            vllm_prompt_logprobs(llm, self.token_ids, lora_request=lora_request), self.logprobs
        )


def check(row: str, diff: float, tolerance: float) -> None:
    if not diff <= tolerance:
        raise SystemExit(
            f"{row}: the engine does not compute the policy after the sync (max abs logprob diff "
            f"{diff:.3g} > {tolerance}); its timing would be meaningless"
        )


def time_floor(engines: CountingEngines, model_dir: str, dtype: torch.dtype, repeats: int) -> dict:
    """The checkpoint's tensors in one /dev/shm bucket, copied into the worker, reloaded `repeats` times."""
    from safetensors.torch import load_file

    from openrlhf_lora_sync.sync.bucket import layout, pack_into
    from openrlhf_lora_sync.sync.transport import SHM_DIR

    named = [
        (name, tensor.to(dtype))
        for path in sorted(Path(model_dir).glob("*.safetensors"))
        for name, tensor in load_file(str(path)).items()
    ]
    metas, total = layout(named)
    path = os.path.join(SHM_DIR, f"bench-sync-floor-{os.getpid()}.bin")
    try:
        buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        pack_into(buffer, named, metas)
        del buffer, named
        (seconds,) = engines.rpc("time_reload_from_file", path, total, [tuple(m) for m in metas], repeats)
    finally:
        os.unlink(path)
    return {"seconds": seconds, "bytes": sum(m.nbytes for m in metas), "rpcs": 0, "tensors": len(metas)}


def time_syncs(sync, repeats: int, between=None) -> dict:
    """Run `sync()` (-> SyncStats) `repeats` times; `between(i)` before each (not timed)."""
    runs = []
    for i in range(repeats):
        if between:
            between(i)
        start = time.perf_counter()
        stats = sync()
        runs.append((time.perf_counter() - start, stats))
    return {
        "seconds": [s for s, _ in runs],
        "bytes": runs[-1][1].bytes,
        "tensors": runs[-1][1].tensors,
        "stages": {k: statistics.median(st.stages[k] for _, st in runs) for k in runs[-1][1].stages},
    }


def per_tensor_sync(policy, engines: CountingEngines, dtype: torch.dtype):
    """OpenRLHF 0.11's shape of a sync: every merged tensor in its own RPC (this repo's merge and worker)."""
    from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units
    from openrlhf_lora_sync.sync.sync import SyncStats
    from openrlhf_lora_sync.sync.transport import send_via_shm

    start = time.perf_counter()
    tensors = nbytes = 0
    engines.rpc("begin_weight_sync")
    for _, merged in iter_effective_checkpoint_tensors(policy, sync_units(policy), dtype):
        for name, tensor in merged.items():
            nbytes += send_via_shm(engines.rpc, [(name, tensor)])[0]
            tensors += 1
    engines.rpc("finish_weight_sync", True)
    engines.reset_caches()
    return SyncStats("full", "per tensor", tensors, nbytes, tensors, time.perf_counter() - start)


def tokens_per_second(llm, gen_tokens: int, rounds: int, lora_request=None) -> float:
    """Greedy generation of gen_tokens for GENERATION_PROMPTS random prompts; best of `rounds` after a
    warm-up (the machine is shared: the best round is the least disturbed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE

    generator = torch.Generator().manual_seed(7)
    prompts = [
        TokensPrompt(
            prompt_token_ids=torch.randint(0, BYTE_VOCAB_SIZE, (PROMPT_TOKENS,), generator=generator).tolist()
        )
        for _ in range(GENERATION_PROMPTS)
    ]
    params = SamplingParams(
        max_tokens=gen_tokens, min_tokens=gen_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    llm.generate(
        prompts[:1], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False, lora_request=lora_request
    )
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        best = max(best, generated / (time.perf_counter() - start))
    return best


def keep_off_engine_cpus() -> None:
    """Run this process (the trainer) on the CPUs vLLM's CPU workers are not bound to. vLLM binds each
    worker to its own cores and leaves the rest to the frontend process, which here is also the trainer;
    a trainer spreading its threads over the workers' cores would fight the engine's reload for them,
    which no GPU deployment does (trainer and engine compute on their own devices)."""
    import psutil

    workers = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::Worker")]
    free = set(os.sched_getaffinity(0)) - {cpu for worker in workers for cpu in worker.cpu_affinity()}
    if workers and free:
        os.sched_setaffinity(0, free)
        torch.set_num_threads(len(free))
    progress(f"trainer on CPUs {sorted(os.sched_getaffinity(0))}, {torch.get_num_threads()} threads")


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run(args: argparse.Namespace) -> dict:
    from openrlhf_lora_sync.sync.plan import SyncState
    from openrlhf_lora_sync.sync.probe import PROBE_THRESHOLD
    from openrlhf_lora_sync.sync.sync import sync_weights
    from openrlhf_lora_sync.testing.logprob_check import checkpoint_processor, start_checkpoint_engine
    from openrlhf_lora_sync.testing.policies import (
        ATTENTION_AND_MLP_LINEARS,
        QV_ONLY,
        lora_policy,
        nudge_adapters,
    )
    from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE, build_tiny_model

    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-sync-")
        model_dir = str(build_tiny_model(args.family, tmp.name, scale=args.scale))
        progress(f"built {args.family} at scale {args.scale} in {model_dir}")
    # The post-sync probe's bf16 threshold (probe.py), not the tests' tiny-model tolerance (0.05): a correct
    # sync of the 20-layer bench model measured 0.04 against the fp32 reference (0.059 against HF in bf16);
    # tests/tools/test_bench_sync.py's tiny model with r=64, alpha 512, over 10 adapter seeds: 0.009 / 0.018 /
    # 0.051 (min / median / max) merged, 0.010 / 0.024 / 0.053 in adapter mode, the same bit for bit with 1
    # or 2 threads on either side; broken syncs measured 0.24 and up (probe.py), the unsynced tiny engine
    # 0.93.
    dtype, tolerance = torch.bfloat16, PROBE_THRESHOLD["bfloat16"]
    bucket = int(args.bucket_mb * 2**20)
    token_ids = torch.randint(0, BYTE_VOCAB_SIZE, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    rows: dict[str, dict] = {}
    diffs: dict[str, float] = {}

    def verify(row: str, diff: float) -> None:
        diffs[row] = diff
        check(row, diff, tolerance)

    # A bf16 policy with fp32 adapters, as OpenRLHF trains it.
    lora = {"dtype": "bfloat16", "r": args.rank, "lora_alpha": args.lora_alpha}
    policy = lora_policy(model_dir, ATTENTION_AND_MLP_LINEARS, seed=0, **lora)
    reference = Reference(policy, token_ids)
    llm = start_checkpoint_engine(model_dir, "bfloat16", checkpoint_processor(model_dir), multiprocess=True)
    progress("engine started")
    keep_off_engine_cpus()
    engines = CountingEngines(llm)
    # The negative control: the engine still on the base checkpoint must fail the check by a wide margin.
    diffs["unsynced"] = reference.diff(llm)
    if not diffs["unsynced"] > 5 * tolerance:
        raise SystemExit(
            f"the unsynced engine already matches the policy ({diffs['unsynced']:.3g}): "
            "the LoRA delta is too small for the checks to mean anything"
        )

    rows["floor"] = time_floor(engines, model_dir, dtype, args.repeats)
    progress(f"floor: {rows['floor']['seconds']}")

    def full_sync():
        return sync_weights(policy, engines, SyncState(), dtype=dtype, force_full=True, bucket_bytes=bucket)

    full_sync()  # warm-up, untimed: the process's first sync pays first-touch costs a training run pays once
    rows["full"] = counted(engines, lambda: time_syncs(full_sync, args.repeats))
    verify("full", reference.diff(llm))

    state = SyncState()
    sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=bucket)  # the full sync the deltas follow

    def delta_sync():
        return sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=bucket)

    rows["delta_all"] = counted(
        engines,
        lambda: time_syncs(delta_sync, args.repeats, between=lambda i: nudge_adapters(policy, 100 + i)),
    )
    reference = Reference(policy, token_ids)
    verify("delta_all", reference.diff(llm))

    nudge_adapters(policy, 200)
    reference = Reference(policy, token_ids)
    rows["per_tensor"] = counted(
        engines, lambda: time_syncs(lambda: per_tensor_sync(policy, engines, dtype), args.repeats)
    )
    verify("per_tensor", reference.diff(llm))

    qv_policy = lora_policy(model_dir, QV_ONLY, seed=1, **lora)
    qv_state = SyncState()
    sync_weights(qv_policy, engines, qv_state, dtype=dtype, bucket_bytes=bucket)

    def qv_delta_sync():
        return sync_weights(qv_policy, engines, qv_state, dtype=dtype, bucket_bytes=bucket)

    rows["delta_qv"] = counted(
        engines,
        lambda: time_syncs(qv_delta_sync, args.repeats, between=lambda i: nudge_adapters(qv_policy, 300 + i)),
    )
    verify("delta_qv", Reference(qv_policy, token_ids).diff(llm))

    throughput = {
        "merged_tokens_per_s": tokens_per_second(llm, args.gen_tokens, args.gen_rounds),
        "adapter_tokens_per_s": None,
    }
    stop_engine(llm)
    progress(f"merged generation: {throughput['merged_tokens_per_s']:.2f} tokens/s")

    adapter_skipped = "--skip-adapter" if args.skip_adapter else None
    if not args.skip_adapter:
        rows["adapter"], adapter_diff, throughput["adapter_tokens_per_s"] = adapter_row(
            args, model_dir, policy, reference, dtype
        )
        verify("adapter", adapter_diff)
    if tmp:
        tmp.cleanup()
    return {**summarize(args, rows, diffs, throughput, adapter_skipped), "logprob_tolerance": tolerance}


def counted(engines: CountingEngines, measure) -> dict:
    before = engines.rpcs
    row = measure()
    row["rpcs"] = (engines.rpcs - before) // len(row["seconds"])
    progress(f"row done: {statistics.median(row['seconds']):.3f} s median of {row['seconds']}")
    return row


def adapter_row(args, model_dir: str, policy, reference: Reference, dtype: torch.dtype):
    """Adapter hot-swap into a LoRA-enabled engine: timed syncs, correctness, generation throughput."""
    from openrlhf_lora_sync.sync.adapter_mode import AdapterSyncState, sync_adapter
    from openrlhf_lora_sync.testing.logprob_check import checkpoint_processor, start_checkpoint_engine

    processor = checkpoint_processor(model_dir)
    llm = start_checkpoint_engine(model_dir, "bfloat16", processor, multiprocess=True, lora_rank=args.rank)
    engines = CountingEngines(llm)
    state = AdapterSyncState()
    row = counted(
        engines, lambda: time_syncs(lambda: sync_adapter(policy, engines, state, dtype=dtype), args.repeats)
    )
    diff = reference.diff(llm, lora_request=state.lora_request())
    throughput = tokens_per_second(llm, args.gen_tokens, args.gen_rounds, lora_request=state.lora_request())
    stop_engine(llm)
    return row, diff, throughput


def summarize(args, rows, diffs, throughput, adapter_skipped) -> dict:
    floor = statistics.median(rows["floor"]["seconds"])
    result = {
        "model": args.model_dir or f"{args.family} scale={args.scale}",
        "tensors": rows["floor"]["tensors"],
        "lora_rank": args.rank,
        "repeats": args.repeats,
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU"
        if not torch.cuda.is_available()
        else f"{os.cpu_count()} CPU cores, {torch.cuda.get_device_name()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        # Other work on the machine skews every row; the 1-minute load average at the end shows how much.
        "load_average_1m": os.getloadavg()[0],
    }
    for name in ROWS:
        row = rows.get(name)
        result[f"{name}_s"] = statistics.median(row["seconds"]) if row else None
        result[f"{name}_bytes"] = row["bytes"] if row else None
        result[f"{name}_rpcs"] = row["rpcs"] if row else None
        result[f"{name}_ratio_to_floor"] = statistics.median(row["seconds"]) / floor if row else None
    result["adapter_skipped"] = adapter_skipped
    result["full_stages_s"] = rows["full"]["stages"]
    result["per_tensor_over_full"] = result["per_tensor_s"] / result["full_s"]
    result["max_abs_logprob_diff"] = diffs
    result.update(throughput)
    return result


def print_table(result: dict) -> None:
    print(
        f"\n{result['model']}: {result['tensors']} tensors, LoRA r={result['lora_rank']}, "
        f"median of {result['repeats']}, {result['machine']}, {result['date']}"
    )
    print(f"{'row':<11} {'seconds':>8} {'MiB':>8} {'RPCs':>5} {'x floor':>8} {'logprob diff':>13}")
    for name in ROWS:
        seconds = result[f"{name}_s"]
        if seconds is None:
            print(f"{name:<11} skipped ({result['adapter_skipped']})")
            continue
        diff = result["max_abs_logprob_diff"].get(name)
        print(
            f"{name:<11} {seconds:8.3f} {result[f'{name}_bytes'] / 2**20:8.1f} {result[f'{name}_rpcs']:5d} "
            f"{result[f'{name}_ratio_to_floor']:8.2f} {'' if diff is None else f'{diff:13.2e}'}"
        )
    stages = ", ".join(f"{k} {v:.3f}" for k, v in result["full_stages_s"].items())
    print(f"full sync, where time goes (s, median): {stages}")
    print(
        f"per-tensor / full: {result['per_tensor_over_full']:.1f}x; unsynced engine logprob diff "
        f"{result['max_abs_logprob_diff']['unsynced']:.2f}"
    )
    adapter_tps = result["adapter_tokens_per_s"]
    print(
        f"generation, {GENERATION_PROMPTS} prompts: merged {result['merged_tokens_per_s']:.1f} tokens/s, "
        f"adapter {'-' if adapter_tps is None else f'{adapter_tps:.1f}'} tokens/s"
    )


def main(argv=None) -> None:
    from openrlhf_lora_sync.tools.result_line import emit, result_stdout

    args = parse_args(argv)
    with result_stdout() as stdout:  # the JSON line alone on stdout; the table and the logs on stderr
        result = run(args)
        print_table(result)
        emit(stdout, result)


if __name__ == "__main__":
    main()
