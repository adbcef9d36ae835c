"""One machine-readable JSON line alone on stdout, for scripts whose output a pipe reads (`| jq .ok`).

Covers: `result_stdout()`, inside which everything else written to file descriptor 1 (this process's
prints, vLLM's and other libraries' loggers, C extensions, subprocesses started inside) goes to stderr,
while the stream it yields writes to the real stdout; `refuse()`, the bad-input exit shared by the
scripts: one line naming the problem on stderr, `{"ok": false, "error": ...}` on stdout, exit code 2.
Used by scripts/verify_sync.py, scripts/export_merged.py and scripts/bench_sync.py.
Does not cover: what goes to stderr (the logs stay as the libraries write them).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TextIO

BAD_INPUT_EXIT = 2


class BadInputError(ValueError):
    """The user's input cannot be used; the message names the problem and the fix."""


@contextlib.contextmanager
def result_stdout() -> Iterator[TextIO]:
    """Point fd 1 at stderr for the duration (redirected at the descriptor, so loggers holding
    sys.stdout, C code and child processes follow it) and sys.stdout at sys.stderr (for a sys.stdout
    that is not fd 1's); yield a stream onto the original stdout."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield real
    finally:
        sys.stdout.flush()
        real.flush()
        os.dup2(real.fileno(), 1)
        real.close()


def emit(stream: TextIO, result: dict) -> None:
    print(json.dumps(result), file=stream, flush=True)


def refuse(stream: TextIO, tool: str, error: str, **fields) -> int:
    """Bad input: `tool: error` on stderr, the JSON line with ok false on `stream`; the exit code."""
    print(f"{tool}: {error}", file=sys.stderr, flush=True)
    emit(stream, {**fields, "ok": False, "error": error})
    return BAD_INPUT_EXIT
