"""Helpers shared by the build tests: build engines from a copy of a checkpoint, compare greedy outputs."""

from __future__ import annotations

import shutil
from pathlib import Path

from tritonllm.build.builder import build
from tritonllm.build.options import BuildOptions


def build_without_source(src: Path, root: Path, quantizations: list[str], **options) -> dict[str, Path]:
    """Build each quantization from a copy of `src`, then delete the copy: the engines must stand alone."""
    copy = root / "checkpoint"
    shutil.copytree(src, copy)
    engines = {
        q: build(
            BuildOptions(model=str(copy), output=str(root / q), backend="torch", quantization=q, **options)
        )
        for q in quantizations
    }
    shutil.rmtree(copy)
    return engines


def agreement_before_divergence(got: list[list[int]], expected: list[list[int]]) -> float:
    """Mean fraction of tokens generated before the first one that differs from the reference."""
    fractions = []
    for g, e in zip(got, expected, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(g, e, strict=False)) if a != b), min(len(g), len(e)))
        fractions.append(same / len(e))
    return sum(fractions) / len(fractions)
