"""Weight files that cannot be read, named before anything loads them.

A model or adapter directory whose safetensors files are cut off mid-download, are not safetensors at all,
or are missing a shard its index names makes transformers and peft raise deep inside their loaders
(`SafetensorError: Error while deserializing header: ...`, which names no file). `weights_problem` reads
each file's header with safetensors' own `safe_open` (which also checks that the data the header declares
is all there) and returns one line naming the file and what is wrong; with the model's config it also
names tensors whose shape differs from what the config builds (same names only: a checkpoint that uses
another naming than this transformers version is left to transformers' own loading).

Used by verify_sync, export_merged and preflight's model check. Does not cover: `.bin` (pickle) weights,
which cannot be checked without loading them, nor values (a file of the right shapes with wrong numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

SHOWN = 3  # mismatched tensors named in the line; the rest are counted


def weight_files(directory: Path, stem: str) -> tuple[list[Path], str | None]:
    """(the safetensors files of `stem` in `directory`: the index's shards or the single file, a problem
    line when the index is unreadable or names a missing shard)."""
    index = directory / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            return [], f"{index}: not a safetensors index ({type(error).__name__}: {error})"
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            return (
                [],
                f"{index} names {len(missing)} shard(s) that are not there: {', '.join(missing[:SHOWN])}",
            )
        return [directory / name for name in shards], None
    single = directory / f"{stem}.safetensors"
    return ([single] if single.is_file() else []), None


def weights_problem(directory: str | Path, stem: str = "model", expected: dict | None = None) -> str | None:
    """One line naming the first weight file of `directory` that cannot be read (or the tensors whose
    shapes differ from `expected`, {name: shape} of the model the config builds); None when all read."""
    from safetensors import SafetensorError, safe_open

    files, problem = weight_files(Path(directory), stem)
    if problem:
        return problem
    mismatched = []
    for path in files:
        try:
            with safe_open(str(path), "pt") as handle:
                shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as error:
            reason = str(error).splitlines()[0]
            return f"{path}: cannot be read as safetensors ({reason}); a cut-off download? fetch it again"
        if expected:
            mismatched += [
                f"{name} {shape} (the config builds {list(expected[name])})"
                for name, shape in shapes.items()
                if name in expected and list(expected[name]) != shape
            ]
    if mismatched:
        more = f" and {len(mismatched) - SHOWN} more" if len(mismatched) > SHOWN else ""
        return (
            f"{directory}: {len(mismatched)} tensor(s) of another shape than its config.json builds: "
            f"{'; '.join(mismatched[:SHOWN])}{more}; the weights and config.json are of different models"
        )
    return None


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of the model `config` builds, on the meta device (no memory)."""
    from openrlhf_lora_sync.config.config_checks import meta_model

    return {name: tuple(tensor.shape) for name, tensor in meta_model(config).state_dict().items()}
