"""Check that this repo's merge-then-sync makes a real vLLM engine compute the LoRA-merged policy.

Hardware: any. On CPU it needs the CPU test stack (bash scripts/setup_env.sh); on a GPU host the GPU
stack. Time: tiny models under a minute on 2 CPU cores; a 7B model on one GPU a few minutes.

    python scripts/verify_sync.py --model DIR [--adapter DIR] [--dtype float32|bfloat16] [--skip-sync]
                                  [--mode merge|adapter]

Loads the base HF model, applies the adapter (or a random LoRA with non-zero B on the language model's
linear layers when none is given), starts vLLM on the base weights in this process, runs one full sync
through the patch's trainer-side and engine-side code (shared-memory transport), and compares vLLM's
prompt logprobs with the HF peft-merged reference (`merge_and_unload`). Random token ids are used, so a
model directory without tokenizer files works. When the directory has a processor and the model a
vision tower, an image prompt is compared too, so vision-tower weights are checked (a text-only prompt
never reaches them). Prints one JSON line (max_abs_logprob_diff, before_diff, image_checked, ok, ...)
and exits 0 iff ok. --skip-sync leaves the engine on the base weights, so it must report not ok.
--mode adapter checks the adapter hot-swap mode instead (adapter_mode.py): vLLM starts with LoRA
enabled, the sync installs the adapter, and vLLM's logprobs are taken with the LoRA request; adapters
that mode refuses (a family not verified, LoRA on the vision tower...) exit 2 with the reason.

    python scripts/verify_sync.py --model DIR --fault {sleep2,drop-bucket,stale,transport}

Fault injection (sleep mode and lost transfers cannot be produced on demand): a correct full sync whose
post-sync probe (probe.py) passes, then the fault, the project's detection, and recovery (a full
resync, probed). sleep2: the engine's weights overwritten with garbage as a level-2 wake leaves them,
then the delta sync the trainer would send unaware; drop-bucket: a full sync with one bucket lost
(the engine refuses it); stale: the adapters change and no sync follows; transport: the transfer
raises mid-sync (sync_weights must raise and mark the next sync full). Prints one JSON line with
fault, detected, recovered, how and the probe diffs; exits 0 iff detected (and, for sleep2, recovered).
"""

from __future__ import annotations

import argparse
import copy
import json
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


def _probe_image():
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (112, 84), "white")
    ImageDraw.Draw(image).polygon([(8, 76), (104, 76), (52, 8)], fill=(30, 90, 200), outline="black")
    return image


def _load_policy(args, dtype):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(args.model)
    is_vlm = hasattr(config, "vision_config")
    auto_cls = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    base = auto_cls.from_pretrained(args.model, dtype=dtype)
    if args.adapter:
        return PeftModel.from_pretrained(base, args.adapter), is_vlm
    torch.manual_seed(args.seed)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=DEFAULT_LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(base, lora), is_vlm


