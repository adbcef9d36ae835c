"""The post-sync probe: does the engine now compute the policy the trainer just synced?

Covers: the probe's tokens (a fixed prefix of byte-range ids and the engine's greedy continuation of it,
generated anew at each probe, so the scored tokens are ones the current model finds likely, where bf16
rounding of the logits matters least, however far training has moved the policy from the base);
the noise floor (the same comparison with no sync involved: the engine as loaded from the checkpoint
against the policy with its adapters switched off, which is the base model), measured once per run; the
engine's and the policy's prompt logprobs on the probe, their max and mean absolute difference, and the
verdict against the floor (`judge`): ok, warn, or fail with `ProbeFailed` naming the likely causes.
Text only: for VLMs the probe checks the language model, not the vision tower (verify_sync.py checks
that with an image prompt).

The rule (docs/sync.md, "The post-sync probe", has the measurements behind it): the ratio is the mean
absolute difference over the scored tokens divided by the floor's mean (raised to at least MIN_FLOOR of
the engine dtype); the max is reported beside it, but one token's spike is not a verdict. Above FAIL_RATIO
the probe fails, above WARN_RATIO it warns and the run goes on. A correct sync reads the floor plus the
rounding of the merged weights onto the engine's grid, which the floor (same weights on both sides) does
not contain: a few floors. A lost bucket, a stale engine after a real training step or weights lost at
sleep level 2 read a hundred floors and more. Where no floor can be measured (the engines lost
their weights before the first sync: vLLM sleep level 2), the first sync's own reading is taken as the
floor when it is below FLOOR_CEILING, else the probe fails; a fixed threshold (sync.probe_threshold) makes
the probe compare the max against it alone.

ZeRO-3: the policy's forward is collective (each layer's parameters are gathered), so when the
parameters are partitioned every trainer rank must call `policy_prompt_logprobs`; otherwise rank 0
alone runs it. The engine side and the comparison run on the rank that talks to the engines.
Does not cover: when to probe (openrlhf_patch.py: every sync.probe_every syncs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PROBE_PREFIX_LENGTH = 8
PROBE_CONTINUATION_LENGTH = 24
PROBE_SEED = 6
FAIL_RATIO = 25.0
WARN_RATIO = 10.0
# The smallest floor mean a ratio is taken against, per engine dtype: fp32 kernels agree to ~1e-7, where
# the merge's own rounding would otherwise read as many floors. FAIL_RATIO times these is where the probe
# fails when no floor is measured (1e-3 and 0.1: the thresholds of the tiny CPU models).
MIN_FLOOR = {"float32": 4e-5, "bfloat16": 4e-3}
# What a correct sync may read when no floor is measured: the fail line at MIN_FLOOR (benchmarks use it).
PROBE_THRESHOLD = {dtype: FAIL_RATIO * least for dtype, least in MIN_FLOOR.items()}
# A first-sync reading (sleep level 2: no checkpoint to measure against) above this mean is not noise.
FLOOR_CEILING = 0.5
VISION_PLACEHOLDER_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
VERDICTS = ("ok", "warn", "fail")


class ProbeFailed(RuntimeError):
    """After a sync the engine's logprobs on the probe differ from the policy's far beyond the floor."""


@dataclass(frozen=True)
class ProbeFloor:
    """The probe's tokens and what engine and policy differ by on them with no sync involved.
    source: "checkpoint" (the engine as loaded vs the base policy), "first sync" (sleep level 2: the first
    sync's own reading), "fixed" (no floor: MIN_FLOOR, or the user's sync.probe_threshold)."""

    token_ids: tuple[int, ...]
    scored_from: int  # the first scored position: the tokens before it are the prefix
    max_abs_diff: float
    mean_abs_diff: float
    source: str
    threshold: float | None = None  # the user's fixed threshold on the max, which replaces the ratio

    def describe(self) -> str:
        if self.threshold is not None:
            return f"fixed threshold {self.threshold:g} on the max (sync.probe_threshold)"
        return f"floor max {self.max_abs_diff:.3g} mean {self.mean_abs_diff:.3g} ({self.source})"


@dataclass
class ProbeResult:
    max_abs_diff: float  # worst engine
    mean_abs_diff: float  # worst engine's mean over the probe's scored tokens
    per_engine_max: list[float]
    floor: ProbeFloor
    ratio: float  # the reading over the floor (judge's rule); the max over the threshold when fixed
    verdict: str  # one of VERDICTS
    seconds: float
    floor_tokens_ratio: float | None = None  # the same engines on the floor's own tokens (with_floor_tokens)

    @property
    def ok(self) -> bool:
        return self.verdict != "fail"

    def as_metrics(self) -> dict[str, float]:
        """What the sync's stats log under sync/ (verdict: 0 ok, 1 warn, 2 fail)."""
        return {
            "probe_max_abs_diff": self.max_abs_diff,
            "probe_mean_abs_diff": self.mean_abs_diff,
            "probe_floor_max": self.floor.max_abs_diff,
            "probe_floor_mean": self.floor.mean_abs_diff,
            "probe_ratio": self.ratio,
            "probe_verdict": float(VERDICTS.index(self.verdict)),
            "probe_seconds": self.seconds,
            **({"probe_ratio_floor_tokens": self.floor_tokens_ratio} if self.floor_tokens_ratio else {}),
        }

    def summary(self) -> str:
        return (
            f"max {self.max_abs_diff:.3g} (mean {self.mean_abs_diff:.3g}; per engine "
            f"{', '.join(f'{d:.3g}' for d in self.per_engine_max)}), {self.ratio:.2g}x the "
            f"{self.floor.describe()}"
            + (f", {self.floor_tokens_ratio:.2g}x on the floor's tokens" if self.floor_tokens_ratio else "")
        )


