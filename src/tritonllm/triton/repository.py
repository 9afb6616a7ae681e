"""Render the model repository: `model_repository/` templates filled from `LaunchOptions`.

The repository is precompiled (`compileall`) so the stubs do not write `__pycache__` into version
folders, which Triton could take for a change and reload.
"""

from __future__ import annotations

import compileall
import os
import shutil
from pathlib import Path
from string import Template

from tritonllm.triton.options import LaunchOptions

MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
ENGINE_MODEL = "tensorrt_llm"
MARKER = ".tritonllm-repository"


def templates_dir() -> Path:
    """`model_repository/` of the source tree (or `$TRITONLLM_MODEL_REPOSITORY`)."""
    env = os.environ.get("TRITONLLM_MODEL_REPOSITORY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "model_repository"


def render_repository(dest: Path, options: LaunchOptions, templates: Path | None = None) -> Path:
    """Fill the templates' `${...}` placeholders into `dest` and precompile the Python files."""
    templates = templates or templates_dir()
    values = options.template_values()
    if dest.exists() and any(dest.iterdir()):
        if not (dest / MARKER).exists():
            raise FileExistsError(f"{dest} is not empty and was not rendered by tritonllm: not replacing it")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).write_text("rendered by `tritonllm launch`; replaced on every launch\n")
    for model in MODELS:
        src = templates / model
        out = dest / model
        (out / "1").mkdir(parents=True)
        config = Template((src / "config.pbtxt").read_text()).substitute(values)
        (out / "config.pbtxt").write_text(config)
        for path in (src / "1").glob("*.py"):
            shutil.copy2(path, out / "1" / path.name)
    if not compileall.compile_dir(str(dest), quiet=1):
        raise RuntimeError(f"could not compile the model repository in {dest}")
    return dest
