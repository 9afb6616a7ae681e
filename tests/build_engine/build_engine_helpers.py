"""Helpers shared by the build tests: build engines from a copy of a checkpoint, compare greedy outputs."""

from __future__ import annotations

import shutil
from pathlib import Path

from tritonllm.builder.builder import build
from tritonllm.builder.options import BuildOptions


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
