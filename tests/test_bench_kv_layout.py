"""bench_kv_layout.py's loader of another tree's KV manager: its own pool class, nothing left swapped."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_kv_layout import other_kv_module  # noqa: E402

import tritonllm.engine.block_pool  # noqa: E402
import tritonllm.engine.kv_cache_manager  # noqa: E402


def test_other_tree_s_manager_runs_over_that_tree_s_pool_and_this_tree_s_modules_stay():
    before = {
        name: sys.modules[name]
        for name in ("tritonllm.engine.block_pool", "tritonllm.engine.kv_cache_manager")
    }
    other = other_kv_module(BENCH.parent)
    manager = other.KVCacheManager(num_blocks=4, tokens_per_block=2)
    assert type(manager.pool) is not tritonllm.engine.block_pool.BlockPool
    assert type(manager.pool).__module__ == "tritonllm.engine.block_pool"  # loaded from that tree's file
    assert other.KVCacheManager is not tritonllm.engine.kv_cache_manager.KVCacheManager
    assert {name: sys.modules[name] for name in before} == before
