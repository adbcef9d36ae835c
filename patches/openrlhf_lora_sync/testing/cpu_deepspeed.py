"""OpenRLHF's DeepspeedStrategy and Actor on DeepSpeed's CPU accelerator, for tests and benchmarks.

Covers what a CPU process (DS_ACCELERATOR=cpu, gloo, the usual RANK/WORLD_SIZE/MASTER_* variables) needs
to build the policy the way PolicyModelActor.init_model_from_pretrained does (`Actor(...,
ds_config=strategy.get_ds_train_config())`, then `strategy.prepare((actor, cfg))`) and to train it with
OpenRLHF's own forward, backward and optimizer step:
- `init_cpu_process()`: the CPU stand-ins of the real trainer's processes (cpu_standins.py: CUDA calls
  OpenRLHF makes answered, its log-probs on their torch path), the gloo process group;
- `use_torch_adam()`: DeepSpeed builds torch's AdamW from OpenRLHF's optimizer config instead of its own
  CPU Adam / fused Adam, C++ extensions compiled on first use (docs/cpu-run.md); both runs of a
  comparison then use the same optimizer code;
- `prepared_lora_actor()` and `train_step()`;
- `process_env()`: the environment of one such process (a rank of a world on this host).
Does not cover: the Ray actors around them, or GPUs (this is not how a GPU run is set up: launch.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from openrlhf_lora_sync.patch import cpu_standins
from openrlhf_lora_sync.sync.transport import free_port


def process_env(rank: int = 0, world_size: int = 1, port: int | None = None, **extra: str) -> dict[str, str]:
    """os.environ plus what a DeepSpeed CPU process of rank `rank` in a one-host world needs (a new free
    port when none is given; every rank of a world must get the same). One thread: the same matmul kernels
    on every rank and run, and the 2 cores of a CI machine are shared."""
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port or free_port()),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
    }


def init_cpu_process() -> None:
    import deepspeed

    cpu_standins.install()  # the CPU answers the real trainer's processes get (cpu_standins.py)
    deepspeed.init_distributed(dist_backend="gloo")


def use_torch_adam() -> None:
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    upstream = DeepspeedStrategy.get_ds_train_config

    def get_ds_train_config(self, *args, **kwargs):
        config = upstream(self, *args, **kwargs)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    DeepspeedStrategy.get_ds_train_config = get_ds_train_config


def strategy(zero_stage: int = 3):
    """OpenRLHF's DeepspeedStrategy with the args it reads when building a policy (bf16, batch 1)."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    ds = SimpleNamespace(
        param_dtype="bf16",
        zero_stage=zero_stage,
        tensor_parallel_size=1,
        adam_offload=False,
        zpg=1,
        use_universal_ckpt=False,
        grad_accum_dtype=None,
        overlap_comm=False,
        deepcompile=False,
        ring_attn_size=1,
    )
    args = SimpleNamespace(ds=ds, train=SimpleNamespace(dynamic_batch_enable=False))
    return DeepspeedStrategy(
        zero_stage=zero_stage, args=args, train_batch_size=1, micro_train_batch_size=1, max_norm=1.0
    )


def prepared_lora_actor(
    model_dir: str, strategy, targets: list[str], lr: float, max_norm: float, rank: int = 8
):
    """(Actor, optimizer, scheduler) as PolicyModelActor builds them: OpenRLHF's Actor loaded under the
    strategy's train config (ZeRO-3 partitions it as it loads), then strategy.prepare with AdamW."""
    from openrlhf.models import Actor

    actor = Actor(
        model_dir,
        attn_implementation="sdpa",
        param_dtype="bf16",
        lora_rank=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        ds_config=strategy.get_ds_train_config(),
    )
    cfg = {
        "optim": "adam",
        "muon": {},
        "adam": {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
        "lr_scheduler": "constant",
        "scheduler_steps": 1000,
        "max_norm": max_norm,
    }
    return strategy.prepare((actor, cfg))


def train_step(model, strategy, optimizer, scheduler, vocab_size: int, seed: int, length: int = 24) -> None:
    """One policy-gradient-shaped step on two random sequences: OpenRLHF's Actor forward (action
    log-probs of the second half), -(log-prob x random advantage), strategy.backward and optimizer_step."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, vocab_size, (2, length), generator=generator)
    attention_mask = torch.ones_like(sequences)
    action_mask = torch.ones(2, length // 2, dtype=torch.bool)
    advantages = torch.randn(2, length // 2, generator=generator)
    log_probs = model(sequences, action_mask=action_mask, attention_mask=attention_mask)
    loss = -(log_probs.float() * advantages).mean()
    strategy.backward(loss, model, optimizer)
    strategy.optimizer_step(optimizer, model, scheduler)
