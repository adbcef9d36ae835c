"""The post-sync probe: does the engine now compute the policy the trainer just synced?

Covers: a fixed short probe (PROBE_LENGTH token ids from a seeded generator, in the byte range that
every Qwen tokenizer has, capped to the vocabulary); the engine's prompt logprobs on it (in-process
vLLM `LLM`s, or OpenRLHF's engine actors through their `generate`), the policy's own logprobs on the
same ids (a peft model's forward equals the merged model's, so no merge is needed), their max and mean
absolute difference per engine, a per-dtype threshold, and `ProbeFailed` naming the likely causes.
Text only: for VLMs the probe checks the language model, not the vision tower (verify_sync.py checks
that with an image prompt).

Cost: one teacher-forced forward of PROBE_LENGTH tokens on the trainer and one prompt-logprob request
per engine. Measured on 2 CPU cores with the tiny models, right after a sync, machine otherwise idle:
0.02 s per probe on Qwen3 and Qwen2.5-VL in fp32 (policy 7-9 ms, engine 9-12 ms), 0.1 s on Qwen3.5 in
bf16; 0.4-1.4 s median and up to 7 s while a CI run shared the cores (the sync then took 0.12-0.16 s).
On GPUs it is two short forwards; not measured there yet.

ZeRO-3: the policy's forward is collective (each layer's parameters are gathered), so when the
parameters are partitioned every trainer rank must call `policy_prompt_logprobs`; otherwise rank 0
alone runs it. The engine side and the comparison run on the rank that talks to the engines.

Thresholds (PROBE_THRESHOLD, on the max abs diff over the probe's tokens), from measurements
(tests/test_faults.py, tiny models, the probe's 31 scored tokens):
- no fault: fp32 (Qwen3, Qwen2.5-VL) 4.8e-7; bf16 (Qwen3.5) 3.9e-3 to 9.2e-3 (bf16 rounding of the
  logits; one bf16 ulp at |logprob| ~ 6 is 0.03); 1.2e-2 elsewhere in this repo.
- faults: stale engine 0.28-0.81, bucket dropped from a delta sync 0.24, half-applied sync 0.38,
  sleep-2 weights zeroed 0.45-0.54 or garbage 43-98 (bf16 faults: 0.45 and up).
- float32: 1e-3, three orders of magnitude above correct syncs and 240 times below the smallest fault.
- bfloat16: 0.1, eight times above the worst correct sync measured and 4.5 times below the smallest bf16
  fault (2.4 times below the smallest fault of any dtype). Larger vocabularies have larger |logprob|
  and so larger bf16 rounding: LORA_SYNC_PROBE_THRESHOLD overrides the threshold for a model whose
  correct-sync noise is higher (measure it with scripts/verify_sync.py on that checkpoint).
A stale engine is caught only when the training step moved the probe's logprobs past the threshold:
a tiny step leaves a stale engine that is, by the same measure, nearly the trained policy.
Does not cover: when to probe (openrlhf_patch.py: every LORA_SYNC_PROBE_EVERY syncs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PROBE_LENGTH = 32
PROBE_SEED = 6
PROBE_THRESHOLD = {"float32": 1e-3, "bfloat16": 0.1}


class ProbeFailed(RuntimeError):
    """After a sync the engine's logprobs on the probe differ from the policy's beyond the threshold."""


@dataclass
class ProbeResult:
    max_abs_diff: float  # worst engine
    mean_abs_diff: float  # worst engine's mean over the probe's tokens
    per_engine_max: list[float]
    threshold: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.threshold


def probe_token_ids(vocab_size: int, length: int = PROBE_LENGTH, seed: int = PROBE_SEED) -> list[int]:
    """The fixed probe: the same ids on every rank and every sync (a seeded generator, not the global RNG)."""
    high = min(vocab_size, 256)
    return torch.randint(0, high, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def policy_vocab_size(model) -> int:
    """The vocabulary from the config, not the embedding (under ZeRO-3 its local shard is empty)."""
    config = model.config
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "vocab_size", None) or config.vocab_size)


def policy_prompt_logprobs(model, token_ids: Sequence[int]) -> torch.Tensor:
    """The policy's logprobs of each probe token after the first, in eval mode (LoRA dropout off),
    restoring the training mode after. Collective under ZeRO-3: every rank must call it."""
    was_training = model.training
    model.eval()
    try:
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


def compare(
    policy_logprobs: torch.Tensor, engine_logprobs: list[torch.Tensor], threshold: float, seconds: float
) -> ProbeResult:
    diffs = [(policy_logprobs - got).abs() for got in engine_logprobs]
    worst = max(diffs, key=lambda d: d.max().item())
    return ProbeResult(
        max_abs_diff=worst.max().item(),
        mean_abs_diff=worst.mean().item(),
        per_engine_max=[d.max().item() for d in diffs],
        threshold=threshold,
        seconds=seconds,
    )


def run_probe(model, engines, dtype: str, threshold: float | None = None, lora_request=None) -> ProbeResult:
    """Single-process form (rank 0 holds the whole policy): policy and engines on the probe, compared."""
    start = time.perf_counter()
    token_ids = probe_token_ids(policy_vocab_size(model))
    policy = policy_prompt_logprobs(model, token_ids)
    engine = engine_prompt_logprobs(engines, token_ids, lora_request)
    limit = PROBE_THRESHOLD[dtype] if threshold is None else threshold
    return compare(policy, engine, limit, time.perf_counter() - start)


def failure_message(result: ProbeResult, sync_description: str) -> str:
    return (
        f"post-sync probe failed after {sync_description}: the engine's prompt logprobs differ from the "
        f"policy's by max {result.max_abs_diff:.3g} (mean {result.mean_abs_diff:.3g}; per engine "
        f"{', '.join(f'{d:.3g}' for d in result.per_engine_max)}) > threshold {result.threshold:g}, so "
        "rollouts would come from a policy other than the one being trained. Likely causes, and what to "
        "check: (1) a stale engine: a sync was skipped or went to other engines (is broadcast_to_vllm "
        "called after every update?); (2) weights lost at vLLM sleep level 2 and a delta sync sent "
        "instead of a full one (LORA_SYNC_VLLM_SLEEP_LEVEL must match the level the engines sleep at; "
        "LORA_SYNC_FORCE_FULL=1 rules this out); (3) a bucket lost in transport (the engine log's "
        "load_bucket calls against the sync line's bucket count; try another LORA_SYNC_TRANSPORT); "
        "(4) the prefix cache not reset, so the probe's prefix was served from KV computed with the old "
        "weights (reset_all_caches on every engine); (5) the wrong dtype: the engine's dtype is not the "
        "one the sync casts to, or its bf16 noise on this model exceeds the threshold (compare with "
        "scripts/verify_sync.py on this checkpoint; LORA_SYNC_PROBE_THRESHOLD raises it)."
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
