"""The regression harness: does a vLLM engine compute the same prompt logprobs as an HF model?

Covers: starting a vLLM engine in this process on a checkpoint directory (with this package's worker
extension) and putting it back on that checkpoint (restore_checkpoint), per-token prompt logprobs from
vLLM and from an HF model on the same token ids (optionally with an image), and the tolerance per dtype.
Used by the tests and by scripts/verify_sync.py.
Any valid checkpoint of the supported families starts, as users' checkpoints come: max_model_len is
capped at the model's own max_position_embeddings (text_config's for VLMs); a VLM config whose
text_config has no `architectures` (what transformers' Qwen3VLConfig saves; vLLM-CPU indexes it) gets
them from the top level through vLLM's hf_overrides; what vLLM-CPU cannot run (an attention head size
its CPU attention backend does not list, Qwen3.5's linear attention in another dtype than bf16) raises
UnsupportedCheckpointError naming it before vLLM starts. A VLM directory without processor files gets
the family's default processor (its image/video processor classes with the patch sizes of its
vision_config, around the directory's tokenizer) when it has tokenizer files, and vLLM (which reads the
processor from the model directory) a view of the directory with those files added: checkpoint_processor
and start_checkpoint_engine, the one way the tools start an engine on a user's checkpoint.
Does not cover: generation or sampling equivalence (only teacher-forced logprobs are compared);
processors for a directory with neither processor nor tokenizer files (verify_sync's --processor).

Tolerances (LOGPROB_TOLERANCE, per dtype) are set from readings on the tiny test models
(tests/sync/test_engine_equivalence.py); the readings and the margins they leave: docs/fidelity.md, "The
engine-vs-HF tolerances". Strong adapters need more: scripts/bench_sync.py checks against the probe's
threshold instead.
"""

from __future__ import annotations

import os
from pathlib import Path

# The comparison itself is the run-time probe's (probe.py); tests and tools import it from here too.
from openrlhf_lora_sync.sync.probe import hf_prompt_logprobs, max_abs_diff, vllm_prompt_logprobs  # noqa: F401

LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}
# A synced engine against the same engine kind on the reference written to disk (verify_sync): same
# weights and kernels, so the only room is rounding the merge differently (docs/sync.md has the readings).
SYNC_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}
# Enough for the probes (tens of tokens) and an image prompt; capped at the model's own limit.
HARNESS_MAX_MODEL_LEN = 1024
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class UnsupportedCheckpointError(ValueError):
    """vLLM on this platform cannot run the checkpoint; the message names what and why."""


def _text_head_size(text_config) -> int:
    return (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )


