"""Throughput and worst-case latency of rewards/math_answer.py, called the way OpenRLHF 0.11.2 calls it.

Prints samples/second on a seeded, realistic mix of Qwen-VL rollouts (right and wrong answers in several
LaTeX forms, long reasoning, missing and truncated answers, several boxes), once from one thread and once
with many concurrent ``asyncio.to_thread`` calls like the vLLM actor makes; then the latency of each
adversarial case (pathological expressions, megabyte responses, brace bombs). The REWARD_* environment
variables apply as in training (openrlhf_lora_sync.base.settings; REWARD_VERIFY_TIMEOUT_S bounds the
pathological cases); a bad value exits 2 with one line naming it.
Does not cover: other reward files, whether the grades are right (tests/inputs/test_rewards.py), or the engine
actor around the calls; it asserts nothing on time.
"""

import argparse
import asyncio
import random
import statistics
import sys
import time

from openrlhf_lora_sync.base.settings import SettingError
from rewards.math_answer import PROMPT_INSTRUCTIONS, configured, reward_func

# (label, forms of a right final answer, a wrong final answer)
PROBLEMS = [
    ("5", ["5", "5.0", "\\frac{10}{2}", "x = 5"], "6"),
    ("3\\sqrt{3}", ["3\\sqrt{3}", "\\sqrt{27}", "5.196152", "3√3", "√27"], "5.2"),
    ("\\frac{40}{3}", ["\\frac{40}{3}", "40/3", "13\\frac{1}{3}"], "13.3"),
    ("60", ["60", "60^\\circ", "60 degrees", "60°"], "120"),
    ("14\\pi", ["14\\pi", "14 \\pi", "14π cm²"], "43.98"),
    ("12.5", ["12.5", "\\frac{25}{2}", "12\\frac{1}{2}"], "12"),
    ("2\\sqrt{221}", ["2\\sqrt{221}", "\\sqrt{884}"], "29.7"),
]
REASONING = "By the Pythagorean theorem, the hypotenuse squared equals the sum of the squared legs. "

# Adversarial responses: (name, response, label).
ADVERSARIAL = [
    ("power tower 9^9^9^9", "So \\boxed{9^{9^{9^{9}}}}", "5"),
    ("10^(10^10)", "So \\boxed{10^{10^{10}}}", "5"),
    ("factorial of a googol", "So \\boxed{(10^{100})!}", "5"),
    ("improper integral", "So \\boxed{\\int_0^\\infty e^{-x^{x^x}} dx}", "5"),
    ("150 nested parentheses", "So \\boxed{" + "(" * 150 + "1" + ")" * 150 + "}", "1"),
    ("2 MB of reasoning", REASONING * 24_000 + "\\boxed{5}", "5"),
    ("2 MB of unclosed boxes", "\\boxed{" * 300_000, "5"),
    ("1000-char answer", "So \\boxed{" + "1+" * 499 + "1}", "500"),
]


def qwen_query(response: str) -> tuple[str, str]:
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|image_pad|><|vision_end|>Find x.\n\n{PROMPT_INSTRUCTIONS['boxed']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return prompt.replace("<|image_pad|>", "<|image_pad|>" * 256) + response + "<|im_end|>", prompt


def realistic_mix(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(query, prompt, label) rollouts in roughly the proportions an early GRPO run produces."""
    generator = random.Random(seed)
    samples = []
    for _ in range(count):
        label, right_forms, wrong = generator.choice(PROBLEMS)
        reasoning = REASONING * generator.randint(1, 40)
        kind = generator.random()
        if kind < 0.45:
            response = f"{reasoning}So the answer is \\boxed{{{generator.choice(right_forms)}}}."
        elif kind < 0.75:
            response = f"{reasoning}So the answer is \\boxed{{{wrong}}}."
        elif kind < 0.85:
            response = f"{reasoning}So the answer is {generator.choice(right_forms)}."
        elif kind < 0.95:
            response = f"{reasoning}So the answer is \\boxed{{{generator.choice(right_forms)[:2]}"
        else:
            response = f"{reasoning}Maybe \\boxed{{{wrong}}}, no: \\boxed{{{generator.choice(right_forms)}}}"
        samples.append((*qwen_query(response), label))
    return samples


def sequential(samples) -> float:
    start = time.perf_counter()
    for query, prompt, label in samples:
        reward_func([query], [prompt], [label])
    return len(samples) / (time.perf_counter() - start)


def concurrent(samples, concurrency: int) -> float:
    async def run() -> None:
        limit = asyncio.Semaphore(concurrency)

        async def one(query, prompt, label):
            async with limit:
                await asyncio.to_thread(reward_func, [query], [prompt], [label])

        await asyncio.gather(*(one(*sample) for sample in samples))

    start = time.perf_counter()
    asyncio.run(run())
    return len(samples) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2000, help="rollouts in the realistic mix")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent asyncio.to_thread calls")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    try:
        config, _ = configured()
    except SettingError as error:
        print(f"bench_reward: {error}", file=sys.stderr)
        return 2
    print(
        f"config: timeout {config.verify_timeout_s}s, {config.verify_workers} verifier workers, "
        f"format {config.answer_format!r}"
    )
    samples = realistic_mix(args.samples, args.seed)
    start = time.perf_counter()
    reward_func(*([value] for value in samples[0]))
    print(f"first call (starts a verifier worker): {time.perf_counter() - start:.3f}s")
    print(f"realistic mix, 1 thread:  {sequential(samples):8.1f} samples/s ({len(samples)} samples)")
    rate = concurrent(samples, args.concurrency)
    print(f"realistic mix, {args.concurrency} concurrent to_thread calls: {rate:8.1f} samples/s")

    latencies = []
    for name, response, label in ADVERSARIAL:
        query, prompt = qwen_query(response)
        start = time.perf_counter()
        logs = reward_func([query], [prompt], [label])["extra_logs"]
        latencies.append(time.perf_counter() - start)
        flags = [key for key, value in logs.items() if value and key not in ("math_accuracy", "math_format")]
        print(f"adversarial {name:28s} {latencies[-1]:7.3f}s  {', '.join(flags) or 'graded'}")
    print(f"adversarial worst case: {max(latencies):.3f}s, median {statistics.median(latencies):.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