def byte_token_ids(vocab_size: int, length: int, seed: int = PROBE_SEED) -> list[int]:
    """Fixed ids, the same on every rank and every run (a seeded generator, not the global RNG), in the
    byte range every Qwen tokenizer has, capped to the vocabulary."""
    high = min(vocab_size, 256)
    return torch.randint(0, high, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def policy_vocab_size(model) -> int:
    """The vocabulary from the config, not the embedding (under ZeRO-3 its local shard is empty)."""
    config = model.config
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "vocab_size", None) or config.vocab_size)


def placeholder_token_ids(config) -> list[int]:
    """A VLM config's vision placeholder ids, which a text-only forward must never contain."""
    return sorted(
        {i for i in (getattr(config, name, None) for name in VISION_PLACEHOLDER_IDS) if i is not None}
    )


def _greedy_params(never: Sequence[int]):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=PROBE_CONTINUATION_LENGTH,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logit_bias=dict.fromkeys(never, -100.0) or None,
    )


def probe_token_ids(engines, model, lora_request=None) -> list[int]:
    """The prefix and the first engine's greedy continuation of it (every engine holds the same weights):
    tokens this model finds likely, the vision placeholders excluded."""
    prefix = byte_token_ids(policy_vocab_size(model), PROBE_PREFIX_LENGTH)
    params = _greedy_params(placeholder_token_ids(model.config))
    if hasattr(engines, "llms"):
        from vllm.inputs import TokensPrompt

        (output,) = engines.llms[0].generate(
            [TokensPrompt(prompt_token_ids=prefix)], params, use_tqdm=False, lora_request=lora_request
        )
    else:
        import ray

        output = ray.get(engines.actors[0].generate.remote(prefix, params))
    return prefix + list(output.outputs[0].token_ids)


def policy_prompt_logprobs(model, token_ids: Sequence[int], base: bool = False) -> torch.Tensor:
    """The policy's logprobs of each probe token after the first, in eval mode (LoRA dropout off),
    restoring the training mode after; base=True: with its adapters switched off (the base model).
    Collective under ZeRO-3: every rank must call it."""
    import contextlib

    from openrlhf_lora_sync.sync.adapter_mode import adapters_switched_off

    was_training = model.training
    model.eval()
    try:
        with adapters_switched_off(model) if base else contextlib.nullcontext():
            return hf_prompt_logprobs(model, token_ids)
    finally:
        model.train(was_training)


