"""Name Python threads at the OS level too, so `top -H`, `ps -L`, py-spy and /proc show them.

Python before 3.14 names a thread only inside the interpreter. Linux copies a thread's name to the
threads it creates, so the engine loop's name also reaches the OpenMP workers it starts: a profile
can then split a process's CPU into the engine (loop + OpenMP team), the response sender and the rest
(`benchmarks/bench_triton_cost.py` does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15  # linux/prctl.h
KERNEL_WORKER_NAME = "tritonllm-kern"  # the CPU kernels' worker threads (csrc/thread_pool.h names them)
OS_NAME_BYTES = 15  # the kernel keeps 16 bytes with the terminating NUL


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_LIBC = _libc()


def name_current_thread(name: str | None = None) -> bool:
    """Give the calling thread `name` (default: its Python name), cut to 15 bytes; False if not possible."""
    if _LIBC is None:
        return False
    raw = (name or threading.current_thread().name).encode()[:OS_NAME_BYTES]
    return _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
