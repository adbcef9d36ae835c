r"""Math/geometry answer reward for OpenRLHF 0.11.2 GRPO: math-verify accuracy plus a small format bonus.

How OpenRLHF 0.11.2 uses this file
----------------------------------
``--reward.remote_url rewards/math_answer.py`` makes ``SingleTurnAgentExecutor`` (openrlhf/utils/agent.py)
import this file by path under the module name ``reward_func`` and, for every generated sample, call
``reward_func([query], [prompt], [label])`` through ``asyncio.to_thread``: one sample per call, on a worker
thread of the vLLM actor. ``query`` is the decoded prompt + response with special tokens kept (the image
placeholder is expanded to one ``<|image_pad|>`` per image patch), ``prompt`` is the chat-templated prompt
text, ``label`` is the dataset's label. If the call raises, OpenRLHF only logs it and the sample's reward
becomes None, which fails the step later; hence nothing about the model output may make this raise.

Returned dict: ``rewards`` (float tensor, one per query) = accuracy_weight * accuracy
+ format_weight * format, used for advantages; ``scores`` (float tensor) = accuracy (0/1), used by dynamic
filtering; ``extra_logs`` (batch means, floats), which OpenRLHF copies into ``Experience.info`` and so into
wandb: ``math_accuracy``, ``math_format``, ``math_no_answer``, ``math_parse_failure``,
``math_gold_parse_failure`` and ``math_verify_timeout``.

Configuration (environment variables, declared in ``openrlhf_lora_sync.base.settings`` and read there, once
per process, on the first ``reward_func`` call; a recipe's ``reward.*`` keys export them before training
starts, and Ray actors inherit them when ``ray.init()`` starts the cluster; with a separately started cluster
pass them through ``--runtime-env-json``). Loading the file only defines things: it reads no environment,
imports no math-verify and starts no process; a bad value raises ``SettingError`` (a ValueError naming the
variable) from that first call:

==========================  =======  ===========================================================
variable                    default  meaning
==========================  =======  ===========================================================
REWARD_ACCURACY_WEIGHT      1.0      weight of the 0/1 accuracy term
REWARD_FORMAT_WEIGHT        0.1      weight of the 0/1 format term
REWARD_ANSWER_FORMAT        boxed    ``boxed`` or ``think_answer`` (see ``PROMPT_INSTRUCTIONS``)
REWARD_VERIFY_TIMEOUT_S     5        wall-clock bound on parsing + verifying one sample
REWARD_VERIFY_WORKERS       2        verifier subprocesses per process that loads this file
==========================  =======  ===========================================================

Answer formats (``settings.ANSWER_FORMATS``; ``scripts/prepare_data.py`` writes the matching instruction into
every prompt):

* ``boxed``: reasoning, then the final answer in ``\boxed{...}``. Format = 1 when the response has some text
  before exactly one ``\boxed{...}`` whose braces balance and whose content is not empty.
* ``think_answer``: ``<think>reasoning</think><answer>final answer</answer>``, each tag exactly once, both
  non-empty, nothing but whitespace around them. A thinking chat template that pre-fills ``<think>`` in the
  generation prompt still passes, because the response is taken from the assistant turn marker on.

Accuracy is 1 when math-verify says the final answer equals the label:
``verify(parse(gold), parse(answer))``, gold first, a label without ``$`` or ``\boxed`` wrapped in ``$...$``.
So ``\frac{1}{2}``, ``0.5``, ``1/2``, ``60^\circ``, ``12 \text{cm}``, ``x = 12`` and ``\sqrt{884}`` vs
``2\sqrt{221}`` all count as equal; decimals are compared after rounding to 6 places, so ``5.196`` is not
``3\sqrt{3}``.

Before math-verify sees them, label and answer go through ``normalize_unicode_math``: the Unicode math
models write (``2√3``, ``√(3+4)``, ``60°``, ``8π``, ``3×4``, ``−5``, ``x²``, ``24 cm²``, ``7½``, full-width
and Arabic-Indic digits, thin and full-width spaces) becomes the LaTeX math-verify parses; only notation
changes, never a value. tests/inputs/test_rewards.py grades a table of realistic geometry3k-style final
answers (values, angles, lengths and areas with units, radicals, fractions, π, each right form with a wrong
control) end to end (its counts of false negatives and positives: docs/reward-and-data.md). What it still
misgrades: ``\frac{\pi}{3}`` for the label 60 (no unit conversion), a bare ``24 cm^2``
(math-verify reads ``c*m**2``) and ``5 in.`` (math-verify strips ``in`` but not ``in.``).

What each kind of model output gets, for REWARD_ANSWER_FORMAT=boxed (accuracy, format, extra_logs flag set;
"graded" means decided by math-verify as above). tests/inputs/test_rewards.py checks every row.

================================================================  ========  ======  =======================
response                                                          accuracy  format  flag
================================================================  ========  ======  =======================
reasoning, then one ``\boxed{}`` holding the right answer         1         1       -
the right ``\boxed{}`` with no text before it                     1         0       -
empty, whitespace only, or special tokens only                    0         0       math_no_answer
no ``\boxed`` at all                                              0         0       math_no_answer
``\boxed{}`` empty or blank, or ``\boxed 12`` without braces      0         0       math_no_answer
truncated: the last ``\boxed{`` never closes                      0         0       math_no_answer
nested ``\boxed{\frac{a}{b}}``, escaped ``\{ \}``, extra ``}}}``  graded    1       -
several ``\boxed{}``: only the LAST one is graded                 graded    0       -
trailing period ``\boxed{12.}``: the period is dropped            graded    1       -
special tokens inside the response: removed                       graded    graded  -
text after the first ``<|im_end|>``: ignored                      graded    graded  -
``\boxed{+}``, a lone ``√``, Unicode not normalised (``∞``)       0         1       math_parse_failure
words, e.g. ``\boxed{\text{twelve}}`` (a symbol to math-verify)   0         1       -
answer longer than MAX_ANSWER_CHARS (1000)                        0         1       math_parse_failure
megabyte-long response: only its last MAX_RESPONSE_CHARS count    graded    graded  -
pathological: ``9^{9^{9^{9}}}``, ``(10^{100})!``, hard integrals  0         1       math_verify_timeout
empty, special-token-only, over-long or unparsable label          0         graded  math_gold_parse_failure
no ``<|im_start|>assistant`` and the query does not start with    0         0       math_no_answer
the prompt
================================================================  ========  ======  =======================

The gold-label row applies when the response has an answer; with no answer, math_no_answer is set instead.
With think_answer, the answer is the content of the last ``<answer>...</answer>`` (its last ``\boxed{}`` if
it has one); an unclosed ``<answer>`` gives math_no_answer; the rest of the table applies to that content.

Time bound: math-verify's own timeouts use ``signal.alarm``, which only works on the main thread, and even
there a signal cannot interrupt one long C-level operation such as a huge integer power (which also holds the
GIL, so a watchdog thread could neither stop it nor keep the event loop alive). So parsing and verification
run in a small pool of subprocesses that run this same file (no import path needed, no torch imported
there); the caller waits at most REWARD_VERIFY_TIMEOUT_S for an answer and SIGKILLs a worker that misses the
deadline, then starts a fresh one on demand (the next caller pays that start, about a second). Each worker
also caps its own address space (2 GiB) and, per request, its CPU time, so a runaway computation ends even if
the parent is gone. Callers beyond REWARD_VERIFY_WORKERS wait for a free worker. scripts/bench_reward.py
measures throughput and worst-case latency.

Not covered: multiple-choice letters mapped to option values, answers given only in words, Unicode math
beyond ``normalize_unicode_math`` (``∞``, ``≤``, subscripts), unit conversion (radians for degrees), chat
templates other than Qwen's (``<|im_start|>assistant`` / ``<|im_end|>``) unless the query starts with the
prompt text, and non-POSIX systems (the worker pipes use ``select``).
"""

