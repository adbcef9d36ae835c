"""Trainer base offload: the policy's ZeRO-3 parameters and optimizer in pinned host memory.

OpenRLHF 0.11.2 builds the actor's DeepSpeed config with `offload_param: none` and has no flag for it, so
under `--train.colocate_all` the frozen bf16 base sits on the GPUs twice at every weight sync: as the
trainer's ZeRO-3 shard and as vLLM's weights. With the recipe key `trainer.offload_params: true`
(LORA_SYNC_OFFLOAD_PARAMS=1) `install()` (called by openrlhf_patch.apply()) wraps what OpenRLHF's own
code builds, for the policy actor only:
- `Actor.__init__` given a *train* config (`strategy.get_ds_train_config()`: its zero_optimization has an
  `offload_optimizer` entry, which eval configs lack): the model is loaded under that config with
  `offload_param` and `offload_optimizer` set to pinned CPU memory, so DeepSpeed's `zero.Init` puts each
  parameter's partition in pinned host memory as it loads (the base never occupies the GPU at rest); the
  Actor is marked;
- `DeepspeedStrategy._ds_init_train_model` (what `strategy.prepare((actor, cfg))` calls) for a marked
  Actor: `deepspeed.initialize` gets the same two offload entries in the config upstream builds.
The reference model, the EMA copy and the reward model (eval configs) and the critic (not an Actor) keep
upstream's configs. Every forward and backward then fetches each layer's partitions from host memory
(over PCIe on a GPU host) before ZeRO-3 gathers them, and the optimizer (DeepSpeed's CPU Adam for
OpenRLHF's AdamW, as with --ds.adam_offload) steps on the host.

--ds.enable_sleep with offload: DeepSpeed's `offload_states` refuses offloaded parameters ("Moving states
across devices is not supported for offloaded parameters"). OpenRLHF's `offload_deepspeed_states` and
`reload_deepspeed_states` (the sleep's trainer side) return before calling it whenever the optimizer is
offloaded, which this mode makes it: so the flag is accepted and does nothing for the policy, whose
parameters, gradients and optimizer states are in host memory already (a critic keeps upstream's sleep).
tests/trainer/test_offload.py runs both calls on an offloaded engine.

Refused before any GPU work (config_checks.offload_problems): ZeRO stages other than 3 and a 4-bit base.
Does not cover: NVMe offload, or what offload costs in time: DeepSpeed checkpoint save/load (it gathers
as usual) and, on a GPU host, the copy of the trainer's base shard (2P/N bytes per GPU) host to device on
every pass, which the CPU benchmark scripts/bench_offload.py cannot show (what is known and estimated:
docs/memory.md, "What it costs in step time").
"""

from __future__ import annotations

import copy
import functools
import logging

from openrlhf_lora_sync.base import settings

logger = logging.getLogger("openrlhf_lora_sync")

ENV = settings.get("trainer.offload_params").env
PINNED_CPU = {"device": "cpu", "pin_memory": True}
_OFFLOADED_ACTOR = "_lora_sync_offload_params"
_BUILDING_OFFLOADED = "_lora_sync_building_offloaded_actor"
_INSTALLED = "_lora_sync_offload_installed"


def offload_enabled() -> bool:
    """LORA_SYNC_OFFLOAD_PARAMS: 1 offloads the policy's parameters and optimizer, 0 (default) does not."""
    return settings.read(ENV)


def is_train_config(ds_config) -> bool:
    """Whether a DeepSpeed config is one OpenRLHF built with get_train_ds_config (not get_eval_ds_config)."""
    return isinstance(ds_config, dict) and "offload_optimizer" in ds_config.get("zero_optimization", {})


def with_param_offload(ds_config: dict) -> dict:
    """A copy of an OpenRLHF ZeRO-3 train config with parameters and optimizer offloaded to pinned CPU."""
    config = copy.deepcopy(ds_config)
    zero = config["zero_optimization"]
    if zero.get("stage") != 3:
        raise ValueError(
            f"{ENV}=1: parameter offload needs ZeRO stage 3, this config has stage {zero.get('stage')}; "
            "set ds.zero_stage: 3 or trainer.offload_params: false"
        )
    zero["offload_param"] = dict(PINNED_CPU)
    zero["offload_optimizer"] = dict(PINNED_CPU)
    return config


def _offloading_actor_init(upstream_init):
    import inspect

    signature = inspect.signature(upstream_init)

    @functools.wraps(upstream_init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        ds_config = bound.arguments.get("ds_config")
        offload = offload_enabled() and is_train_config(ds_config)
        if offload:
            bound.arguments["ds_config"] = with_param_offload(ds_config)
        upstream_init(*bound.args, **bound.kwargs)
        if offload:
            setattr(self, _OFFLOADED_ACTOR, True)

    return __init__


def _offloading_train_model(upstream_init_train_model):
    @functools.wraps(upstream_init_train_model)
    def _ds_init_train_model(self, model, cfg):
        if not getattr(model, _OFFLOADED_ACTOR, False):
            return upstream_init_train_model(self, model, cfg)
        setattr(self, _BUILDING_OFFLOADED, True)
        try:
            prepared = upstream_init_train_model(self, model, cfg)
        finally:
            setattr(self, _BUILDING_OFFLOADED, False)
        if self.is_rank_0():
            logger.info(
                "trainer base offload: the policy's ZeRO-3 parameters and optimizer are in pinned host "
                "memory (--ds.enable_sleep has nothing left to move for it)"
            )
        return prepared

    return _ds_init_train_model


def _offloading_train_config(upstream_get_config):
    @functools.wraps(upstream_get_config)
    def get_ds_train_config(self, *args, **kwargs):
        config = upstream_get_config(self, *args, **kwargs)
        return with_param_offload(config) if getattr(self, _BUILDING_OFFLOADED, False) else config

    return get_ds_train_config


def install() -> None:
    """Wrap OpenRLHF's Actor and DeepspeedStrategy (once per process; openrlhf_patch.apply() calls it).
    The wrappers read LORA_SYNC_OFFLOAD_PARAMS when a model is built, so without it they change nothing."""
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    if getattr(DeepspeedStrategy, _INSTALLED, False):
        return
    setattr(DeepspeedStrategy, _INSTALLED, True)
    Actor.__init__ = _offloading_actor_init(Actor.__init__)
    DeepspeedStrategy._ds_init_train_model = _offloading_train_model(DeepspeedStrategy._ds_init_train_model)
    DeepspeedStrategy.get_ds_train_config = _offloading_train_config(DeepspeedStrategy.get_ds_train_config)
