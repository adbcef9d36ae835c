"""ASCII-text reward for OpenRLHF 0.11.2 GRPO: the share of the response's characters that are ASCII text.

A task a tiny random model can learn in a minute, so that a CPU run shows GRPO + LoRA + weight sync turning
into a rising reward (recipes/learn-cpu.yaml, tools/cpu_run.py --control). The tiny models' byte-level
vocabulary (tiny_models.py: 256 bytes and the special tokens) makes a random model write byte noise: about
38% of the bytes it samples are printable ASCII, tab or newline, the rest control characters and bytes
that are not UTF-8 on their own (decoded as U+FFFD). So every sample earns a graded reward, the rewards of
a GRPO group differ and its advantages are not 0; the policy is rewarded for writing text. The reward says
nothing about answering the question: the label is ignored. Scope: this one task; real training uses
rewards/math_answer.py.

How OpenRLHF 0.11.2 uses this file: as rewards/math_answer.py (``--reward.remote_url``): for every sample,
``reward_func([query], [prompt], [label])`` on a worker thread of the vLLM actor, with ``query`` the decoded
prompt + response, special tokens kept. A raised exception would leave the sample's reward None and fail
the step, so nothing in the input makes this raise.

Returned dict: ``rewards`` and ``scores`` (float tensors, one per query, both the ASCII fraction: there is
no separate correctness), ``extra_logs`` (batch means, which OpenRLHF copies into wandb):
``ascii_fraction`` (the reward) and ``ascii_no_response`` (share of samples with no response text).

What each input gets (tests/inputs/test_rewards.py checks every row). ASCII text: the printable characters
U+0020 to U+007E, tab, newline and carriage return.

=========================================================  =========================  =================
response                                                   reward                     ascii_no_response
=========================================================  =========================  =================
``Find x = 12.``, ``a\\tb\\n``                                1.0                        0
``ab`` + two control characters (U+0000, U+007F)           0.5                        0
``ab`` + two bytes that are not UTF-8 text (two U+FFFD)    0.5                        0
non-ASCII letters, digits, symbols (``é``, ``１``, ``½``)    0 for those characters     0
special tokens (``<|image_pad|>``...) in the response       removed before counting    0
text after the first ``<|im_end|>``                        ignored                    0
empty, or special tokens only                              0.0                        1
no ``<|im_start|>assistant`` and no prompt prefix          0.0                        1
not a string (None, bytes, a number)                       0.0                        1
=========================================================  =========================  =================

The response is the text after the last ``<|im_start|>assistant`` marker (or after ``prompt`` when the query
starts with it), up to the first ``<|im_end|>``, special tokens removed; it is not stripped.
"""

import re

ASSISTANT_TURN_MARKER = "<|im_start|>assistant\n"
END_OF_TURN = "<|im_end|>"
# Qwen's special tokens all look like <|name|>: <|im_end|>, <|endoftext|>, <|image_pad|>, <|vision_start|>...
SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>")
ASCII_TEXT = frozenset(map(chr, range(0x20, 0x7F))) | frozenset("\t\n\r")


def response_text(query: object, prompt: object = None) -> str:
    """The assistant's text in ``query`` without special tokens; "" when there is none."""
    if not isinstance(query, str):
        return ""
    marker_at = query.rfind(ASSISTANT_TURN_MARKER)
    if marker_at >= 0:
        response = query[marker_at + len(ASSISTANT_TURN_MARKER) :]
    elif isinstance(prompt, str) and prompt and query.startswith(prompt):
        response = query[len(prompt) :]
    else:
        return ""
    end_at = response.find(END_OF_TURN)
    if end_at >= 0:
        response = response[:end_at]
    return SPECIAL_TOKEN.sub("", response)


def ascii_fraction(text: str) -> float:
    return sum(char in ASCII_TEXT for char in text) / len(text) if text else 0.0


def reward_func(queries: list[str], prompts: list[str], labels: list[object], **kwargs) -> dict:
    """OpenRLHF 0.11.2 reward entry point; see the module docstring for the contract."""
    import torch

    queries = list(queries or [])
    prompts = list(prompts or [])
    prompts += [None] * (len(queries) - len(prompts))  # a missing prompt only loses the prefix fallback
    responses = [response_text(query, prompt) for query, prompt in zip(queries, prompts, strict=False)]
    fractions = [ascii_fraction(text) for text in responses]
    count = max(len(responses), 1)
    return {
        "rewards": torch.tensor(fractions, dtype=torch.float32),
        "scores": torch.tensor(fractions, dtype=torch.float32),
        "extra_logs": {
            "ascii_fraction": sum(fractions) / count,
            "ascii_no_response": sum(not text for text in responses) / count,
        },
    }
