"""The AMX bf16 tile loop alone, on one core: where its loads sit and where its buffers lie.

One k-step of a 2 x 2 block (tiles 0-3 sums, 4-5 activations, 6-7 weights), repeated over buffers in L1:

  no loads     4 tdpbf16ps on tiles already loaded: the products' own rate
  up front     4 tile loads, then the 4 products (amx::Bf16Tiles before 2026-12-06)
  interleaved  each tile loaded right before its first product (amx::Bf16Tiles now)

each with its buffers on a 64-byte line and 16 bytes off one (where malloc leaves a std::vector): a 64-byte
tile row off a line reads two lines. Paired medians over rounds, every variant once a round.

    .venv/bin/python benchmarks/bench_amx_tiles.py            # ~1 min with the build, on a CPU with AMX

Prints TFLOPS on one core (16 x 16 x 32 multiply-adds a product) and the CPU flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torch.utils.cpp_extension import load_inline  # noqa: E402

from tritonllm.model.cpu_kernels import amx_permitted, cpu_flags  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
#include <ctime>

namespace {
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

// Runs `steps` k-steps of `mode` (0 no loads, 1 loads up front, 2 interleaved) over 4 KB of activations and
// 4 KB of weights starting `offset` bytes past a 64-byte line; returns seconds.
double tile_loop(int64_t steps, int64_t mode, int64_t offset) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  auto* block = static_cast<uint8_t*>(std::aligned_alloc(64, 2 * 4096 + 128));
  for (int i = 0; i < 2 * 4096 + 128; ++i) block[i] = (i % 2) ? 0x3f : 0x80;  // bf16 1.0
  const uint8_t* a = block + offset;
  const uint8_t* b = block + 4096 + 64 + offset;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);  // literal tile numbers, not a loop
  _tile_loadd(4, a, 64); _tile_loadd(5, a + 1024, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b + 1024, 64);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t at = (i & 1) * 2048;  // two sets of operands, alternating
    if (mode == 1) {
      _tile_loadd(4, a + at, 64); _tile_loadd(5, a + at + 1024, 64);
      _tile_loadd(6, b + at, 64); _tile_loadd(7, b + at + 1024, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    } else if (mode == 2) {
      _tile_loadd(4, a + at, 64); _tile_loadd(6, b + at, 64); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + at + 1024, 64); _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + at + 1024, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
  }
  float sums[256];
  _tile_stored(0, sums, 64);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  _tile_release();
  std::free(block);
  return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec) + 0.0 * sums[0];
}
"""

MODES = {"no loads": 0, "up front": 1, "interleaved": 2}
MACS_PER_STEP = 4 * 16 * 16 * 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=2_000_000, help="k-steps a measurement")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    flags = cpu_flags()
    if "amx_bf16" not in flags or not amx_permitted():
        print("this CPU (or kernel) gives no AMX tiles: nothing to measure")
        return 0
    module = load_inline(
        "tritonllm_bench_amx_tiles",
        cpp_sources=SOURCE,
        functions=["tile_loop"],
        extra_cflags=["-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f"],
    )
    variants = [(mode, offset) for mode in MODES for offset in (0, 16)]
    for mode, offset in variants:
        module.tile_loop(args.steps // 10, MODES[mode], offset)  # warm-up
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for mode, offset in variants if r % 2 == 0 else variants[::-1]:
            times[(mode, offset)].append(module.tile_loop(args.steps, MODES[mode], offset))
    shown = " ".join(f for f in flags if f.startswith(("amx", "avx512")))
    print(f"CPU flags: {shown}; load average {os.getloadavg()}")
    for mode, offset in variants:
        seconds = statistics.median(times[(mode, offset)])
        where = "on a line" if offset == 0 else f"{offset} bytes off a line"
        print(f"{mode:12s} buffers {where:22s} {2 * MACS_PER_STEP * args.steps / seconds / 1e12:5.2f} TFLOPS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