# No `from __future__ import annotations`: OpenRLHF executes this file without registering it in sys.modules,
# and @dataclass cannot resolve string annotations of a module it cannot find there.
import atexit
import dataclasses
import importlib.util
import json
import logging
import os
import queue
import re
import resource
import select
import subprocess
import sys
import threading
import time
import unicodedata
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from openrlhf_lora_sync.base import settings

# The instruction appended to each question, one per settings.ANSWER_FORMATS; scripts/prepare_data.py
# imports it so prompt and grader agree.
PROMPT_INSTRUCTIONS = {
    "boxed": "Reason step by step, then give the final answer inside \\boxed{}.",
    "think_answer": (
        "Reason step by step inside <think> </think> tags, then give the final answer inside "
        "<answer> </answer> tags."
    ),
}

ASSISTANT_TURN_MARKER = "<|im_start|>assistant"
END_OF_TURN = "<|im_end|>"
# Qwen's special tokens all look like <|name|>: <|im_end|>, <|endoftext|>, <|image_pad|>, <|vision_start|>...
SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>")

# The final answer sits at the end, so only the tail of a long response is examined.
MAX_RESPONSE_CHARS = 32_768
MAX_ANSWER_CHARS = 1_000
MAX_LABEL_CHARS = 1_000

VERIFIER_STARTUP_TIMEOUT_S = 120.0
VERIFIER_MEMORY_LIMIT_BYTES = 2 * 1024**3
_SERVE_VERIFIER_FLAG = "--serve-verifier"


