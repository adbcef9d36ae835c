"""Per-GPU memory budget of a GRPO + LoRA run (OpenRLHF 0.11.2, vLLM, DeepSpeed), from a recipe and a model.

The estimate and the search for a setting that fits; the command line (scripts/memory_budget.py), the
what-if table and the printed breakdown are memory_report.py's.
Hardware: none. Runs in the repo's .venv: torch, transformers and peft are imported when a model is
first built (model_inventory.py: a weightless copy on the meta device, cached per config).

Covers
- The model as model_inventory.py counts it (built from its config on the meta device, no weights): its
  modules by part, their nn.Linear shapes, decoder layers and vLLM stacking, and peft's LoRA parameters.
- RunShape from the one recipe path (shape_from_run: OpenRLHF's parsed args, its defaults filled in,
  and this repo's settings, settings.py's defaults), and peak memory per GPU in three phases, for colocated
  (`--train.colocate_all`) and separate vLLM GPUs: rollout (vLLM generating), train (actor fit) and
  weight sync (first sync, which is always full).

Formulas (bytes; P = all parameters, N = ZeRO world size = trainer GPUs, TP = vLLM tensor parallel,
G = GPU memory, L_P = LoRA parameters, p = parameters of one module)
- base weights: 2P (bf16). 4-bit base (`--ds.load_in_4bit`, bitsandbytes NF4 with double quantization):
  every nn.Linear weight except lm_head at 0.5 + 1/64 + 4/(64*256) bytes, everything else bf16.
- trainer at rest (rollout, sync): base/N under ZeRO-3 (all of it under ZeRO-2; 0 with the trainer base
  offload, `trainer.offload_params`: ZeRO-3 parameter offload, which also offloads the optimizer),
  LoRA bf16 weights 2*L_P/N (0 with that offload), and when DeepSpeed sleep is off (or Adam is not offloaded)
  the LoRA optimizer: Adam fp32 master + m + v = 12*L_P/N plus fp32 gradient partitions 4*L_P/N.
  OpenRLHF's `offload_deepspeed_states` moves optimizer states, gradients and fp32 params to CPU but
  not the bf16 parameters (lp_params stays commented out in 0.11.2), so the base shard stays resident.
- trainer in fit: at rest + optimizer + gradients + the ZeRO-3 working set (two decoder layers
  gathered, current and prefetched, the largest layer of the model, plus the largest single module, the
  embedding or lm_head, gathered for the logits) + activations: tokens = micro_train_batch_size * max_len,
  and per token 2*h*L (one bf16 checkpoint per layer) + 24*h + 16*I (one layer recomputed: its bf16
  inputs, outputs and gradients, roughly 6h + 4I values twice) + 10*V (bf16 logits, OpenRLHF's fp32 copy
  and its gradient). Without gradient checkpointing every layer keeps 24*h + 16*I.
- reference model (`--algo.kl.init_coef` > 0): another ZeRO-3 shard 2P/N resident throughout (0 with
  `--ref.offload`, all of 2P under ZeRO-2, whose eval config is stage 0), and its own process per GPU.
  With LoRA and `sync.reference_from_base` (this repo's default) the reference is the policy with its
  adapters disabled: no second model, no process, 0 bytes.
- vLLM engine, per GPU: weights 2P/TP (vLLM keeps bf16 even under a 4-bit trainer base; replicated
  norms and biases are neglected). Without `--vllm.num_engines` the engines fill the actor GPUs
  (GPUs / TP of them). Awake, it holds gpu_memory_utilization * G in total: weights,
  profiled activations (8192 batched tokens * 2*(4h + 3*I/TP) + 256 sequences * V * 8 for the sampler's
  fp32 logits and probabilities), CUDA graphs (0.5 GiB unless enforce_eager) and the KV cache in the
  rest. KV per token: 2 * attention layers * ceil(kv_heads/TP) * head_dim * 2; Qwen3.5's linear
  layers add a fixed state per sequence: (value_heads/TP) * dk * dv * 4 (fp32 SSM state) +
  (conv_dim/TP) * (kernel - 1) * 2. Asleep (level 1 offloads weights to CPU, level 2 discards them) it
  keeps only its CUDA graphs on the GPU; with sleep off it keeps its whole budget.
- weight sync, first sync (full; every sync at sleep level 2): vLLM weights (woken, KV cache not) +
  trainer at rest + the largest gathered module: 10p for a LoRA-targeted one (bf16 gathered + fp32 base +
  fp32 delta, merged out of place) or 2p for any other one (embed_tokens, lm_head) + one bucket:
  max(bucket size, the largest stacked group of LoRA-targeted tensors, the largest single tensor sent),
  twice on a shared GPU when the transport copies it (shm, broadcast) instead of mapping it (cuda_ipc;
  `auto` is resolved as the patch resolves it, settings.resolved_transport); a separate vLLM GPU holds
  its own received copy.
- every process on a GPU adds 0.5 GiB (CUDA context, NCCL buffers, allocator slack); a phase fits when
  its total stays 0.5 GiB under G (allocator slack).
- host RAM, for the node (Budget.host_parts): vLLM sleep level 1 keeps the weights on CPU (2P per
  engine; level 2 discards them), DeepSpeed sleep or an offloaded optimizer keeps the LoRA optimizer
  (16*L_P), the trainer base offload keeps the base (2P: every rank's pinned shard) and `--ref.offload`
  the reference (2P), and each process needs about 3 GiB of its own.

Does not cover: model families other than the Qwen VL / Qwen3 / Qwen3.5 dense ones the formulas assume
(another transformers model is inventoried, but its KV cache and stacking may differ), vision-tower
activations (images through a frozen tower carry no gradients unless LoRA targets it), ring attention,
sequence packing, MoE models, the MTP head (transformers does not build it; vLLM loads it only for
speculative decoding), the `make_experience` forward passes (smaller than fit), allocator fragmentation
beyond that 0.5 GiB, and displays attached to a GPU. These are estimates of the order of a GiB, not
measurements. Host RAM leaves out the page cache of reading the checkpoint at load time and the memlock
limit for pinned memory; time is not estimated at all (the trainer base offload copies each rank's
shard, 2P/N bytes, host to GPU on every forward and backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.config import config_checks
from openrlhf_lora_sync.config.model_inventory import (
    ModelSpec,
    load_config,
    lora_modules,
    lora_parameters,
    model_spec,
)

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class RunShape:
    """The knobs of a run that move GPU memory. Defaults: the user's 27B command on 4x RTX 4090, with
    OpenRLHF 0.11.2's defaults for what that command leaves out and this repo's (settings.py) for its
    own settings. A recipe's: shape_from_run."""

    gpus: int = 4  # GPUs on the node the run uses
    gpu_mem_gib: float = 24.0
    colocate: bool = True  # --train.colocate_all
    vllm_tp: int = 4
    vllm_engines: int = 1
    # 0: --vllm.enable_sleep off; else sync.vllm_sleep_level (OpenRLHF 0.11.2 itself always sleeps at 1)
    vllm_sleep_level: int = settings.get("sync.vllm_sleep_level").default
    gpu_memory_utilization: float = 0.95
    enforce_eager: bool = False
    zero_stage: int = 3
    ds_sleep: bool = True
    adam_offload: bool = False
    param_offload: bool = False  # trainer.offload_params: ZeRO-3 parameters and optimizer in host memory
    base_4bit: bool = False  # --ds.load_in_4bit
    lora_rank: int = 64
    lora_targets: str | tuple[str, ...] = config_checks.OPENRLHF_DEFAULT_TARGETS
    # "gpu" (--algo.kl.init_coef > 0, upstream), "cpu" (--ref.offload), "base" (the policy with its
    # adapters disabled: sync.reference_from_base with LoRA) or "none" (KL 0)
    reference: str = "gpu"
    micro_train_batch_size: int = 1
    max_len: int = 2048  # prompt + response tokens
    gradient_checkpointing: bool = False  # --actor.gradient_checkpointing_enable
    bucket_mb: int = settings.get("sync.bucket_mb").default
    transport: str = settings.get("sync.transport").default  # one of settings.TRANSPORTS

    @property
    def vllm_gpus(self) -> int:
        return self.vllm_engines * self.vllm_tp

    @property
    def trainer_gpus(self) -> int:
        return self.gpus if self.colocate else self.gpus - self.vllm_gpus


