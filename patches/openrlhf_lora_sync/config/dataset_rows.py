"""A run's local datasets opened the way OpenRLHF 0.11.2's `blending_datasets` opens them, for the checks that
read their first rows before anything starts (preflight's data check, reward_check's stand-in calls).

Covers: the builder by file extension, a save_to_disk directory, a folder of data files; streamed where
parsed, so reading the first rows does not read the rest. Does not cover: hub datasets (no network calls),
blending several datasets, or checking the rows (preflight.row_problems does).
"""

from __future__ import annotations

import os
from pathlib import Path

# The extensions openrlhf.datasets.utils.blending_datasets loads with the `datasets` builder they name.
DATA_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


def load_local_dataset(path: Path, data_dir: str | None):
    """A local dataset opened the way blending_datasets opens it (the builder its extension names, else a
    save_to_disk directory, else a folder of data files), streamed where it is parsed, so that reading its
    first rows does not read the rest. Raises what `datasets` raises."""
    import datasets  # seconds to import on 2 cores: only where there is local data to read

    builder = DATA_FILE_BUILDERS.get(os.path.splitext(path)[1])
    if builder:
        return datasets.load_dataset(builder, data_files=str(path), streaming=True)
    if path.is_dir():
        try:
            return datasets.load_from_disk(str(path))
        except Exception:  # as in blending_datasets: not a save_to_disk directory, read its data files
            pass
    return datasets.load_dataset(str(path), data_dir=data_dir, streaming=True)
