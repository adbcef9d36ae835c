"""One line for a Ray actor that died during `train_ppo_ray`, instead of a traceback from inside Ray.

When an actor of the run dies (its process killed: the OOM killer, a SIGKILL, a segfault), whoever was
waiting on it gets `ray.exceptions.ActorDiedError` (a `RayActorError`), which every Ray actor on the way
back to the driver wraps in a `RayTaskError`: the vLLM engine killed mid-rollout reaches the launcher as
PPOTrainer.fit's RayTaskError around the ActorDiedError; killed mid-sync, as PPOTrainer's RayTaskError
around PolicyModelActor's around it. Ray does not restart OpenRLHF's actors (no max_restarts), so the run
cannot go on: no rollouts come from a dead engine, nor from a restarted one that holds stale weights.

`dead_actor_line(error)` finds the innermost RayActorError in such a chain and says, in one line, which
of the run's actors died (by Ray's class name: RolloutRayActor is the vLLM engine, PolicyModelActor the
trainer...), its pid and actor id, Ray's exit type, and what to look at; None for every other error,
which the launcher re-raises unchanged. The launcher prints the line and exits with status 1.

Does not cover: an actor that hangs rather than dies (nothing raises), or a dead Ray node (the actors on
it are reported one by one, as they are found dead).
"""

from __future__ import annotations

import re

# Ray's class name of each of train_ppo_ray's actors -> (what it is, what to look at besides its log lines).
ACTOR_ROLES = {
    "RolloutRayActor": (
        "the vLLM engine actor",
        "its vLLM engine-core process's lines",
    ),
    "PolicyModelActor": ("the trainer (policy model) actor", "its DeepSpeed lines"),
    "ReferenceModelActor": ("the reference model actor", "its DeepSpeed lines"),
    "CriticModelActor": ("the critic model actor", "its DeepSpeed lines"),
    "RewardModelActor": ("the reward model actor", "its DeepSpeed lines"),
    "PPOTrainer": ("the PPO controller actor", "its rollout and reward lines"),
}
_FIELD = re.compile(r"^\s*(class_name|actor_id|pid|name|ip):\s*(\S+)\s*$", re.MULTILINE)
_EXIT_TYPE = re.compile(r"Worker exit type:\s*(\w+)")


def _causes(error: BaseException):
    """The errors `error` wraps: a RayTaskError's cause, then Python's explicit and implicit chain."""
    for attribute in ("cause", "__cause__", "__context__"):
        cause = getattr(error, attribute, None)
        if isinstance(cause, BaseException):
            yield cause


def chain(error: BaseException):
    """`error` and every error it wraps, depth first, each once."""
    seen, stack = set(), [error]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(reversed(list(_causes(current))))


def dead_actor(error: BaseException):
    """The innermost `RayActorError` in `error`'s chain of causes (the actor that died first), or None.
    A RayTaskError whose cause did not pickle carries it as a plain RayError with the cause's text: a
    RayError whose text holds an ActorDiedError's counts too."""
    from ray.exceptions import ActorDiedError, RayActorError, RayError

    found = None
    for current in chain(error):
        if isinstance(current, RayActorError) or (
            isinstance(current, RayError) and ActorDiedError.BASE_ERROR_MSG in _text(current)
        ):
            found = current  # later finds are deeper in the chain
    return found


def _text(error: BaseException) -> str:
    try:
        return getattr(error, "error_msg", None) or str(error)
    except Exception:  # a wrapper's __str__ that fails: its text is not needed to find the actor
        return ""


def _fields(actor_error) -> dict[str, str]:
    text = _text(actor_error)
    fields = dict(_FIELD.findall(text))
    if getattr(actor_error, "actor_id", None):
        fields.setdefault("actor_id", str(actor_error.actor_id))
    exit_type = _EXIT_TYPE.search(text)
    if exit_type:
        fields["exit_type"] = exit_type.group(1)
    return fields


def _role(class_name: str) -> tuple[str, str] | None:
    for name, role in ACTOR_ROLES.items():
        # the class name may come qualified (module.Class), or be the patch's subclass of it
        if class_name.rpartition(".")[2].endswith(name):
            return role
    return None


def dead_actor_line(error: BaseException) -> str | None:
    """One line naming the Ray actor whose death `error` reports, and what to look at; None when `error`
    does not come from a dead actor."""
    actor_error = dead_actor(error)
    if actor_error is None:
        return None
    fields = _fields(actor_error)
    class_name = fields.get("class_name", "")
    what, look_at = _role(class_name) or (
        f"the Ray actor {class_name}" if class_name else "a Ray actor of the run",
        "its lines",
    )
    details = [class_name] if class_name and _role(class_name) else []
    if "pid" in fields:
        details.append(f"pid {fields['pid']}")
    if "actor_id" in fields:
        details.append(f"actor id {fields['actor_id']}")
    named = f"{what} ({', '.join(details)})" if details else what
    if getattr(actor_error, "actor_init_failed", False):
        how = "failed while starting"
    else:
        how = "died" + (f" (Ray: worker exit type {fields['exit_type']})" if "exit_type" in fields else "")
    prefix = (
        f"({class_name.rpartition('.')[2]} pid={fields['pid']})" if class_name and "pid" in fields else ""
    )
    where = f"the log lines prefixed {prefix} above and {look_at}" if prefix else f"the log above ({look_at})"
    return (
        f"the run stopped: {named} {how}; Ray does not restart it and the run cannot go on without it; "
        f"look at {where}, and at the kernel log (dmesg) for an out-of-memory kill; to go on from the "
        "last checkpoint (ckpt.save_steps), rerun with ckpt.load_enable=true"
    )
