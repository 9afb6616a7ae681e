"""C++ kernels for the CPU (paged attention, int8/bf16 linears, fused layer ops), built on first use, cached.

One build per instruction set, chosen at run time from the CPU's capability and flags (never
`-march=native`: a cache or an image may move to another CPU). `TRITONLLM_CPU_ISA=generic|avx2|avx512|
avx512_vnni|avx512_bf16|amx` forces a variant (the tests use it for the portable path);
`TRITONLLM_DISABLE_KERNELS=1` or a missing compiler falls back to PyTorch (attention) or to dequantized
weights (linears). With AVX512_BF16, bf16 weights are packed for the kernels' vdpbf16ps path
(bf16_packed_linear.cpp); the amx build (Xeons from Sapphire Rapids on, where Linux grants the tiles) runs the
same packed bf16 weights and the int8/int4 tiles on AMX from a few tokens on (amx.h). oneDNN's bf16 GEMM only
runs where `TRITONLLM_ONEDNN_BF16_MIN_TOKENS=N` asks for it, or on an AMX CPU without the amx build
(`ONEDNN_BF16_MIN_TOKENS`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).with_name("csrc")
# bindings.cpp includes the others (one translation unit); all of them are hashed into the build's name.
SOURCES = [
    CSRC / "bindings.cpp",
    *sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h") and p.name != "bindings.cpp"),
]
# Compiler flags per variant; a variant runs only on CPUs whose capability includes it.
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
AVX512_FLAGS = [*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
ISA_FLAGS = {
    "generic": [],
    "avx2": AVX2_FLAGS,
    "avx512": AVX512_FLAGS,
    "avx512_vnni": [*AVX512_FLAGS, "-mavx512vnni"],
    "avx512_bf16": [*AVX512_FLAGS, "-mavx512vnni", "-mavx512bf16"],
    "amx": [*AVX512_FLAGS, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}
# Builds with AVX512_BF16's vdpbf16ps paths (amx adds tiles on top).
NATIVE_BF16_ISAS = ("amx", "avx512_bf16")
CAPABILITY_ISAS = {"AVX512": ["avx512", "avx2", "generic"], "AVX2": ["avx2", "generic"]}
# Variants that need flags beyond torch's capability level (which stops at AVX-512F/BW/VL/DQ), best first.
FLAG_ISAS = {
    "amx": ("AVX512", {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}),
    "avx512_bf16": ("AVX512", {"avx512_vnni", "avx512_bf16"}),
    "avx512_vnni": ("AVX512", {"avx512_vnni"}),
}


def cpu_flags() -> list[str]:
    """The SIMD-related flags of this CPU (for logs and benchmark reports)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return [platform.machine()]
    line = next((row for row in text.splitlines() if row.startswith(("flags", "Features"))), "")
    wanted = ("avx", "fma", "f16c", "amx", "vnni", "sve", "neon", "asimd")
    return sorted({f for f in line.split(":", 1)[-1].split() if f.startswith(wanted)})


