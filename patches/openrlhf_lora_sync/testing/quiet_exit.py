"""Interpreter exit without triton's nanobind leak report.

Covers: a process that ran a vLLM-CPU engine in-process ends with nanobind's leak report on stderr
("nanobind: leaked 4 instances!", "... 64 types!", "... 514 functions!", 30-100 lines) from triton 3.9's
libtriton, a nanobind extension that vLLM imports (vllm/triton_utils/importing.py). The objects it
lists are triton's own bindings (`triton._C.libtriton.ir...`), still referenced when nanobind's cleanup
runs after the interpreter's teardown; nothing the run did leaks. nanobind's switch for the report,
set_leak_warnings(False), is C++ only, and libtriton neither binds it for Python nor exports it (checked
on triton 3.9.0), so it cannot be reached from here. Triton silences the same report in its own compile
workers by pointing stderr at /dev/null at exit (triton/_compile_warmup_pool.py); this does the same, from
an atexit handler registered when the engine starts. atexit runs handlers last-registered first, so
vLLM's engine shutdown and whatever else registers after the engine starts still print, and an uncaught
exception's traceback or a SystemExit message prints before any handler runs.
Does not cover: processes whose engine core runs in its own process (V1 multiprocessing: the engine's
worker is terminated, never finalized, and prints no report). What the interpreter itself prints while
finalizing after the handler ("Exception ignored in ..." from objects destroyed at exit) is silenced
with the report.
"""

from __future__ import annotations

import atexit
import os
import sys

STDERR_FD = 2
_registered = False


def _stderr_to_devnull() -> None:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, STDERR_FD)  # nanobind writes to C's stderr, whatever sys.stderr is by then
    os.close(devnull)


def silence_nanobind_leak_report() -> None:
    """From interpreter exit on, this process's stderr goes to /dev/null (idempotent)."""
    global _registered
    if not _registered:
        atexit.register(_stderr_to_devnull)
        _registered = True
