"""csrc/thread_pool.h: the CPU kernels' own worker threads. Loops from two threads at once, a forked child
and an idle engine must all work as with OpenMP: the same results to the bit, no hang, no CPU burnt."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tritonllm.engine import model_runner
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.model.cpu_kernels import load_kernels
from tritonllm.model.quant import quantize_int8_blocks
from tritonllm.os_threads import KERNEL_WORKER_NAME

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no CPU kernels on this machine")


@contextlib.contextmanager
def pooled(threads: int = 2) -> Iterator[None]:
    """The calling thread's kernels on the pool, as the engine's steps run them."""
    load_kernels().use_thread_pool(threads)
    try:
        yield
    finally:
        load_kernels().use_thread_pool(0)


def int8_case(seed: int, tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(tokens, 96, generator=gen), torch.randn(4000, 96, generator=gen)
    return x, load_kernels().int8_pack(*quantize_int8_blocks(w))


def worker_cpu_s() -> tuple[int, float]:
    """How many kernel worker threads this process has, and the CPU seconds they have spent."""
    count, ticks = 0, 0
    for task in glob.glob(f"/proc/{os.getpid()}/task/[0-9]*"):
        try:
            with open(f"{task}/comm") as f:
                if f.read().rstrip("\n") != KERNEL_WORKER_NAME:
                    continue
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        count += 1
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return count, ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("tokens", [3, 16, 40])
def test_two_threads_running_kernels_at_once_get_their_own_results(tokens: int) -> None:
    """One thread's loop holds the pool; another thread's loop at the same moment runs on OpenMP instead of
    waiting or mixing its items into the first one's. 16 and 40 tokens take the amx build's tile paths
    (int8 tiles from 16, widened bf16 tiles from 32), whose tile configuration each thread loads itself."""
    kernels = load_kernels()
    cases = [int8_case(seed, tokens) for seed in (1, 2)]
    expected = [kernels.int8_linear(x, packed) for x, packed in cases]
    mismatches: list[int] = []

    def run(i: int) -> None:
        x, packed = cases[i]
        with pooled():
            for _ in range(300):
                if not torch.equal(kernels.int8_linear(x, packed), expected[i]):
                    mismatches.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert mismatches == []


def _child(x: torch.Tensor, packed: torch.Tensor, queue: multiprocessing.Queue) -> None:
    with pooled():
        result = load_kernels().int8_linear(x, packed).tolist()  # plain data: a tensor would share memory
    queue.put((result, worker_cpu_s()[0]))


def test_a_forked_child_runs_the_kernels() -> None:
    """A fork copies the pool but not its threads (nor the state of its locks): the child makes a pool of its
    own, with workers of its own, and computes what the parent does."""
    x, packed = int8_case(3)
    with pooled():
        expected = load_kernels().int8_linear(x, packed)  # the parent's pool exists and has workers
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(x, packed, queue))
    child.start()
    try:
        got, workers = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert got == expected.tolist()
    assert workers == 1


def test_idle_workers_sleep() -> None:
    """Workers spin (yielding) for new loops only briefly, then sleep: an idle engine takes no CPU."""
    x, packed = int8_case(4)
    with pooled():
        load_kernels().int8_linear(x, packed)
    workers, _ = worker_cpu_s()
    assert workers >= 1
    time.sleep(0.1)  # well past the 2 ms they spin before sleeping
    _, before = worker_cpu_s()
    time.sleep(0.5)
    _, after = worker_cpu_s()
    assert after - before <= 0.05  # 10 ms ticks: asleep, not spinning through the half second


def test_a_pooled_thread_runs_pytorch_ops_alone_until_it_leaves_the_pool() -> None:
    """OpenMP's threads would spin beside the pool's workers for their cores: while a thread uses the pool,
    PyTorch's own ops run on it alone; leaving the pool gives it PyTorch's threads back."""
    before = torch.get_num_threads()
    with pooled(3):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="0 to 64 threads"):
        load_kernels().use_thread_pool(65)


@pytest.mark.parametrize("blas_rows", [3, 4])
def test_an_lm_head_on_pytorchs_gemm_keeps_pytorchs_threads(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, blas_rows: int
) -> None:
    """An int8 step runs on the pool, where PyTorch's ops get one thread; a step sampling as many rows as send
    the lm_head to PyTorch's GEMM (the runner's BLAS_MIN_TOKENS, lowered here to 3 rows, or to 4 so that the
    same steps stay on the pool) runs on OpenMP instead, so that GEMM gets every thread."""
    monkeypatch.setattr(model_runner, "BLAS_MIN_TOKENS", blas_rows)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), quantization="int8", num_threads=2))
    threads_in_lm_head: list[int] = []
    engine.runner.model.lm_head.register_forward_hook(
        lambda *_: threads_in_lm_head.append(torch.get_num_threads())
    )
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
    # One prefill step of the 3 prompts, then one decode step of the 3 requests: 3 sampled rows each.
    assert threads_in_lm_head == ([1, 1] if blas_rows > 3 else [2, 2])
