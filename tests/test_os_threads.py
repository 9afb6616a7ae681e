"""OS-level thread names: what `top -H`, py-spy and the Triton cost benchmark group CPU time by."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tritonllm.os_threads import OS_NAME_BYTES, name_current_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read back from /proc")


def os_thread_name(thread: threading.Thread) -> str:
    return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()


def run_in_thread(python_name: str, os_name: str | None) -> tuple[bool, str]:
    """Name a fresh thread from inside it; (the call's result, its OS name) read while it still runs."""
    named, release = threading.Event(), threading.Event()
    result: list[bool] = []

    def body() -> None:
        result.append(name_current_thread(os_name))
        named.set()
        release.wait(10)

    thread = threading.Thread(target=body, name=python_name)
    thread.start()
    try:
        assert named.wait(10)
        return result[0], os_thread_name(thread)
    finally:
        release.set()
        thread.join(10)


def test_a_thread_takes_its_python_name_cut_to_the_kernel_limit() -> None:
    ok, name = run_in_thread("tritonllm-a-long-thread-name", None)
    assert ok and name == "tritonllm-a-long-thread-name"[:OS_NAME_BYTES] == "tritonllm-a-lon"


def test_an_explicit_name_wins_over_the_python_name() -> None:
    assert run_in_thread("python-name", "os-name") == (True, "os-name")
