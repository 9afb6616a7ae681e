"""A small C++ kernel for decode attention on CPU, compiled on first use and cached.

PyTorch alone must gather each sequence's blocks into a padded copy before two batched matmuls,
which read the KV several times; the kernel reads it once, in place. Where it cannot be built
(no compiler) or on other devices, the engine falls back to the PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"


@cache
def load_paged_attention():
    """The compiled extension module, or None when it can't be built here (logged once)."""
    if os.environ.get("TRITONLLM_DISABLE_KERNELS") == "1":
        return None
    scripts = sysconfig.get_path("scripts")  # the venv's bin, where pip put ninja
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        # One build per interpreter: Triton's Python stub and a plain Python hash the build
        # differently, and a shared folder made each rebuild it (~45 s) in turn.
        interpreter = hashlib.sha1(sys.executable.encode()).hexdigest()[:8]
        return load(
            name=f"tritonllm_paged_attention_{interpreter}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],  # fast-math: vector expf
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 -- any build failure means: use the PyTorch path
        log.warning("paged attention kernel unavailable (%s); using the PyTorch path", exc)
        return None
