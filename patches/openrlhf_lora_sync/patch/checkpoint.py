"""Checkpoints written atomically: a save that is interrupted leaves the previous checkpoint whole.

OpenRLHF 0.11.2 writes the LoRA adapter in peft format (adapter_config.json + adapter_model.*, with the
tokenizer/processor) through `DeepspeedStrategy.save_model`: at the end of training into
--ckpt.output_dir, and every --ckpt.save_steps rollout steps into <ckpt.path>/global_step<N>_hf when
--ckpt.save_hf is on (`PolicyModelActor.save_checkpoint`). Upstream writes straight into the target
directory, so a run killed mid-save leaves a truncated adapter there, and the final save overwrites the
previous adapter file by file.

`atomic_save_model` (installed by openrlhf_patch.apply) wraps `save_model`: rank 0 lets upstream write
into a staging directory beside the target (same filesystem), fsyncs every file and directory, then
swaps staging and target in one rename (Linux renameat2 RENAME_EXCHANGE) and deletes the old copy.
Until the swap the target's files are untouched; after it they are the new save's, complete (files
of the previous save that the new one does not write are gone with it).

A save writes files only, but its target may hold directories of other things: the recipes put
ckpt.path (DeepSpeed checkpoints, the global_step<N>_hf adapters) inside ckpt.output_dir, where the
final adapter goes. Those subdirectories are moved into the staging directory just before the swap,
so they stay in the target. Staging directories of killed saves (`.<name>.saving-<pid>`, pid no longer
running) are cleaned by the next save of the same target: a subdirectory in one is such a carried
directory (a kill between the move and the swap), and is moved back into the target first.
Where the filesystem has no RENAME_EXCHANGE (it answers EINVAL/ENOSYS), the previous checkpoint is
first renamed aside to `.<name>.previous-<pid>` and then deleted: a kill between those two renames
leaves it there, whole, rather than at the target.

Resume (`logging_resume`, installed by openrlhf_patch.apply around `DeepspeedStrategy.load_ckpt`, which
PolicyModelActor calls with --ckpt.load_enable when <ckpt.path>/_actor exists): after DeepSpeed has
loaded a checkpoint, every rank gathers the policy's LoRA parameters (ZeRO-3: GatheredParameters over
them only) and rank 0 logs one line, from logger openrlhf_lora_sync:
    resumed from <ckpt.path>/_actor/global_step<N> at global step <N>, LoRA adapter sha256 <hex>
    over its <n> tensors   (one line in the log)
`adapter_digest` is that digest, over the state peft's get_peft_model_state_dict gives (the names and
dtypes save_pretrained writes: no ".default", "base_model.model." kept), LoRA tensors only (names with
"lora_"; with lm_head or embed_tokens targeted peft also writes their base weights, which are not the
adapter); `saved_adapter_digest(<ckpt.path>/global_step<N>_hf)` computes the same from the saved file, so
the resumed adapter can be checked bit for bit against the one saved at that step.

Does not cover: DeepSpeed's own resume checkpoints under <ckpt.path>/_actor (DeepSpeed writes each tag
in its own directory and the `latest` file after it; OpenRLHF's rotation to ckpt.max_num happens before
the new one is written), nor filesystems without atomic rename (some network filesystems).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

logger = logging.getLogger("openrlhf_lora_sync")  # openrlhf_patch.apply gives it OpenRLHF's handler

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_STAGING_TAG = "saving"
_PREVIOUS_TAG = "previous"


def _sibling(target: Path, tag: str, pid: int) -> Path:
    return target.parent / f".{target.name}.{tag}-{pid}"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


def remove_stale_staging(target: Path) -> list[Path]:
    """Clean the staging directories left by killed saves of `target` (their pid is gone): directories
    carried out of the target go back into it, the rest is deleted. Returns the staging paths removed."""
    removed = []
    for path in target.parent.glob(f".{target.name}.{_STAGING_TAG}-*"):
        pid = path.name.rpartition("-")[2]
        if not pid.isdigit() or _pid_running(int(pid)):
            continue
        carried = [entry for entry in path.iterdir() if entry.is_dir()]
        if any((target / entry.name).exists() for entry in carried):
            continue  # both copies exist: leave it for a person rather than delete either
        for entry in carried:
            target.mkdir(exist_ok=True)
            os.rename(entry, target / entry.name)
        shutil.rmtree(path)
        removed.append(path)
    return removed


def _carry_subdirectories(target: Path, staging: Path) -> list[str]:
    """Move the target's subdirectories the new save did not write into the staging directory."""
    carried = [e.name for e in target.iterdir() if e.is_dir() and not (staging / e.name).exists()]
    for name in carried:
        os.rename(target / name, staging / name)
    return carried


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory bottom-up, so a crash after the rename cannot
    leave a renamed directory whose files were never written out."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(directory, name))
        _fsync_path(Path(directory))


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _swap(staging: Path, target: Path) -> Path:
    """Put staging at target; returns where the previous checkpoint now is."""
    try:
        _exchange(staging, target)
        return staging
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
    previous = _sibling(target, _PREVIOUS_TAG, os.getpid())
    os.rename(target, previous)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(previous, target)
        raise
    return previous