def shape_from_run(run, gpu_mem_gib: float = 24.0) -> RunShape:
    """The settings of a recipe.Run: OpenRLHF's values from its parsed args (its defaults filled in),
    this repo's from run.setting (settings.py's defaults)."""
    a = run.args
    gpus = a.actor.num_nodes * a.actor.num_gpus_per_node
    tp = a.vllm.tensor_parallel_size
    colocate = a.train.colocate_all
    # Without an explicit count the engines fill the actor GPUs, which colocate_all requires anyway.
    engines = a.vllm.num_engines or max(1, gpus // tp)
    if not colocate:
        gpus += engines * tp
    targets = a.ds.lora.target_modules  # OpenRLHF's default "all-linear", else a list (nargs="*")
    reference = "none"
    if a.algo.kl.init_coef > 0:
        reference = "cpu" if a.ref.offload else "gpu"
        if a.ds.lora.rank > 0 and run.setting("sync.reference_from_base"):
            reference = "base"
    return RunShape(
        gpus=gpus,
        gpu_mem_gib=gpu_mem_gib,
        colocate=colocate,
        vllm_tp=tp,
        vllm_engines=engines,
        vllm_sleep_level=run.setting("sync.vllm_sleep_level") if a.vllm.enable_sleep else 0,
        gpu_memory_utilization=a.vllm.gpu_memory_utilization,
        enforce_eager=a.vllm.enforce_eager,
        zero_stage=3 if a.ds.zero_stage == 3 else 2,
        ds_sleep=a.ds.enable_sleep,
        adam_offload=a.ds.adam_offload,
        param_offload=run.setting("trainer.offload_params"),
        base_4bit=a.ds.load_in_4bit,
        lora_rank=a.ds.lora.rank,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        reference=reference,
        micro_train_batch_size=a.train.micro_batch_size,
        max_len=a.data.max_len,
        gradient_checkpointing=a.actor.gradient_checkpointing_enable,
        bucket_mb=run.setting("sync.bucket_mb"),
        transport=run.setting("sync.transport"),
    )


def estimate_run(run, gpu_mem_gib: float = 24.0) -> tuple[ModelSpec, Budget]:
    """The estimate of a recipe.Run's model (a local directory or a hub id in REFERENCE_CONFIGS) under its
    settings. Raises OSError when there is no config, ValueError for a model this cannot count."""
    model = str(run.args.actor.model_name_or_path)
    spec = model_spec(load_config(model))
    return spec, estimate(spec, shape_from_run(run, gpu_mem_gib), model)


PROCESS_OVERHEAD = int(0.5 * GIB)
CUDA_GRAPHS = int(0.5 * GIB)
HEADROOM = GIB // 2
HOST_PER_PROCESS = 3 * GIB
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
VLLM_BATCHED_TOKENS = 8192  # vLLM 0.29's LLM-class defaults on a GPU under 70 GiB
VLLM_MAX_SEQS = 256


@dataclass
class Phase:
    """One phase on its busiest GPU: named components in bytes."""

    name: str
    role: str  # "shared" (colocated), "trainer" or "vllm"
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class Budget:
    model: str
    settings: RunShape
    parameters: dict[str, int]
    lora_parameters: int
    phases: list[Phase]
    kv_sequences: float  # sequences of max_len tokens the KV cache holds at once
    host_parts: dict[str, float]  # host RAM of the whole node, by what holds it
    gpu_bytes: float

    @property
    def host_bytes(self) -> float:
        return sum(self.host_parts.values())

    @property
    def usable(self) -> float:
        return self.gpu_bytes - HEADROOM

    def phase(self, name: str) -> Phase:
        return max((p for p in self.phases if p.name == name), key=lambda p: p.total)

    def fits(self, name: str | None = None) -> bool:
        """Whether one phase (every phase when name is None) fits; rollout also needs room for one
        max_len sequence in the KV cache."""
        names = [name] if name else ["rollout", "train", "sync"]
        if "rollout" in names and self.kv_sequences < 1:
            return False
        return all(self.phase(n).total <= self.usable for n in names)

    def problems(self) -> list[str]:
        """One line per phase that does not fit, with its numbers."""
        lines = []
        for name in ("rollout", "train", "sync"):
            phase = self.phase(name)
            if phase.total > self.usable:
                top = sorted(phase.parts.items(), key=lambda item: -item[1])[:4]
                detail = ", ".join(f"{part} {gib(size)}" for part, size in top)
                lines.append(
                    f"{name}: {gib(phase.total)} GiB per GPU ({phase.role}) > {gib(self.usable)} GiB usable "
                    f"of {gib(self.gpu_bytes)} ({detail})"
                )
        if self.kv_sequences < 1:
            lines.append(
                f"rollout: vLLM's budget ({self.settings.gpu_memory_utilization} x {gib(self.gpu_bytes)} GiB)"
                f" leaves no room for the KV cache of one {self.settings.max_len}-token sequence"
            )
        return lines


def gib(size: float) -> str:
    return f"{size / GIB:.1f}"


def verdict(budget: Budget) -> str:
    """ "fits", or "does not fit: <phase> X > Y GiB, ...": the end of the recipe header's memory line."""
    failing = [name for name in ("rollout", "train", "sync") if not budget.fits(name)]
    if not failing:
        return "fits"
    usable = gib(budget.usable)
    over = [f"{name} {gib(budget.phase(name).total)} > {usable} GiB" for name in failing]
    if "rollout" in failing and budget.phase("rollout").total <= budget.usable:
        over[failing.index("rollout")] = "rollout: no KV cache room for one sequence"
    return "does not fit: " + ", ".join(over)


def headline(budget: Budget) -> str:
    """The recipe header's memory line (after its prefix): each phase's peak GiB per GPU, the usable GiB,
    host RAM per node, the verdict."""
    phases = {"rollout": "rollout", "train": "train", "sync": "sync", "delta sync": "sync_delta"}
    peaks = ", ".join(f"{label} {gib(budget.phase(name).total)}" for label, name in phases.items())
    return (
        f"{peaks} of {gib(budget.usable)} usable; host RAM {gib(budget.host_bytes)} GiB per node; "
        + verdict(budget)
    )


def _base_bytes(spec: ModelSpec, quantized: bool) -> float:
    if not quantized:
        return 2.0 * spec.total_parameters
    linear_weights = sum(
        module.linear[0] * module.linear[1]
        for module in spec.modules
        if module.linear is not None and module.part != "lm_head"
    )
    return 2.0 * (spec.total_parameters - linear_weights) + NF4_BYTES_PER_PARAM * linear_weights


def _activations_per_token(spec: ModelSpec, checkpointing: bool) -> float:
    one_layer = 24 * spec.hidden + 16 * spec.intermediate
    layers = 2 * spec.hidden * spec.layers + one_layer if checkpointing else one_layer * spec.layers
    return layers + 10 * spec.vocab


def _vllm_kv(spec: ModelSpec, s: RunShape) -> tuple[float, float]:
    """(KV bytes per token, fixed linear-attention state bytes per sequence) on one vLLM GPU."""
    kv_per_gpu = max(1, math.ceil(spec.kv_heads / s.vllm_tp))
    per_token = 2 * spec.full_attention_layers * kv_per_gpu * spec.head_dim * 2
    state = spec.linear_attention_layers * (
        spec.linear_value_heads / s.vllm_tp * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
        + spec.linear_conv_dim / s.vllm_tp * (spec.linear_conv_kernel - 1) * 2
    )
    return per_token, state


def _sync_transient(spec: ModelSpec, s: RunShape, full: bool) -> tuple[float, float]:
    """(largest gathered module's working memory, bucket bytes) during a full or a delta sync."""
    wrapped = lora_modules(spec, s.lora_rank, s.lora_targets)
    merged = max((10.0 * module.params for module in wrapped), default=0.0)
    # A full sync also gathers the modules LoRA leaves alone, the largest being embed_tokens or lm_head.
    gathered = 2.0 * spec.largest_module_parameters() if full else 0.0
    # vLLM loads q/k/v (gate/up, ...) into one stacked tensor, so their merged weights travel together.
    stacked: dict[tuple[str, str], int] = {}
    for module in wrapped:
        key = (module.name.rpartition(".")[0], module.stacked) if module.stacked else (module.name, "")
        stacked[key] = stacked.get(key, 0) + module.params
    bucket = max(s.bucket_mb * MIB, 2.0 * max(stacked.values(), default=0), gathered)
    # On a shared GPU the engine maps a CUDA-IPC bucket in place but receives a copy of any other.
    copying = settings.resolved_transport(s.transport, s.colocate) != "cuda_ipc"
    copies = 2 if s.colocate and copying else 1
    return max(merged, gathered), copies * bucket


def estimate(spec: ModelSpec, s: RunShape, model_name: str = "") -> Budget:
    """Per-GPU peak of each phase and host RAM for one setting (formulas: module docstring)."""
    if s.zero_stage not in (2, 3):
        raise ValueError("zero_stage must be 2 or 3")
    if s.param_offload and s.zero_stage != 3:
        raise ValueError("parameter offload needs ZeRO-3")
    g = s.gpu_mem_gib * GIB
    n = s.trainer_gpus
    if n <= 0:
        raise ValueError(f"{s.gpus} GPUs leave no trainer GPU beside {s.vllm_gpus} vLLM GPUs")
    p = spec.total_parameters
    lora = lora_parameters(spec, s.lora_rank, s.lora_targets)
    base = _base_bytes(spec, s.base_4bit)
    sharded = s.zero_stage == 3

    base_resident = 0.0 if s.param_offload else (base / n if sharded else base)
    # Parameter offload moves every parameter's partition, the adapters' too.
    lora_weights = 0.0 if s.param_offload else (2.0 * lora / n if sharded else 2.0 * lora)
    adam_offloaded = s.adam_offload or s.param_offload  # offload.py offloads the optimizer with the params
    optimizer = 0.0 if adam_offloaded else 12.0 * lora / n
    gradients = (2.0 if adam_offloaded else 4.0) * lora / n
    at_rest = {"base shard" if sharded else "base": base_resident, "LoRA weights": lora_weights}
    if not s.ds_sleep:
        at_rest.update({"LoRA optimizer": optimizer, "LoRA gradients": gradients})
    working_set = 0.0
    if sharded:
        layer_bytes = _base_bytes(spec, s.base_4bit) * spec.largest_layer_parameters() / p
        working_set = 2 * layer_bytes + 2.0 * spec.largest_module_parameters()
    tokens = s.micro_train_batch_size * s.max_len
    in_fit = {
        **at_rest,
        "LoRA optimizer": optimizer,
        "LoRA gradients": gradients,
        "ZeRO-3 gathered": working_set,
        "activations": tokens * _activations_per_token(spec, s.gradient_checkpointing),
    }
    trainer_processes = 1
    reference = 0.0
    if s.reference == "gpu":
        reference = 2.0 * p / n if sharded else 2.0 * p
    if s.reference in ("gpu", "cpu"):
        trainer_processes += 1

    vllm_weights = 2.0 * p / s.vllm_tp
    vllm_budget = s.gpu_memory_utilization * g
    graphs = 0.0 if s.enforce_eager else CUDA_GRAPHS
    activations = VLLM_BATCHED_TOKENS * 2 * (4 * spec.hidden + 3 * spec.intermediate / s.vllm_tp)
    activations += VLLM_MAX_SEQS * spec.vocab * 8
    kv_space = vllm_budget - vllm_weights - activations - graphs
    kv_token, state = _vllm_kv(spec, s)
    kv_sequences = kv_space / (kv_token * s.max_len + state)
    asleep = graphs if s.vllm_sleep_level > 0 else vllm_budget
    full_sync = _sync_transient(spec, s, full=True)
    delta_sync = _sync_transient(spec, s, full=False)

    def overhead(processes: int) -> dict[str, float]:
        return {"CUDA contexts": processes * PROCESS_OVERHEAD}

    trainer_side = {"reference shard": reference} if reference else {}
    if s.colocate:
        vllm_asleep = {"vLLM (asleep)": asleep}
        sync_engine = {"vLLM weights": vllm_weights, "vLLM CUDA graphs": graphs}
        if s.vllm_sleep_level == 0:
            sync_engine = {"vLLM budget": vllm_budget}
        processes = overhead(trainer_processes + 1)
        phases = [
            Phase("rollout", "shared", {"vLLM budget": vllm_budget, **at_rest, **trainer_side, **processes}),
            Phase("train", "shared", {**vllm_asleep, **in_fit, **trainer_side, **processes}),
        ]
        for name, (merge, bucket) in (("sync", full_sync), ("sync_delta", delta_sync)):
            transient = {"gathered/merged": merge, "bucket": bucket}
            phases.append(
                Phase(name, "shared", {**sync_engine, **at_rest, **trainer_side, **transient, **processes})
            )
    else:
        engine = {"vLLM budget": vllm_budget, **overhead(1)}
        processes = overhead(trainer_processes)
        phases = [
            Phase("rollout", "vllm", dict(engine)),
            Phase("train", "vllm", dict(engine)),
            Phase("rollout", "trainer", {**at_rest, **trainer_side, **processes}),
            Phase("train", "trainer", {**in_fit, **trainer_side, **processes}),
        ]
        for name, (merge, bucket) in (("sync", full_sync), ("sync_delta", delta_sync)):
            phases.append(Phase(name, "vllm", {**engine, "bucket": bucket}))
            transient = {"gathered/merged": merge, "bucket": bucket}
            phases.append(Phase(name, "trainer", {**at_rest, **trainer_side, **transient, **processes}))

    host = {"processes": HOST_PER_PROCESS * (s.vllm_gpus + n * trainer_processes)}
    if s.vllm_sleep_level == 1:
        host["vLLM weights (sleep level 1)"] = 2.0 * p * s.vllm_engines
    if s.ds_sleep or adam_offloaded:
        host["LoRA optimizer"] = 16.0 * lora
    if s.param_offload:
        host["trainer base (offload)"] = base
    if s.reference == "cpu":
        host["reference (--ref.offload)"] = 2.0 * p
    return Budget(
        model=model_name,
        settings=s,
        parameters=spec.parameters_by_part(),
        lora_parameters=lora,
        phases=phases,
        kv_sequences=kv_sequences,
        host_parts=host,
        gpu_bytes=g,
    )


# Knobs tried, in this order, to make a setting fit: cheapest in speed and fidelity first.
def _knobs(s: RunShape) -> list[tuple[str, dict]]:
    knobs = []
    if s.reference in ("gpu", "cpu") and s.lora_rank > 0:
        knobs.append(("sync.reference_from_base: true (no reference model)", {"reference": "base"}))
    elif s.reference == "gpu":
        knobs.append(("--ref.offload (or --algo.kl.init_coef 0)", {"reference": "cpu"}))
    if not s.ds_sleep:
        knobs.append(("--ds.enable_sleep", {"ds_sleep": True}))
    if s.colocate and s.vllm_sleep_level == 0:
        knobs.append(("--vllm.enable_sleep", {"vllm_sleep_level": 1}))
    if not s.gradient_checkpointing:
        knobs.append(("--actor.gradient_checkpointing_enable", {"gradient_checkpointing": True}))
    if s.micro_train_batch_size > 1:
        knobs.append(("--train.micro_batch_size 1", {"micro_train_batch_size": 1}))
    if s.bucket_mb > 256:
        knobs.append(("sync bucket 256 MB", {"bucket_mb": 256}))
    if s.zero_stage == 3 and not s.param_offload:
        knobs.append(
            ("trainer.offload_params: true (ZeRO-3 parameter offload to host RAM)", {"param_offload": True})
        )
    if not s.base_4bit:
        knobs.append(("--ds.load_in_4bit", {"base_4bit": True}))
    return knobs


def host_alternatives(spec: ModelSpec, s: RunShape) -> list[tuple[str, Budget]]:
    """The settings that need less host RAM than `s`, each with its estimate: vLLM sleep level 2 instead
    of 1, no trainer base offload, no CPU copy of the reference."""
    changes = []
    if s.vllm_sleep_level == 1:
        label = "sync.vllm_sleep_level: 2 (vLLM discards its weights while asleep; every sync is then full)"
        changes.append((label, {"vllm_sleep_level": 2}))
    if s.param_offload:
        changes.append(
            ("trainer.offload_params: false (the trainer's base back on the GPUs)", {"param_offload": False})
        )
    if s.reference == "cpu":
        if s.lora_rank > 0:
            changes.append(("sync.reference_from_base: true (no reference model)", {"reference": "base"}))
        else:
            changes.append(("--algo.kl.init_coef 0 (no reference model)", {"reference": "none"}))
    return [(label, estimate(spec, replace(s, **change))) for label, change in changes]


def best_utilization(spec: ModelSpec, s: RunShape) -> float | None:
    """The largest gpu_memory_utilization (0.01 steps, at most 0.95) at which every phase fits, or None."""
    for hundredths in range(95, 9, -1):
        trial = replace(s, gpu_memory_utilization=hundredths / 100)
        if estimate(spec, trial).fits():
            return trial.gpu_memory_utilization
    return None


def find_fitting(spec: ModelSpec, s: RunShape) -> tuple[list[str], RunShape] | None:
    """The knobs to turn, with the resulting settings, for every phase to fit; None when no knob helps.

    Knobs are added in order until the setting fits (gpu_memory_utilization retuned each time), then
    each added knob that the fit does not need is dropped again."""

    def tuned(settings: RunShape) -> RunShape | None:
        utilization = best_utilization(spec, settings)
        return None if utilization is None else replace(settings, gpu_memory_utilization=utilization)

    applied: list[tuple[str, dict]] = []
    fitting = tuned(s)
    for knob in _knobs(s):
        if fitting is not None:
            break
        applied.append(knob)
        fitting = tuned(replace(s, **{k: v for _, change in applied for k, v in change.items()}))
    if fitting is None:
        return None
    for knob in list(applied[:-1]):
        rest = [other for other in applied if other is not knob]
        trial = tuned(replace(s, **{k: v for _, change in rest for k, v in change.items()}))
        if trial is not None:
            applied, fitting = rest, trial
    changes = [label for label, _ in applied]
    if fitting.gpu_memory_utilization != s.gpu_memory_utilization:
        changes.append(f"--vllm.gpu_memory_utilization {fitting.gpu_memory_utilization}")
    return changes, fitting
