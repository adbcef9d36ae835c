"""Paths in a launched run open in every Ray actor as in the driver (launch.py, openrlhf_patch.apply).

Covers: the launcher's path flags made absolute against the driver's directory (existing local paths and
output folders; hub ids, absolute paths and other flags untouched); a Ray worker, started by a cluster
whose node began in another directory (as `ray start` on another shell, or RAY_ADDRESS, leaves it), with the
launcher's runtime env works in the driver's directory and OpenRLHF's own image loader opens a
data file's relative image path there; the control, the same worker without LORA_SYNC_WORKDIR, sits in the
node's directory and the loader gets no image (OpenRLHF then fails "All images failed to load"). The Ray
resources a CPU run declares.
Does not cover: a directory that exists only on the driver's host (a worker elsewhere keeps its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from openrlhf_lora_sync.patch import launch

IMAGE = "data/images/x.png"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # a relative dataset that exists here -> absolute
        (["--data.prompt_dataset", "data/train.jsonl"], ["--data.prompt_dataset", "{cwd}/data/train.jsonl"]),
        # a hub id (no such local path) stays: OpenRLHF fetches it
        (
            ["--actor.model_name_or_path", "Qwen/Qwen2.5-VL-3B"],
            ["--actor.model_name_or_path", "Qwen/Qwen2.5-VL-3B"],
        ),
        # output folders are made absolute before they exist
        (["--ckpt.output_dir", "out/run"], ["--ckpt.output_dir", "{cwd}/out/run"]),
        # absolute paths and flags that hold no path are kept
        (
            ["--ckpt.path", "/abs/ckpt", "--actor.adam.lr", "data"],
            ["--ckpt.path", "/abs/ckpt", "--actor.adam.lr", "data"],
        ),
        # a flag with several values (OpenRLHF's --reward.remote_url takes a list): each one
        (
            ["--reward.remote_url", "data/r.py", "data/train.jsonl"],
            ["--reward.remote_url", "{cwd}/data/r.py", "{cwd}/data/train.jsonl"],
        ),
    ],
)
def test_path_flags_become_absolute(argv, expected, tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("train.jsonl", "r.py"):
        (tmp_path / "data" / name).touch()
    cwd = tmp_path.resolve()
    assert launch.absolute_paths(argv, tmp_path) == [token.format(cwd=cwd) for token in expected]


def test_declared_resources_cover_every_group():
    def args(colocate: bool):
        return SimpleNamespace(
            actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=2),
            ref=SimpleNamespace(num_nodes=1, num_gpus_per_node=2),
            vllm=SimpleNamespace(num_engines=2, tensor_parallel_size=2),
            train=SimpleNamespace(colocate_all=colocate),
        )

    assert launch.declared_resources(args(True)) == {"num_gpus": 2, "num_cpus": 4}  # one placement group
    assert launch.declared_resources(args(False)) == {"num_gpus": 8, "num_cpus": 10}  # actor + 2x2 + ref


WORKERS = r"""
import json, os, sys
import ray
from openrlhf_lora_sync.patch.launch import ray_runtime_env

driver_dir, image = sys.argv[1], sys.argv[2]

def open_image(path):
    from openrlhf.utils.vlm_utils import load_images
    return os.getcwd(), len(load_images([path]))

results = {}
for name, workdir in (("launcher", driver_dir), ("control", None)):
    if workdir:
        os.environ["LORA_SYNC_WORKDIR"] = workdir  # what launch.main sets
    else:
        os.environ.pop("LORA_SYNC_WORKDIR", None)
    # A cluster of its own each time: the setup hook and env vars are the job's, as the launcher gives them.
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env=ray_runtime_env())
    results[name] = ray.get(ray.remote(open_image).remote(image))
    ray.shutdown()
print(json.dumps(results))
"""


@pytest.mark.slow
def test_ray_workers_open_relative_image_paths_as_the_driver(tmp_path):
    from PIL import Image

    driver_dir, node_dir = tmp_path / "driver", tmp_path / "node"
    (driver_dir / IMAGE).parent.mkdir(parents=True)
    node_dir.mkdir()
    Image.new("RGB", (28, 28)).save(driver_dir / IMAGE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORA_SYNC_", "RAY_ADDRESS"))}
    done = subprocess.run(
        [sys.executable, "-c", WORKERS, str(driver_dir), IMAGE],
        cwd=node_dir, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["launcher"] == [str(driver_dir), 1]
    assert results["control"] == [str(node_dir), 0]  # where the node started: the image is not there