def supported_isas() -> list[str]:
    """Variants this CPU can run, best first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    capability = torch.backends.cpu.get_cpu_capability()
    flags = set(cpu_flags())
    extra = [isa for isa, (level, needed) in FLAG_ISAS.items() if capability == level and needed <= flags]
    if "amx" in extra and not amx_permitted():
        extra.remove("amx")
    return extra + CAPABILITY_ISAS.get(capability, ["generic"])


SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1023, 18  # asm/prctl.h; the tile data's state component


@cache
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX tiles (it asks: arch_prctl, once a process, Linux 5.16 on)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def selected_isa() -> str:
    forced = os.environ.get("TRITONLLM_CPU_ISA")
    if forced:
        if forced not in supported_isas():
            raise RuntimeError(f"TRITONLLM_CPU_ISA={forced}: this CPU runs only {supported_isas()}")
        return forced
    return supported_isas()[0]


# From how many tokens bf16 linears take oneDNN's GEMM, by the CPU's native bf16 (AMX first: its CPUs have
# AVX512_BF16 too). On a Xeon with AMX (bench_kernels.py, 1 thread) the GEMM took 35 ms over SmolLM2's layers
# at 32 tokens, 56 at 128 and 146 at 512 against the kernel's 137, 508 and 1961 on fp32 activations. On a Zen
# 4 EPYC (AVX512_BF16, no AMX; bench_bf16_gemm.py, 2 threads, bf16 activations) the kernel's 4 x 4 dot tiles
# took 0.53-0.73 of the GEMM's time at 16-64 tokens, about the same at 96-192 and 1.06-1.14x at 256-512, so
# the GEMM took 128 tokens on; the packed kernel (bench_bf16_packed.py) then beat it at 128-512 too: no GEMM.
# Without native bf16 (AVX2, or AVX-512 before BF16) oneDNN converts, and the kernels were 1.8-3.7x faster
# from 8 tokens on (the Zen 4 with oneDNN capped at those instruction sets): no GEMM there. The amx build's
# own tiles took 0.28-0.90 of the GEMM's time at 1-512 tokens (SmolLM2's and 1B shapes, 2 threads, a 2-core
# Xeon with AMX, 2026-12-06): no GEMM there either; the entry below is for AMX CPUs on the avx512_bf16 build.
ONEDNN_BF16_MIN_TOKENS = {"amx_bf16": 16}


def onednn_bf16_min_tokens(isa: str | None = None) -> int:
    """From how many tokens bf16 linears take oneDNN's GEMM with the `isa` build (default: this CPU's best;
    ONEDNN_BF16_MIN_TOKENS), 0 for never: the amx build's own tiles beat it at every size."""
    forced = os.environ.get("TRITONLLM_ONEDNN_BF16_MIN_TOKENS")
    if forced is not None:
        if not forced.isdigit():
            raise RuntimeError(f"TRITONLLM_ONEDNN_BF16_MIN_TOKENS={forced}: a number of tokens, 0 for never")
        return int(forced)
    if (isa or selected_isa()) == "amx" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    flags = set(cpu_flags())
    return next((tokens for flag, tokens in ONEDNN_BF16_MIN_TOKENS.items() if flag in flags), 0)


BUILD_WAIT_S = 900.0  # another process's build of the same variant: a few minutes on a busy 2-core machine


@contextlib.contextmanager
def exclusive_build(name: str, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """One build of `name` at a time across processes, under an OS lock that dies with its holder.

    torch's own lock is a plain file: a build killed midway (a server stopped during its first start)
    leaves it behind, and every later load waits on it forever. Holding this lock proves no live process
    is building, so a torch lock found then is stale and removed.
    """
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "tritonllm.lock", "w") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has built {name} for {wait_s:.0f}s") from None
                time.sleep(0.5)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def use_pinned_ninja() -> None:
    """Put the `ninja` package's binary (a pinned dependency) first on PATH, in every process.

    Ninja keeps a hash of each command it ran, and two ninja versions hash the same command differently:
    with the system's ninja first on one process's PATH (a plain `.venv/bin/python`) and the venv's on
    another's (Triton's stub), each rebuilt the other's kernels (~25 s) and replaced a loaded library.
    """
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if shutil.which("ninja", path=bin_dir) and not path.startswith(bin_dir + os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


@cache
def load_kernels(isa: str | None = None) -> ModuleType | None:
    """The compiled extension for `isa` (default: the best this CPU runs), or None when it can't be built."""
    if os.environ.get("TRITONLLM_DISABLE_KERNELS") == "1":
        return None
    isa = isa or selected_isa()
    if isa == "amx" and not amx_permitted():
        log.warning("CPU kernels unavailable (the OS refused this process AMX tiles); using the PyTorch path")
        return None
    use_pinned_ninja()
    try:
        from torch.utils.cpp_extension import load

        # One build per variant, sources and torch install, shared by every process that imports that
        # torch (Triton's stub too: use_pinned_ninja). The compile command names torch's headers, so two
        # venvs sharing the build folder under one name would rebuild each other's library.
        # The name carries the sources' hash: torch only watches the listed file for changes.
        install = hashlib.sha1(str(Path(torch.__file__).parent).encode()).hexdigest()[:8]
        sources = hashlib.sha1(b"".join(s.read_bytes() for s in SOURCES)).hexdigest()[:8]
        name = f"tritonllm_cpu_{isa}_{install}_{sources}"
        with exclusive_build(name):
            module = load(
                name=name,
                sources=[str(SOURCES[0])],
                extra_cflags=["-O3", "-fopenmp", "-ffast-math", *ISA_FLAGS[isa]],  # fast-math: vector expf
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 -- any build failure means: use the PyTorch path
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None
    module.set_onednn_bf16_min_tokens(onednn_bf16_min_tokens(isa))
    log.info(
        "CPU kernels: %s build, bf16 linears through oneDNN from %s tokens (CPU flags: %s)",
        isa,
        module.onednn_bf16_min_tokens() or "no number of",
        " ".join(cpu_flags()),
    )
    return module