def engine_settings(model_dir: str, dtype: str, max_model_len: int | None = None) -> dict:
    """The vLLM arguments `model_dir`'s config needs (max_model_len, hf_overrides); raises
    UnsupportedCheckpointError for what vLLM-CPU cannot run, before any engine starts."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    settings = {"max_model_len": max_model_len or min(HARNESS_MAX_MODEL_LEN, limit or HARNESS_MAX_MODEL_LEN)}
    if text is not config and not getattr(text, "architectures", None) and config.architectures:
        settings["hf_overrides"] = {"text_config": {"architectures": list(config.architectures)}}
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
        head_size = _text_head_size(text)
        if head_size not in supported:
            raise UnsupportedCheckpointError(
                f"{model_dir}: attention head size {head_size} (hidden_size / num_attention_heads or "
                f"head_dim) is not one vLLM-CPU's attention runs ({', '.join(map(str, supported))})"
            )
        if "linear_attention" in (getattr(text, "layer_types", None) or ()) and dtype != "bfloat16":
            raise UnsupportedCheckpointError(
                f"{model_dir}: vLLM-CPU runs linear attention (gated delta net) only in bfloat16, not {dtype}"
            )
    return settings


def default_processor(model_dir: str):
    """The family's processor for a VLM directory with tokenizer files but no processor files: its
    image and video processor classes with the vision_config's patch, merge and temporal patch sizes
    (other settings the classes' defaults), the directory's tokenizer and its chat template."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model_dir)
    vision, model_type = config.vision_config, config.model_type
    sizes = {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
    }
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])(
        image_processor=getattr(transformers, IMAGE_PROCESSOR_MAPPING_NAMES[model_type]["torchvision"])(
            **sizes
        ),
        video_processor=getattr(transformers, VIDEO_PROCESSOR_MAPPING_NAMES[model_type])(**sizes),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def with_processor_files(model_dir: str, processor, into: str | Path) -> str:
    """`into` made a view of model_dir plus `processor`'s saved files: vLLM loads the processor from the
    model directory, which must not be written to. The processor is saved first and the model's other
    files linked after, so no save writes through a link into model_dir."""
    into = Path(into)
    processor.save_pretrained(into)
    for path in Path(model_dir).resolve().iterdir():
        if not (into / path.name).exists():
            (into / path.name).symlink_to(path)
    return str(into)


def checkpoint_processor(model_dir: str, processor_dir: str | None = None):
    """The processor of a user's checkpoint, None for a text model: `processor_dir`'s (e.g. the base
    model's hub snapshot), else the directory's own, else the family's default around its tokenizer
    (default_processor)."""
    from transformers import AutoConfig, AutoProcessor

    if not hasattr(AutoConfig.from_pretrained(model_dir), "vision_config"):
        return None
    if processor_dir or any((Path(model_dir) / name).is_file() for name in PROCESSOR_FILES):
        return AutoProcessor.from_pretrained(processor_dir or model_dir)
    return default_processor(model_dir)


def start_checkpoint_engine(model_dir: str, dtype: str, processor=None, **options):
    """start_engine on a user's checkpoint with `processor` (checkpoint_processor's): where the directory
    has no processor files, vLLM starts on a temporary view of it with the processor's files added (the
    user's directory is never written), removed when the engine is garbage-collected or at exit. The one
    way verify_sync (plain and --fault) and bench_sync --model-dir start engines on users' checkpoints."""
    import shutil
    import tempfile
    import weakref

    engine_dir, view = str(model_dir), None
    if processor is not None and not any((Path(model_dir) / name).is_file() for name in PROCESSOR_FILES):
        view = tempfile.mkdtemp(prefix="engine-model-")
        engine_dir = with_processor_files(engine_dir, processor, view)
    try:
        engine = start_engine(engine_dir, dtype, **options)
    except BaseException:
        if view:
            shutil.rmtree(view, ignore_errors=True)
        raise
    if view:  # vLLM may read the processor files again after it started (its processor cache)
        weakref.finalize(engine, shutil.rmtree, view, True)
    return engine


def start_engine(
    model_dir: str,
    dtype: str,
    *,
    images_per_prompt: int = 0,
    max_model_len: int | None = None,
    multiprocess: bool = False,
    lora_rank: int | None = None,
):
    """A vLLM engine in this process, so tensors pass to its worker by reference in collective_rpc.
    multiprocess=True runs the engine core in its own process (V1 multiprocessing, as OpenRLHF's engine
    actors do): every collective_rpc then crosses a process boundary, and tensors do not survive it.
    lora_rank: start it with vLLM LoRA enabled for adapters up to that rank (adapter_mode.py).
    max_model_len: default HARNESS_MAX_MODEL_LEN or the model's limit if lower (engine_settings)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    extra = engine_settings(model_dir, dtype, max_model_len)
    from vllm import LLM

    from openrlhf_lora_sync.sync.worker_extension import WORKER_EXTENSION_CLS
    from openrlhf_lora_sync.testing.quiet_exit import silence_nanobind_leak_report

    silence_nanobind_leak_report()

    # A checkpoint without tokenizer files still runs: prompts are token ids, outputs are not decoded.
    if not any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        extra["skip_tokenizer_init"] = True
    if images_per_prompt:
        extra["limit_mm_per_prompt"] = {"image": images_per_prompt, "video": 0}
    if lora_rank is not None:
        from openrlhf_lora_sync.sync.adapter_mode import engine_lora_kwargs

        extra.update(engine_lora_kwargs(lora_rank))
    return LLM(
        model=model_dir,
        dtype=dtype,
        seed=0,
        enforce_eager=True,
        max_num_seqs=4,
        # A fixed small KV cache: on CPU the default reserves a fraction of host memory per engine.
        kv_cache_memory_bytes=64 << 20,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        **extra,
    )


def restore_checkpoint(llm, model_dir: str | Path) -> None:
    """Put an engine from start_engine back in the state it started in, without a restart: every weight of
    the checkpoint in `model_dir` reloaded in place (one reload, every fused group whole), no LoRA adapter
    installed (adapter mode's), and the prefix, multimodal and encoder caches empty."""
    from safetensors.torch import load_file

    from openrlhf_lora_sync.sync.sync import LocalEngines

    shards = sorted(Path(model_dir).glob("*.safetensors"))
    weights = [item for shard in shards for item in load_file(shard).items()]
    llm.collective_rpc("load_weights_in_place", args=(weights,))
    for lora_id in llm.collective_rpc("lora_adapter_ids")[0]:
        llm.llm_engine.remove_lora(lora_id)
    LocalEngines(llm).reset_caches()


def image_prompt(processor, image, text: str = "What is the area of the shaded region?"):
    """(token ids with one image placeholder, for vLLM; HF model inputs with it expanded, for HF)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    collapsed = processor.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    hf_inputs = processor(text=[prompt_text], images=[image], return_tensors="pt")
    return collapsed, hf_inputs
