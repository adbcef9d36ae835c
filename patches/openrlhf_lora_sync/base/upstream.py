"""Facts about the installed vLLM read from its source, without importing it.

A recipe is checked before anything heavy is imported (recipe.py: no torch, vLLM, Ray or DeepSpeed, so a
dry run takes a second and works where those cannot load); what it needs to know of vLLM is read here
from vLLM's files, located with importlib's finder (which runs no package code).

Covers: the max_lora_rank values vLLM's LoRAConfig accepts (adapter sync mode's rank limit).
Does not cover: anything decided at run time (devices, kernels); tests/sync/test_adapter_mode.py checks the
value read here against vLLM's own type hints.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def vllm_lora_ranks() -> tuple[int, ...]:
    """The max_lora_rank values the installed vLLM's LoRAConfig accepts, read from its source (the Literal
    its field is annotated with) so that recipe checks need no vLLM import (seconds, CUDA probing); () when
    vLLM is not installed or the source no longer has that shape."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ()
    path = Path(next(iter(spec.submodule_search_locations))) / "config" / "lora.py"
    try:
        tree = ast.parse(path.read_text())
    except OSError:
        return ()
    aliases = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "max_lora_rank":
            annotation = node.annotation
            if isinstance(annotation, ast.Name):
                annotation = aliases.get(annotation.id)
            if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Literal":
                values = annotation.slice
                values = values.elts if isinstance(values, ast.Tuple) else [values]
                return tuple(sorted(v.value for v in values if isinstance(v, ast.Constant)))
    return ()
