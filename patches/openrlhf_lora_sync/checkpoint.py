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

Does not cover: DeepSpeed's own resume checkpoints under <ckpt.path>/_actor (DeepSpeed writes each tag
in its own directory and the `latest` file after it; OpenRLHF's rotation to ckpt.max_num happens before
the new one is written), nor filesystems without atomic rename (some network filesystems).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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
