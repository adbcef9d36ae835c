#!/usr/bin/env python3
"""Merge a LoRA adapter (peft format) into its base model and write a plain Hugging Face checkpoint.

    python scripts/export_merged.py --base B --adapter A --out DIR [--max-shard-size 5GB]
                                    [--dtype auto|bfloat16|float16|float32] [--overwrite]

B is the base checkpoint (a directory, or a hub id already in the local Hugging Face cache); A is an
adapter directory as training writes it (ckpt.output_dir, or <ckpt.path>/global_step<N>_hf; its
adapter_model.bin or .safetensors). DIR gets sharded safetensors with their index, config.json, and every
other top-level file of B (tokenizer, processor, chat template, generation config...), copied as is.
Hardware: CPU; memory about 4 bytes per parameter (the merge runs in fp32) plus one copy in the output
dtype. Makes no network calls.

Covers: picking the model class the way OpenRLHF does (a config with vision_config is an image-text
model), the merge itself by peft (`merge_and_unload`) on the base loaded in fp32, then a cast to the
base's own dtype (--dtype overrides), `save_pretrained` with max_shard_size, and writing DIR atomically
(openrlhf_lora_sync.patch.checkpoint: a failed or killed export leaves no half-written DIR).
Output: one JSON line alone on stdout (`{"ok": true, "out": DIR, "copied": [...]}`; the summary for
people and the libraries' logs on stderr). Bad input exits 2 with one line naming the problem on stderr
and `{"ok": false, "error": ...}` on stdout, before anything is written: a base that is neither a
directory with config.json nor in the local cache, a model type transformers does not know, a missing
adapter directory, an adapter trained on another base or whose keys or shapes do not fit B
(openrlhf_lora_sync.config.adapter_check: peft itself only warns, and the "merged" model would equal B), an
existing --out without --overwrite.
Does not cover: quantized bases.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WRITTEN_BY_SAVE = ("config.json",)  # save_pretrained writes these from the merged model
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_base(base: str) -> Path:
    """The base checkpoint's directory: B itself, or its snapshot in the local Hugging Face cache."""
    path = Path(base).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from openrlhf_lora_sync.tools.result_line import BadInputError

    try:
        return Path(snapshot_download(base, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as error:
        raise BadInputError(
            f"--base {base}: not a directory nor in the local Hugging Face cache ({error}); "
            f"download it first (`hf download {base}`) or pass its directory"
        ) from None


def model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def output_dtype(config, requested: str) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def base_config(base_dir: Path):
    from transformers import AutoConfig

    from openrlhf_lora_sync.tools.result_line import BadInputError

    if not (base_dir / "config.json").is_file():
        raise BadInputError(f"--base {base_dir} has no config.json; pass a Hugging Face checkpoint directory")
    from openrlhf_lora_sync.config.weights_check import expected_shapes, weights_problem

    try:
        config = AutoConfig.from_pretrained(base_dir)
    except (ValueError, KeyError) as error:  # a model type this transformers does not know
        raise BadInputError(f"--base {base_dir}: {str(error).splitlines()[0]}") from None
    unreadable = weights_problem(base_dir, expected=expected_shapes(config))
    if unreadable:
        raise BadInputError(f"--base {unreadable}")
    return config


def merged_model(base_dir: Path, adapter_dir: Path, dtype: str = "auto"):
    """The base with the adapter merged in by peft (in fp32), cast to the output dtype; an adapter that
    does not fit the base is refused (adapter_check.AdapterMismatchError)."""
    from openrlhf_lora_sync.config.adapter_check import check_adapter_dir, load_checked_adapter

    config = base_config(base_dir)
    check_adapter_dir(adapter_dir, config.model_type)
    base = model_class(config).from_pretrained(base_dir, dtype=torch.float32)
    merged = load_checked_adapter(base, adapter_dir).merge_and_unload()
    return merged.to(output_dtype(config, dtype))


def copy_side_files(base_dir: Path, out_dir: Path) -> list[str]:
    """Copy B's top-level files other than weights and what save_pretrained wrote (tokenizer, processor,
    chat template, generation config, license...); returns their names."""
    copied = []
    for path in sorted(base_dir.iterdir()):
        if not path.is_file() or path.name in WRITTEN_BY_SAVE or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.name.endswith(".index.json"):  # the base's shard index; the merged model has its own
            continue
        shutil.copy2(path, out_dir / path.name)
        copied.append(path.name)
    return copied


def export(base: str, adapter: str, out: str, max_shard_size: str = "5GB", dtype: str = "auto") -> list[str]:
    from openrlhf_lora_sync.patch.checkpoint import atomic_directory

    base_dir, adapter_dir = resolve_base(base), Path(adapter)
    model = merged_model(base_dir, adapter_dir, dtype)
    with atomic_directory(out) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        copied = copy_side_files(base_dir, staging)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="base checkpoint directory or cached hub id")
    parser.add_argument("--adapter", required=True, help="peft adapter directory")
    parser.add_argument("--out", required=True, type=Path, help="where the merged checkpoint goes")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="default: the base's")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    from openrlhf_lora_sync.config.adapter_check import AdapterMismatchError
    from openrlhf_lora_sync.tools.result_line import BadInputError, emit, refuse, result_stdout

    with result_stdout() as stdout:
        try:
            if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
                raise BadInputError(
                    f"--out {args.out} exists and is not empty; pass --overwrite to replace it"
                )
            copied = export(args.base, args.adapter, args.out, args.max_shard_size, args.dtype)
        except (BadInputError, AdapterMismatchError) as error:
            return refuse(stdout, "export_merged", str(error))
        print(
            f"export_merged: wrote {args.out} (merged weights, config; copied from the base: "
            f"{', '.join(copied)})",
            file=sys.stderr,
        )
        emit(stdout, {"ok": True, "out": str(args.out), "copied": copied})
    return 0


if __name__ == "__main__":
    sys.exit(main())