def engine_prompt_logprobs(engines, token_ids: Sequence[int], lora_request=None) -> list[torch.Tensor]:
    """One logprob vector per engine: sync.LocalEngines (in-process `LLM`s; in adapter mode, pass the
    installed adapter's `lora_request`) or openrlhf_patch.RayEngines (OpenRLHF's engine actors, which in
    adapter mode attach their installed adapter themselves; TP workers of one engine answer as one)."""
    if hasattr(engines, "llms"):
        return [vllm_prompt_logprobs(llm, token_ids, lora_request=lora_request) for llm in engines.llms]
    import ray
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    outputs = ray.get([actor.generate.remote(list(token_ids), params) for actor in engines.actors])
    return [
        torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], token_ids[1:], strict=True)])
        for out in outputs
    ]


def _diffs(policy_logprobs: torch.Tensor, engine_logprobs: list[torch.Tensor], scored_from: int):
    """Per engine, |policy - engine| over the scored tokens (logprob i is token i + 1's)."""
    return [(policy_logprobs - got).abs()[scored_from - 1 :] for got in engine_logprobs]


def measure_floor(
    policy_logprobs: torch.Tensor,
    engine_logprobs: list[torch.Tensor],
    token_ids: Sequence[int],
    source: str = "checkpoint",
) -> ProbeFloor:
    """The floor from the base policy's and the unsynced engines' logprobs (the worst engine's)."""
    worst = max(_diffs(policy_logprobs, engine_logprobs, PROBE_PREFIX_LENGTH), key=lambda d: d.max().item())
    return ProbeFloor(tuple(token_ids), PROBE_PREFIX_LENGTH, worst.max().item(), worst.mean().item(), source)


def fixed_floor(token_ids: Sequence[int], dtype: str, threshold: float | None = None) -> ProbeFloor:
    """No measured floor: MIN_FLOOR of the engine dtype, or the user's threshold on the max."""
    least = MIN_FLOOR[dtype]
    return ProbeFloor(tuple(token_ids), PROBE_PREFIX_LENGTH, least, least, "fixed", threshold)


def first_sync_floor(result: ProbeResult) -> ProbeFloor:
    """Sleep level 2: the first sync's reading as the floor, when it is plausible as noise (FLOOR_CEILING);
    raises ProbeFailed otherwise."""
    if result.mean_abs_diff > FLOOR_CEILING:
        raise ProbeFailed(
            failure_message(
                result,
                "the first sync (no floor could be measured: the engines lost their "
                f"checkpoint weights before it), whose mean is above {FLOOR_CEILING:g}, which is not noise",
            )
        )
    return ProbeFloor(
        result.floor.token_ids,
        result.floor.scored_from,
        result.max_abs_diff,
        result.mean_abs_diff,
        "first sync",
    )


def judge(
    policy_logprobs: torch.Tensor,
    engine_logprobs: list[torch.Tensor],
    floor: ProbeFloor,
    dtype: str,
    seconds: float,
) -> ProbeResult:
    """The reading against the floor by the module's rule (or against the user's fixed threshold)."""
    diffs = _diffs(policy_logprobs, engine_logprobs, floor.scored_from)
    worst = max(diffs, key=lambda d: d.max().item())
    high, mean = worst.max().item(), worst.mean().item()
    if floor.threshold is not None:
        ratio = high / floor.threshold if floor.threshold else float("inf")
        verdict = "fail" if high > floor.threshold else "ok"
    else:
        ratio = mean / max(floor.mean_abs_diff, MIN_FLOOR[dtype])
        verdict = "fail" if ratio > FAIL_RATIO else "warn" if ratio > WARN_RATIO else "ok"
    return ProbeResult(high, mean, [d.max().item() for d in diffs], floor, ratio, verdict, seconds)


def with_floor_tokens(fresh: ProbeResult, on_floor_tokens: ProbeResult) -> ProbeResult:
    """The reading on fresh tokens, failed also when the same engines fail on the floor's own tokens: an
    engine broken so that its greedy continuation is scored alike by any model cannot choose its way past
    the probe. Only the fresh tokens warn: the floor's tokens grow less likely as training moves the policy
    from the base, and their noise with them."""
    verdict = "fail" if on_floor_tokens.verdict == "fail" else fresh.verdict
    return dataclasses.replace(fresh, verdict=verdict, floor_tokens_ratio=on_floor_tokens.ratio)