def verify(args) -> dict:
    import torch
    from openrlhf_lora_sync.adapter_mode import AdapterSyncState, check_adapter_mode_supported, sync_adapter
    from openrlhf_lora_sync.logprob_check import (
        LOGPROB_TOLERANCE,
        hf_prompt_logprobs,
        image_prompt,
        max_abs_diff,
        start_engine,
        vllm_prompt_logprobs,
    )
    from openrlhf_lora_sync.plan import SyncState
    from openrlhf_lora_sync.sync import LocalEngines, sync_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    dtype_name = args.dtype or str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    dtype = getattr(torch, dtype_name)
    policy, is_vlm = _load_policy(args, dtype)
    adapter_state = None
    if args.mode == "adapter":
        check_adapter_mode_supported(policy)
        adapter_state = AdapterSyncState()
    reference = copy.deepcopy(policy).merge_and_unload().eval()

    processor = None
    if is_vlm and any(
        (Path(args.model) / name).exists() for name in ("processor_config.json", "preprocessor_config.json")
    ):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(args.model)
    engine = start_engine(
        args.model,
        dtype_name,
        images_per_prompt=int(processor is not None),
        lora_rank=policy.peft_config["default"].r if adapter_state else None,
    )

    vocab = reference.get_output_embeddings().weight.shape[0]
    token_ids = torch.randint(
        0, min(vocab, 256), (args.tokens,), generator=torch.Generator().manual_seed(1)
    ).tolist()

    def diffs() -> dict[str, float]:
        lora = adapter_state.lora_request() if adapter_state else None
        out = {
            "text": max_abs_diff(
                vllm_prompt_logprobs(engine, token_ids, lora_request=lora),
                hf_prompt_logprobs(reference, token_ids),
            )
        }
        if processor is not None:
            image = _probe_image()
            collapsed, hf_inputs = image_prompt(processor, image)
            hf = hf_prompt_logprobs(reference, hf_inputs.pop("input_ids"), **hf_inputs)
            out["image"] = max_abs_diff(
                vllm_prompt_logprobs(engine, collapsed, image=image, lora_request=lora), hf
            )
        return out

    before = diffs()
    stats = None
    if not args.skip_sync:
        engines, bucket_bytes = LocalEngines(engine), int(args.bucket_mb * 2**20)
        if adapter_state:
            stats = sync_adapter(policy, engines, adapter_state, dtype=dtype, bucket_bytes=bucket_bytes)
        else:
            stats = sync_weights(policy, engines, SyncState(), dtype=dtype, bucket_bytes=bucket_bytes)
    after = diffs()
    tolerance = LOGPROB_TOLERANCE[dtype_name]
    worst = max(after.values())
    return {
        "model": str(args.model),
        "mode": args.mode,
        "dtype": dtype_name,
        "synced": not args.skip_sync,
        "max_abs_logprob_diff": worst,
        "text_diff": after["text"],
        "image_diff": after.get("image"),
        "before_diff": max(before.values()),
        "image_checked": "image" in after,
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
        "ok": worst <= tolerance,
    }


def inject_fault(args) -> dict:
    """A correct sync, the fault, detection and recovery; see the module docstring."""
    import torch
    from openrlhf_lora_sync import probe, transport
    from openrlhf_lora_sync.logprob_check import start_engine
    from openrlhf_lora_sync.merge import iter_effective_checkpoint_tensors, sync_units
    from openrlhf_lora_sync.plan import SyncState
    from openrlhf_lora_sync.sync import LocalEngines, sync_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    dtype_name = args.dtype or str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    dtype = getattr(torch, dtype_name)
    policy, _ = _load_policy(args, dtype)
    engines = LocalEngines(start_engine(args.model, dtype_name))
    # Several buckets whatever the model size, so a bucket can be lost and a transfer fail midway.
    bucket_bytes = max(64 << 10, sum(p.numel() * dtype.itemsize for p in policy.parameters()) // 8)
    state = SyncState()

    def sync(**kwargs):
        return sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=bucket_bytes, **kwargs)

    def probe_diff() -> tuple[float, bool]:
        result = probe.run_probe(policy, engines, dtype_name)
        return result.max_abs_diff, result.ok

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
        "threshold": probe.PROBE_THRESHOLD[dtype_name],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(
            f"verify_sync: {args.model} has no config.json; pass a local HF checkpoint directory",
            file=sys.stderr,
        )
        return 2
    if args.fault and args.mode != "merge":
        print(
            "verify_sync: --fault injects merge-mode faults; adapter mode's level-2 recovery is tested in "
            "tests/test_adapter_mode.py",
            file=sys.stderr,
        )
        return 2
    if args.fault:
        result = inject_fault(args)
        print(json.dumps(result))
        return 0 if result["detected"] and (result["recovered"] or args.fault != "sleep2") else 1
    from openrlhf_lora_sync.merge import UnsupportedAdapterError

    try:
        result = verify(args)
    except UnsupportedAdapterError as error:
        print(f"verify_sync: {args.mode} mode refuses this adapter: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