class Verdict(str, Enum):
    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"
    ANSWER_UNPARSABLE = "answer_unparsable"
    GOLD_UNPARSABLE = "gold_unparsable"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class RewardConfig:
    """The reward.* settings; each field is the setting `reward.<field name>`."""

    accuracy_weight: float
    format_weight: float
    answer_format: str
    verify_timeout_s: float
    verify_workers: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "RewardConfig":
        """From the environment (default os.environ); raises settings.SettingError naming a bad variable."""
        return cls(**{f.name: settings.read(f"reward.{f.name}", environ) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Grade:
    verdict: Verdict
    format_score: float

    @property
    def accuracy(self) -> float:
        return 1.0 if self.verdict is Verdict.CORRECT else 0.0


def extract_response(query: str, prompt: str | None = None) -> str:
    """The assistant's text in ``query``, without special tokens; "" when no assistant turn is found.

    Splits on the last Qwen assistant turn marker rather than searching for ``prompt`` in ``query``: for a VLM
    the decoded query has the image placeholder expanded, so it never contains the prompt text verbatim.
    """
    marker_at = query.rfind(ASSISTANT_TURN_MARKER)
    if marker_at >= 0:
        response = query[marker_at + len(ASSISTANT_TURN_MARKER) :]
    elif prompt and query.startswith(prompt):
        response = query[len(prompt) :]
    else:
        return ""
    end_at = response.find(END_OF_TURN)
    if end_at >= 0:
        response = response[:end_at]
    response = response[-MAX_RESPONSE_CHARS:]
    return SPECIAL_TOKEN.sub("", response).strip()


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``; None if there is none or its braces never close."""
    boxed_at = text.rfind("\\boxed")
    if boxed_at < 0:
        return None
    open_at = boxed_at + len("\\boxed")
    while open_at < len(text) and text[open_at].isspace():
        open_at += 1
    if open_at >= len(text) or text[open_at] != "{":
        return None
    depth = 0
    index = open_at
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # \{ and \} are literal braces, not grouping
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : index]
        index += 1
    return None


def _tag_spans(response: str) -> tuple[int, int, int, int] | None:
    """Positions of <think>, </think>, <answer>, </answer> when each occurs exactly once, in that order."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(response.count(tag) != 1 for tag in tags):
        return None
    positions = tuple(response.find(tag) for tag in tags)
    return positions if list(positions) == sorted(positions) else None


def extract_final_answer(response: str, answer_format: str) -> str | None:
    """The final answer the response commits to, in the given format; None when it gives none."""
    if answer_format == "think_answer":
        open_at = response.rfind("<answer>")
        close_at = response.find("</answer>", open_at)
        if open_at < 0 or close_at < 0:
            return None
        answer = response[open_at + len("<answer>") : close_at]
        if "\\boxed" in answer:
            answer = last_boxed_content(answer)
    else:
        answer = last_boxed_content(response)
    if answer is None:
        return None
    # "\boxed{12.}" ends a sentence rather than meaning anything mathematical.
    answer = answer.strip().removesuffix(".").strip()
    return answer or None


def format_reward(response: str, answer_format: str) -> float:
    """1.0 when the response follows the format the prompt asked for (see the module docstring), else 0.0."""
    if answer_format == "think_answer":
        spans = _tag_spans(response)
        if spans is None:
            return 0.0
        think_open, think_close, answer_open, answer_close = spans
        outside = (
            response[:think_open]
            + response[think_close + len("</think>") : answer_open]
            + response[answer_close + len("</answer>") :]
        )
        think = response[think_open + len("<think>") : think_close]
        answer = response[answer_open + len("<answer>") : answer_close]
        return float(not outside.strip() and bool(think.strip()) and bool(answer.strip()))
    if response.count("\\boxed") != 1:
        return 0.0
    content = last_boxed_content(response)
    has_reasoning = bool(response[: response.find("\\boxed")].strip())
    return float(has_reasoning and content is not None and bool(content.strip()))


def gold_latex(label: object) -> str | None:
    """The label as math-verify input, or None when it is empty or too long to be a real answer."""
    text = SPECIAL_TOKEN.sub("", "" if label is None else str(label)).strip()
    if not text or len(text) > MAX_LABEL_CHARS:
        return None
    return text if "$" in text or "\\boxed" in text else f"${text}$"


# What models write in Unicode, rewritten into the LaTeX math-verify parses (see normalize_unicode_math).
_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_ZERO_WIDTH = re.compile(r"[\u200b-\u200d\u2060\ufeff]")
# SI style: a thin, narrow or no-break space between digit groups is a thousands separator ("1 000").
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)[\u00a0\u2009\u202f](?=\d{3}(?!\d))")
_SYMBOLS = str.maketrans(
    {
        "\u2212": "-",
        "×": r" \times ",
        "·": r" \cdot ",
        "⋅": r" \cdot ",
        "∙": r" \cdot ",
        "÷": r" \div ",
        "π": r"\pi ",
    }
)
_DEGREE_SIGN = r"(?:[°˚º]|\\(?:text)?degree(?![A-Za-z]))"
# "60°", "60^°", "60^{°}" and gensymb's "60\degree" all become the "60^{\circ}" math-verify reads as 60.
_DEGREE = re.compile(rf"\^\s*\{{\s*{_DEGREE_SIGN}\s*\}}|\^\s*{_DEGREE_SIGN}|{_DEGREE_SIGN}")
_SUPERSCRIPT_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻", "0123456789+-")
_SUPERSCRIPT = re.compile(r"[⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
# math-verify drops a trailing unit ("12 cm", "12 \text{cm}^2") but reads a bare "cm^2" as c*m**2: an area
# or volume unit written with a superscript ("24 cm²") is put in \text{} first.
_UNIT_BEFORE_SUPERSCRIPT = re.compile(r"(?<=[\d\s}])(units?|mm|cm|dm|km|m|in|ft|yd|mi)(?=\s*[²³])")
_ROOTS = {"√": "", "∛": "[3]", "∜": "[4]"}
# What an unbraced √ applies to: a number, one letter, or \pi ("2√3", "√12/2", "√x", "√π").
_RADICAND = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]|\\pi(?![A-Za-z])")


def _latex_roots(text: str) -> str:
    r"""√3, √{3}, √(3) and √ 3 as \sqrt{3} (∛, ∜ as \sqrt[3], \sqrt[4]); one left-to-right pass."""
    out: list[str] = []
    # One entry per open "(": whether its ")" also closes the brace of a \sqrt{( opened for it.
    closes_root: list[bool] = []
    index = 0
    while index < len(text):
        char = text[index]
        index += 1
        if char in _ROOTS:
            out.append("\\sqrt" + _ROOTS[char])
            while index < len(text) and text[index] == " ":
                index += 1
            if text.startswith("(", index):
                out.append("{(")
                closes_root.append(True)
                index += 1
            elif radicand := _RADICAND.match(text, index):
                out.append("{" + radicand.group() + "}")
                index = radicand.end()
            # Otherwise ("√{3}", "√\frac{1}{2}") \sqrt takes what follows as LaTeX does.
        elif char == "(":
            closes_root.append(False)
            out.append(char)
        elif char == ")" and closes_root:
            out.append(")}" if closes_root.pop() else ")")
        else:
            out.append(char)
    return "".join(out)


def _ascii_form(char: str) -> str:
    r"""A decimal digit of any script as 0-9, a full-width ASCII form as ASCII, ``½`` as ``\frac{1}{2}``."""
    if char.isascii():
        return char
    if char.isdecimal():
        return str(unicodedata.decimal(char))
    if "\uff01" <= char <= "\uff5e":
        return chr(ord(char) - 0xFEE0)
    if unicodedata.decomposition(char).startswith("<fraction>"):
        numerator, _, denominator = unicodedata.normalize("NFKC", char).partition("\u2044")
        if numerator and denominator:
            return f"\\frac{{{numerator}}}{{{denominator}}}"
    return char


def normalize_unicode_math(text: str) -> str:
    r"""``text`` with the Unicode math models write replaced by the LaTeX math-verify understands.

    - digits of any script (``１２``, ``١٢``) and full-width forms (``（３）``) become ASCII; vulgar fractions
      become ``\frac`` (``7½`` is ``7\frac{1}{2}``, a mixed number to math-verify);
    - Unicode spaces become spaces, except that a thin, narrow or no-break space between digit groups is
      dropped (``1 000`` is 1000); zero-width characters are removed;
    - ``−`` is ``-``; ``×``, ``·``, ``⋅``, ``÷``, ``π`` become ``\times``, ``\cdot``, ``\div``, ``\pi``
      (``·`` is read as a product, not as the old British decimal point);
    - ``°`` (also ``˚``, ``º``, ``^°``, ``^{°}`` and gensymb's ``\degree``) becomes ``^{\circ}``;
    - superscripts become powers (``x²`` is ``x^{2}``, ``10⁻³`` is ``10^{-3}``); a unit (mm to mi, units)
      before one goes in ``\text{}`` (``24 cm²`` is ``24 \text{cm}^{2}``), because math-verify drops a unit
      in ``\text{}`` but reads a bare ``cm^2`` as a product of variables;
    - ``√``, ``∛``, ``∜`` become ``\sqrt``, ``\sqrt[3]``, ``\sqrt[4]``, braced around what they apply to: a
      number, one letter, ``π``, or a parenthesised radicand (``2√3``, ``√12/2``, ``√(3+4)``); ``√{3}``
      keeps its braces.

    Only notation changes: an answer with another value stays another value. Pure, and linear in the length
    of ``text``; anything else (``∞``, ``≤``, letters) is left as it is.
    """
    text = "".join(_ascii_form(char) for char in text)
    text = _ZERO_WIDTH.sub("", _SPACES.sub(" ", _DIGIT_GROUP_SPACE.sub("", text)))
    text = _DEGREE.sub(r"^{\\circ}", text.translate(_SYMBOLS))
    text = _UNIT_BEFORE_SUPERSCRIPT.sub(r"\\text{\1}", text)
    text = _SUPERSCRIPT.sub(lambda match: "^{" + match.group().translate(_SUPERSCRIPT_DIGITS) + "}", text)
    return _latex_roots(text)


class _VerifierProcess:
    """One verifier subprocess; used by one thread at a time."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), _SERVE_VERIFIER_FLAG, str(timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._unread = b""
        try:
            ready = self._read_line(time.monotonic() + VERIFIER_STARTUP_TIMEOUT_S)
        except EOFError:
            ready = None
        if ready != b"ready":
            self.kill()
            raise RuntimeError(f"math-verify worker did not start; is it installed for {sys.executable}?")

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def verify(self, gold: str, answer: str) -> Verdict:
        """Verdict for one pair; kills the worker when it misses the deadline or dies."""
        deadline = time.monotonic() + self._timeout_s
        try:
            self._process.stdin.write(json.dumps({"gold": gold, "answer": answer}).encode() + b"\n")
            self._process.stdin.flush()
            line = self._read_line(deadline)
        except (BrokenPipeError, EOFError):
            # The worker died on this input (e.g. hit its memory or CPU cap): the answer cannot be processed.
            self.kill()
            return Verdict.ANSWER_UNPARSABLE
        if line is None:
            self.kill()
            return Verdict.TIMEOUT
        return Verdict(line.decode())

    def kill(self) -> None:
        self._process.kill()
        self._process.wait()
        self._process.stdin.close()
        self._process.stdout.close()

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the worker, None if the deadline passes first; EOFError if the worker exits."""
        fd = self._process.stdout.fileno()
        while b"\n" not in self._unread:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line


class _VerifierPool:
    """At most ``size`` verifier subprocesses, started on first use and replaced when killed; the process
    closes them at exit."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._free_slots = threading.BoundedSemaphore(size)
        self._idle: queue.SimpleQueue[_VerifierProcess] = queue.SimpleQueue()
        atexit.register(self.close)

    def verify(self, gold: str, answer: str) -> Verdict:
        with self._free_slots:
            worker = self._take_idle_worker() or _VerifierProcess(self._timeout_s)
            verdict = worker.verify(gold, answer)
            if worker.alive:
                self._idle.put(worker)
            return verdict

    def close(self) -> None:
        while (worker := self._take_idle_worker()) is not None:
            worker.kill()

    def _take_idle_worker(self) -> _VerifierProcess | None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return None
            if worker.alive:
                return worker
            worker.kill()  # reaps it and closes its pipes


# Set by the first reward_func call in this process (configured()), so that loading the file has no effects.
CONFIG: RewardConfig | None = None
_POOL: _VerifierPool | None = None
_CONFIGURING = threading.Lock()


def configured() -> tuple[RewardConfig, _VerifierPool]:
    """The configuration and the verifier pool, read and made by the first caller; every caller after it
    gets the same two (a setting changed later in the process is not seen)."""
    global CONFIG, _POOL
    with _CONFIGURING:
        if _POOL is None:
            config = RewardConfig.from_env()
            if importlib.util.find_spec("math_verify") is None:
                raise ImportError("rewards/math_answer.py needs math-verify: pip install math-verify")
            _POOL = _VerifierPool(config.verify_workers, config.verify_timeout_s)
            CONFIG = config
        return CONFIG, _POOL


def grade(query: str, prompt: str | None, label: object, config: RewardConfig, pool: _VerifierPool) -> Grade:
    """Accuracy verdict and format score for one sample."""
    response = extract_response(query, prompt)
    format_score = format_reward(response, config.answer_format)
    answer = extract_final_answer(response, config.answer_format)
    gold = gold_latex(label)
    if answer is None:
        return Grade(Verdict.NO_ANSWER, format_score)
    if gold is None:
        return Grade(Verdict.GOLD_UNPARSABLE, format_score)
    if len(answer) > MAX_ANSWER_CHARS:
        return Grade(Verdict.ANSWER_UNPARSABLE, format_score)
    return Grade(pool.verify(gold, f"\\boxed{{{answer}}}"), format_score)


def reward_func(queries: list[str], prompts: list[str], labels: list[object], **kwargs) -> dict:
    """OpenRLHF 0.11.2 reward entry point; see the module docstring for the contract."""
    # Imported here so the verifier subprocesses, which run this file, start without loading torch.
    import torch

    config, pool = configured()
    samples = zip(queries, prompts, labels, strict=True)
    grades = [grade(query, prompt, label, config, pool) for query, prompt, label in samples]
    count = max(len(grades), 1)

    def rate(verdicts: tuple[Verdict, ...]) -> float:
        return sum(g.verdict in verdicts for g in grades) / count

    rewards = [config.accuracy_weight * g.accuracy + config.format_weight * g.format_score for g in grades]
    return {
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "scores": torch.tensor([g.accuracy for g in grades], dtype=torch.float32),
        "extra_logs": {
            "math_accuracy": rate((Verdict.CORRECT,)),
            "math_format": sum(g.format_score for g in grades) / count,
            "math_no_answer": rate((Verdict.NO_ANSWER,)),
            "math_parse_failure": rate((Verdict.ANSWER_UNPARSABLE,)),
            "math_gold_parse_failure": rate((Verdict.GOLD_UNPARSABLE,)),
            "math_verify_timeout": rate((Verdict.TIMEOUT,)),
        },
    }


def _verify_pair(gold: str, answer: str) -> Verdict:
    """Runs in the verifier subprocess, where no deadline is needed: the parent enforces it."""
    from math_verify import parse, verify

    gold_parsed = parse(normalize_unicode_math(gold), parsing_timeout=None)
    answer_parsed = parse(normalize_unicode_math(answer), parsing_timeout=None)
    if gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=None):
        return Verdict.CORRECT
    # parse() falls back to the raw matched string when it cannot build an expression; verify() above still
    # accepts two identical strings, but a lone string on either side means math-verify did not understand it.
    if all(isinstance(parsed, str) for parsed in gold_parsed):
        return Verdict.GOLD_UNPARSABLE
    if all(isinstance(parsed, str) for parsed in answer_parsed):
        return Verdict.ANSWER_UNPARSABLE
    return Verdict.WRONG


def _serve_verifier(timeout_s: float) -> None:
    """Verifier subprocess loop: one JSON request per stdin line, one verdict per stdout line."""
    resource.setrlimit(resource.RLIMIT_AS, (VERIFIER_MEMORY_LIMIT_BYTES, VERIFIER_MEMORY_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Verdicts go out on a private copy of stdout; anything else that prints (from Python or C) lands on
    # stderr and cannot corrupt the protocol.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # math-verify warns that its own timeouts are off and logs every failed parse; both are expected here.
    logging.disable(logging.WARNING)
    import math_verify  # noqa: F401  # loaded before "ready" so the first request does not pay for it

    print("ready", file=channel, flush=True)
    for line in sys.stdin:
        # Kernel-enforced CPU budget for this request (SIGXCPU ends the process) in case the parent that
        # would kill us on the deadline has itself died.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu_budget = int(usage.ru_utime + usage.ru_stime + 2 * timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_budget, resource.RLIM_INFINITY))
        request = json.loads(line)
        try:
            verdict = _verify_pair(request["gold"], request["answer"])
        except Exception:  # math-verify swallows most errors itself; MemoryError/RecursionError can escape
            verdict = Verdict.ANSWER_UNPARSABLE
        print(verdict.value, file=channel, flush=True)


if __name__ == "__main__" and sys.argv[1:2] == [_SERVE_VERIFIER_FLAG]:
    _serve_verifier(timeout_s=float(sys.argv[2]))
