"""bench_trainer_sync.py's pure parts: the cost fit behind the scaling table and the 27B estimate, and the
engine check that stops a row whose sync did not reach the engine. No Ray, no engine.

Covers: fit_costs recovering known per-call and per-GiB costs, keeping both >= 0, refusing a single point;
Check.around refusing a row when the engine already matched the policy before the sync (the
check could not have failed) or does not match it after (the sync left the engine stale); the command
line refusing bad values before any model is built.
Does not cover: the benchmark itself (tests/tools/test_bench_trainer_sync.py runs it at its smallest size).
"""

from __future__ import annotations

import pytest
from openrlhf_lora_sync.tools.bench_trainer_sync import Check, fit_costs, parse_args

FIT_CASES = [
    # 10 ms per call and 2 s per GiB, exactly: recovered from three sizes
    ([(100, 0.1, 1.2), (200, 0.5, 3.0), (400, 1.0, 6.0)], (0.01, 2.0)),
    # the same costs from two sizes (the fewest the fit separates)
    ([(100, 0.1, 1.2), (400, 1.0, 6.0)], (0.01, 2.0)),
    # the exact solution has a per-call cost below 0 (-0.4 ms): dropped, all of it per GiB
    ([(300, 0.5, 0.9), (100, 1.0, 2.0)], (0.0, 1.96)),
    # the exact solution has a per-GiB cost below 0 (-0.08 s): dropped, all of it per call
    ([(100, 1.0, 1.0), (300, 0.5, 3.2)], (0.0106, 0.0)),
]


@pytest.mark.parametrize(("points", "expected"), FIT_CASES)
def test_fit_costs(points, expected):
    assert fit_costs(points) == pytest.approx(expected, abs=1e-9)


def test_fit_costs_refuses_one_point():  # two unknowns: one size cannot tell calls from bytes
    with pytest.raises(ValueError, match="two points"):
        fit_costs([(200, 0.5, 2.0)])


class ScriptedCheck(Check):
    """Check whose engine-vs-policy differences are given in order instead of measured."""

    def __init__(self, diffs: list[float]) -> None:
        super().__init__(engines=None, threshold=0.1)
        self.diffs = iter(diffs)

    def diff(self, actor) -> float:
        return next(self.diffs)


def test_check_passes_a_row_that_moved_the_engine_onto_the_policy():
    row = ScriptedCheck([1.5, 0.02]).around("full", None, lambda: {"seconds": 1.0})
    assert row == {"seconds": 1.0, "diff_before": 1.5, "diff_after": 0.02}


@pytest.mark.parametrize(
    ("diffs", "message"),
    [
        ([0.02, 0.02], "already matches the policy before the sync"),  # nothing for the sync to do
        ([1.5, 1.5], "does not compute the policy after the sync"),  # the sync left the engine stale
        ([1.5, float("nan")], "does not compute the policy after the sync"),  # a broken engine
    ],
)
def test_check_stops_the_run(diffs, message):
    changes = []
    with pytest.raises(SystemExit, match=message):
        ScriptedCheck(diffs).around("full", None, lambda: {}, change=lambda: changes.append(1))
    assert changes == [1]  # the policy moved first


ARGUMENT_CASES = [
    # a bucket the sync cannot use: the repo's own bucket setting refuses it
    (["--bucket-mb", "0"], "--bucket-mb: expected an integer >= 1, got '0'"),
    # not a number, second in the list
    (["--bucket-mb", "32,x"], "--bucket-mb: expected an integer >= 1, got 'x'"),
    # LoRA off: the recipe's rank check refuses it (the patch is for LoRA runs)
    (["--rank", "0"], "--rank 0: ds.lora.rank: ds.lora.rank is 0 (LoRA off)"),
    # a size the benchmark has no model for
    (["--sizes", "bench,big"], "--sizes: big: expected one of bench-small, bench, bench-large"),
    (["--repeats", "0"], "--repeats must be at least 1"),
]


@pytest.mark.parametrize(("argv", "message"), ARGUMENT_CASES)
def test_bad_arguments_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_fixed_arguments_parse():  # the twin of every refused case above
    args = parse_args(
        ["--bucket-mb", "32,128", "--rank", "64", "--sizes", "bench,bench-small", "--repeats", "1"]
    )
    assert (args.bucket_mb, args.rank, args.sizes, args.repeats) == (
        [32, 128],
        64,
        ["bench", "bench-small"],
        1,
    )
