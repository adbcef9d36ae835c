"""cpu_standins.py: what install() changes is exactly what STAND_INS names, and nothing where CUDA exists.

Each case runs in a fresh interpreter (the stand-ins are process-wide and installed once): it snapshots every
attribute of torch.cuda, the sys.modules entries and the upstream classes the list could touch, installs,
and reports what changed. Does not cover: whether the real trainer needs each one (measured by leaving it
out: see cpu_standins.py), nor the engine switches' effect on vLLM (the real CPU runs:
tests/trainer/test_cpu_run.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

from openrlhf_lora_sync.patch import cpu_standins

PROBE = r"""
import json, sys
import torch
from openrlhf.trainer.ppo_utils import replay_buffer
from openrlhf_lora_sync.patch import cpu_standins

if sys.argv[1] == "cuda":
    torch.cuda.is_available = lambda: True
if sys.argv[1] == "unlisted":
    real_install = cpu_standins.install
    def install():
        torch.cuda.empty_cache = lambda *a, **k: None  # a stand-in the list does not name
        return real_install()
    cpu_standins.install = install

def snapshot():
    seen = {f"torch.cuda:{name}": id(value) for name, value in vars(torch.cuda).items()}
    seen.update({f"sys.modules[{name}]": id(module) for name, module in sys.modules.items()})
    buffer = replay_buffer.NaiveReplayBuffer
    seen.update({f"{buffer.__module__}:{buffer.__name__}.{k}": id(v) for k, v in vars(buffer).items()})
    return seen

before = snapshot()
installed = [s.target for s in cpu_standins.install()]
after = snapshot()
changed = sorted(k for k in after if before.get(k) != after[k] and not k.startswith("sys.modules[") or
                 k.startswith("sys.modules[") and after[k] == id(None))
print(json.dumps({"installed": installed, "changed": changed}))
"""


def probe(case: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, case], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_cuda_exactly_the_listed_stand_ins_change():
    result = probe("cpu")
    listed = sorted(stand_in.target for stand_in in cpu_standins.STAND_INS)
    assert sorted(result["installed"]) == listed
    assert result["changed"] == listed


def test_a_stand_in_the_list_does_not_name_is_caught():
    """Negative control: the same comparison fails when install() changes one more thing."""
    result = probe("unlisted")
    listed = sorted(stand_in.target for stand_in in cpu_standins.STAND_INS)
    assert "torch.cuda:empty_cache" in result["changed"]
    assert result["changed"] != listed


def test_nothing_is_installed_where_cuda_exists():
    result = probe("cuda")
    assert result == {"installed": [], "changed": []}


def test_engine_switches_only_without_cuda(monkeypatch):
    import torch

    kwargs = {"enable_sleep_mode": True, "enforce_eager": True, "model": "m"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_standins.engine_kwargs(kwargs) == kwargs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_standins.engine_kwargs(kwargs) == {
        "enable_sleep_mode": False,
        "enforce_eager": False,
        "model": "m",
    }


def test_summary_is_one_line_naming_every_stand_in_and_switch():
    line = cpu_standins.summary()
    assert "\n" not in line
    for stand_in in cpu_standins.STAND_INS:
        assert stand_in.target in line and all(site in line for site in stand_in.sites)
    for name, _, _ in cpu_standins.ENGINE_SWITCHES:
        assert f"{name}=False" in line


def test_torch_compile_still_works_after_install():
    """torch.dynamo keys its trace rules by the objects torch.cuda's names hold and refuses one object under
    two names with different rules: with one shared no-op for set_device and synchronize, an in-process
    vLLM engine compiling after install() failed ("Duplicate torch object ... with different rules")."""
    code = (
        "import torch\n"
        "from openrlhf_lora_sync.patch import cpu_standins\n"
        "assert cpu_standins.install()\n"
        "from torch._dynamo import trace_rules\n"
        "trace_rules.get_torch_obj_rule_map()\n"
        "count = torch.compile(lambda x: (x > 0).sum(), backend='eager')(torch.ones(3))\n"
        "print(int(count))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "3", done.stderr[-2000:]