def publish(staging: Path, target: Path) -> None:
    """Put the complete directory `staging` at `target` in one step, replacing what was there (its
    subdirectories, which a save does not write, stay)."""
    if not target.exists():
        os.rename(staging, target)
    elif not target.is_dir():
        raise NotADirectoryError(f"{target}: a checkpoint target must be a directory")
    else:
        carried = _carry_subdirectories(target, staging)
        try:
            previous = _swap(staging, target)
        except BaseException:
            for name in carried:
                os.rename(staging / name, target / name)
            raise
        shutil.rmtree(previous)
    _fsync_path(target.parent)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging directory beside `target`; on a clean exit it replaces `target` atomically.
    On an exception the staging directory is deleted and `target` is left as it was."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    staging = _sibling(target, _STAGING_TAG, os.getpid())
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_save_model(upstream_save_model):
    """`DeepspeedStrategy.save_model` writing through `atomic_directory` on rank 0. Every rank still calls
    upstream (its ZeRO-3 gather and barrier are collective); only rank 0 writes files."""

    @functools.wraps(upstream_save_model)
    def save_model(self, model, tokenizer, output_dir, **kwargs):
        if not self.is_rank_0():
            return upstream_save_model(self, model, tokenizer, output_dir, **kwargs)
        with atomic_directory(output_dir) as staging:
            return upstream_save_model(self, model, tokenizer, str(staging), **kwargs)

    return save_model


ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # what peft / OpenRLHF's save_model write


def adapter_digest(state_dict: Mapping) -> tuple[str, int]:
    """(sha256 hex, number of tensors) of a peft adapter state dict's LoRA tensors (names containing
    "lora_"), in name order: each tensor's name, dtype, shape and raw bytes. The same for the adapter a
    resumed trainer holds (loaded_adapter_state) and the adapter file saved at that step."""
    import torch

    digest = hashlib.sha256()
    names = sorted(name for name in state_dict if "lora_" in name)
    for name in names:
        tensor = state_dict[name].detach().cpu().contiguous()
        header = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{list(tensor.shape)}\0"
        digest.update(header.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), len(names)


def saved_adapter_digest(directory: str | os.PathLike) -> tuple[str, int]:
    """adapter_digest of the peft adapter saved in `directory` (adapter_model.safetensors or .bin)."""
    import torch

    directory = Path(directory)
    for name in ADAPTER_FILES:
        path = directory / name
        if path.exists():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return adapter_digest(load_file(path))
            return adapter_digest(torch.load(path, map_location="cpu", weights_only=True))
    raise FileNotFoundError(f"{directory}: no {' or '.join(ADAPTER_FILES)}")


def loaded_adapter_state(model) -> dict:
    """The LoRA state of a peft model as save_pretrained writes it (get_peft_model_state_dict, without the
    embedding base weights), on CPU; {} for a model without peft adapters. Under ZeRO-3 its LoRA parameters
    are gathered (only those): collective, every rank calls it."""
    from peft import PeftModel, get_peft_model_state_dict

    if not isinstance(model, PeftModel):
        return {}
    lora = [(name, param) for name, param in model.named_parameters() if "lora_" in name]
    gather = contextlib.nullcontext()
    if any(hasattr(param, "ds_id") for _, param in lora):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([param for _, param in lora], modifier_rank=None)
    with gather:
        state = {name: param.detach().cpu().clone() for name, param in lora}
    return get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)


def resume_line(load_path: str | None, states: Mapping, state: Mapping) -> str:
    """The line logged after a resume (see the module's docstring)."""
    where = Path(load_path)
    where = where.parent if where.is_file() else where  # DeepSpeed returns its model-states file
    line = f"resumed from {where} at global step {states.get('global_step', 'unknown')}"
    if not state:
        return f"{line}, no LoRA adapter"
    digest, count = adapter_digest(state)
    return f"{line}, LoRA adapter sha256 {digest} over its {count} tensors"


def logging_resume(upstream_load_ckpt):
    """`DeepspeedStrategy.load_ckpt` that, when a checkpoint was loaded, logs resume_line on rank 0 from
    the adapter the model now holds (every rank takes part in the ZeRO-3 gather)."""

    @functools.wraps(upstream_load_ckpt)
    def load_ckpt(self, model, *args, **kwargs):
        load_path, states = upstream_load_ckpt(self, model, *args, **kwargs)
        if load_path is not None:
            state = loaded_adapter_state(self._unwrap_model(model))
            if self.is_rank_0():
                logger.info("%s", resume_line(load_path, states or {}, state))
        return load_path, states

    return load_ckpt