def calibrate(model, engines, lora_request=None) -> ProbeFloor:
    """Single-process form (rank 0 holds the whole policy), before the first sync: the probe's tokens and
    the floor of these engines, which must still hold the checkpoint."""
    token_ids = probe_token_ids(engines, model, lora_request)
    policy = policy_prompt_logprobs(model, token_ids, base=True)
    return measure_floor(policy, engine_prompt_logprobs(engines, token_ids, lora_request), token_ids)


def run_probe(model, engines, dtype: str, floor: ProbeFloor, lora_request=None) -> ProbeResult:
    """Single-process form: policy and engines on fresh probe tokens, judged against the floor."""
    start = time.perf_counter()
    token_ids = probe_token_ids(engines, model, lora_request)
    policy = policy_prompt_logprobs(model, token_ids)
    engine = engine_prompt_logprobs(engines, token_ids, lora_request)
    on_floor_tokens = judge(
        policy_prompt_logprobs(model, floor.token_ids),
        engine_prompt_logprobs(engines, floor.token_ids, lora_request),
        floor,
        dtype,
        0.0,
    )
    fresh = judge(policy, engine, floor, dtype, time.perf_counter() - start)
    return with_floor_tokens(fresh, on_floor_tokens)


def failure_message(result: ProbeResult, sync_description: str) -> str:
    return (
        f"post-sync probe failed after {sync_description}: the engine's prompt logprobs differ from the "
        f"policy's by {result.summary()}, above the fail line ({FAIL_RATIO:g}x), so rollouts would come "
        "from a policy other than the one being trained. Likely causes, and what to check: (1) a stale "
        "engine: a sync was skipped or went to other engines (is broadcast_to_vllm called after every "
        "update?); (2) weights lost at vLLM sleep level 2 and a delta sync sent instead of a full one "
        "(LORA_SYNC_VLLM_SLEEP_LEVEL must match the level the engines sleep at; LORA_SYNC_FORCE_FULL=1 "
        "rules this out); (3) a bucket lost in transport (the engine log's load_bucket calls against the "
        "sync line's bucket count; try another LORA_SYNC_TRANSPORT); (4) the prefix cache not reset, so the "
        "probe's prefix was served from KV computed with the old weights (reset_all_caches on every "
        "engine); (5) the wrong dtype: the engine's dtype is not the one the sync casts to (compare with "
        "scripts/verify_sync.py on this checkpoint)."
    )


def warning_message(result: ProbeResult, sync_description: str) -> str:
    return (
        f"post-sync probe after {sync_description}: {result.summary()}, above {WARN_RATIO:g}x the floor "
        f"but under the fail line ({FAIL_RATIO:g}x); the run goes on. If this repeats or grows, run "
        "scripts/verify_sync.py on this checkpoint"
    )


def check(result: ProbeResult, sync_description: str) -> None:
    if not result.ok:
        raise ProbeFailed(failure_message(result, sync_description))


def vllm_prompt_logprobs(llm, token_ids: Sequence[int], image=None, lora_request=None) -> torch.Tensor:
    """Logprob vLLM assigns to each prompt token after the first, given the tokens before it
    (with the adapter of `lora_request` applied, in adapter mode)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(token_ids))
    if image is not None:
        prompt["multi_modal_data"] = {"image": image}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    (output,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)
    # With an image, vLLM expands the single image placeholder; index by the tokens it actually scored.
    scored = output.prompt_token_ids
    return torch.tensor(
        [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], scored[1:], strict=True)]
    )


@torch.no_grad()
def hf_prompt_logprobs(model, token_ids: Sequence[int] | torch.Tensor, **model_inputs) -> torch.Tensor:
    """The same quantity from an HF model (teacher forcing), computed in fp32 from its logits.
    `token_ids` may be a [1, n] tensor from a processor, with image inputs in model_inputs."""
    input_ids = torch.as_tensor(token_ids, device=model.device).reshape(1, -1)
    logits = model(input_ids=input_ids, **model_inputs).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1).cpu()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
