// AMX tiles (the amx build: Xeons from Sapphire Rapids on). The kernels use the eight tile registers as
// four sums (tiles 0-3: bf16's 2 groups of 16 tokens x 2 weight tiles, int8's 4 blocks of inputs), two
// activation tiles (4, 5) and two weight tiles (6, 7). The packed weight layouts (bf16_pack's, and the VNNI builds' int8 tiles) are already what a
// weight tile loads: 64-byte rows, one per pair (bf16) or quad (int8) of inputs, each 16 output rows wide.
// Linux hands a process AMX state only on request (arch_prctl, once a process): cpu_kernels.py asks before
// it picks this build, and a CPU or kernel that refuses runs the avx512_bf16 build instead.
#pragma once
#include <algorithm>
#include <cstdint>

#include "simd.h"

#ifdef TRITONLLM_AMX
namespace amx {

// The palette-1 tile configuration ldtilecfg loads (Intel SDM, "Tile configuration"): bytes a row and rows
// of each tile register.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles for `rows0` and `rows1` tokens (1-16 each; a block of up to 32) whose activation rows are
// `activation_bytes` long (one block of inputs), against weight tiles of `weight_rows` 64-byte rows.
inline void configure(int rows0, int rows1, int activation_bytes, int weight_rows) {
  TileConfig config;
  const int groups[2] = {rows0, rows1};
  for (int g = 0; g < 2; ++g) {  // a group of no tokens leaves its tiles unconfigured (rows and width 0)
    const bool used = groups[g] > 0;
    config.rows[2 * g] = config.rows[2 * g + 1] = config.rows[4 + g] = groups[g];
    config.colsb[2 * g] = config.colsb[2 * g + 1] = used ? 64 : 0;  // 16 fp32 or int32 sums a token
    config.colsb[4 + g] = used ? activation_bytes : 0;
  }
  config.colsb[6] = config.colsb[7] = 64;
  config.rows[6] = config.rows[7] = weight_rows;
  _tile_loadconfig(&config);
}

// GCC 12's _tile_loadd is an asm statement that names no memory operand, so the compiler may move or drop stores
// to a buffer that only tile loads read (it dropped a local buffer's stores outright: the tiles loaded garbage).
// Call this between writing such a buffer and loading it into tiles.
inline void stores_before_tile_loads() { __asm__ volatile("" ::: "memory"); }

constexpr int64_t kBf16Inputs = 32;  // inputs a bf16 weight tile holds: 16 pairs, activation rows of 64 bytes

// Products of bf16 activations with pairs of weight tiles in bf16_pack's layout (16 rows; for each pair of
// inputs, the rows' two weights side by side: tdpbf16ps's weight tile as it lies, 16 pairs a tile), 32 tokens
// at a time: tiles 0-3 hold the sums of 2 token groups x 2 weight tiles over a span of inputs.
class Bf16Tiles {
 public:
  // emit(token, j, sums) for tokens [0, m) of x (bf16 rows of k inputs, k a multiple of 32) and weight tiles
  // j < count (1 or 2: w0, w1, each k / 2 pairs x 16 rows): sums lane r = row r's dot product with the token.
  // The weights are read once per span of inputs (input_span) and stay in L1 while the tokens go by; across
  // spans, each block's sums wait in partial_sums. beside() runs after each block of 32 tokens' tile
  // instructions are issued (once per span): vector work there (which must not touch x, w0, w1) runs while
  // the tiles multiply.
  template <typename Emit, typename Beside = void (*)()>
  void multiply(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w0, const uint16_t* w1, int count, Emit emit,
                Beside beside = [] {}) {
    const int64_t span = input_span(m, k);
    thread_local simd::LineVector<float> partial_sums;
    if (span < k && static_cast<int64_t>(partial_sums.size()) < (m + 31) / 32 * kBlockSums)
      partial_sums.resize((m + 31) / 32 * kBlockSums);
    for (int64_t from = 0; from < k; from += span) {
      const int64_t to = std::min(k, from + span);
      for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, m - m0)), rows0 = std::min(rows, 16);
        if (rows != configured_) {  // the last block of tokens may be short
          configure(rows0, rows - rows0, 2 * kBf16Inputs, kBf16Inputs / 2);
          configured_ = rows;
        }
        float* partial = span < k ? partial_sums.data() + m0 / 32 * kBlockSums : nullptr;
        const Span inputs{x + m0 * k, k, from, to, from > 0 ? partial : nullptr, to < k ? partial : sums_};
        if (rows > 16) {
          if (count == 2) block<true, true>(inputs, w0, w1, beside);
          else block<true, false>(inputs, w0, w1, beside);
        } else {
          if (count == 2) block<false, true>(inputs, w0, w1, beside);
          else block<false, false>(inputs, w0, w1, beside);
        }
        if (to < k) continue;
        for (int j = 0; j < count; ++j)
          for (int i = 0; i < rows; ++i) emit(m0 + i, j, _mm512_load_ps(sums_ + ((i / 16) * 2 + j) * 256 + (i % 16) * 16));
      }
    }
  }

  // How many times multiply(x, m, k, ...) calls beside().
  static int64_t beside_calls(int64_t m, int64_t k) {
    const int64_t span = input_span(m, k);
    return (m + 31) / 32 * ((k + span - 1) / span);
  }

  ~Bf16Tiles() { _tile_release(); }  // a thread holding no tile state saves and restores less at every switch

 private:
  static constexpr int64_t kBlockSums = 4 * 16 * 16;  // a block's sum tiles: [token group x 2 + weight tile][16][16]

  // Inputs taken a span at a time: a pair of weight tiles over a span (64 bytes an input) stays in L1 (48 KB)
  // beside one block's activations over it, where the whole row (SmolLM2's 576 inputs: 36 KB each) did not.
  // Spans of 288 there, 30 layers' linears at 512 tokens: packed bf16 54.0-54.9 ms against 62.2-64.8, int8
  // (widened) 53.9-56.7 against 56.8-58.7. Longer rows stay whole: in the tile loop alone, spans of 256-512
  // inputs gained ~3% at 1,536 inputs and lost ~10% at 2,048 (the sums re-loaded from memory once per span).
  // Two blocks of tokens or fewer hardly reuse the weights: spans there cost packed bf16 3-6% at 16-48 tokens.
  static int64_t input_span(int64_t m, int64_t k) {
    if (m <= 64 || k <= 12 * kBf16Inputs || k > 24 * kBf16Inputs) return k;
    return (k / 2 + kBf16Inputs - 1) / kBf16Inputs * kBf16Inputs;
  }

  // One block of tokens (rows `k` inputs apart) over inputs [from, to): sums start from `load` (zero when null)
  // and are stored to `store`.
  struct Span {
    const uint16_t* x;
    int64_t k, from, to;
    const float* load;
    float* store;
  };

  template <bool TwoGroups, bool TwoTiles, typename Beside>
  void block(const Span& span, const uint16_t* w0, const uint16_t* w1, Beside& beside) {
    if (span.load == nullptr) {
      _tile_zero(0);
      if constexpr (TwoTiles) _tile_zero(1);
      if constexpr (TwoGroups) _tile_zero(2);
      if constexpr (TwoGroups && TwoTiles) _tile_zero(3);
    } else {
      _tile_loadd(0, span.load, 64);
      if constexpr (TwoTiles) _tile_loadd(1, span.load + 256, 64);
      if constexpr (TwoGroups) _tile_loadd(2, span.load + 512, 64);
      if constexpr (TwoGroups && TwoTiles) _tile_loadd(3, span.load + 768, 64);
    }
    const uint16_t* x = span.x;
    const int64_t stride = 2 * span.k;
    // Each tile is loaded right before the first product that reads it: 30 layers' packed bf16 linears at 512
    // tokens took 60 ms with the four loads up front, 54.5 so. Their activations come from L2; from L1 the order
    // makes no difference (benchmarks/bench_amx_tiles.py).
    for (int64_t i = span.from; i < span.to; i += kBf16Inputs) {
      _tile_loadd(4, x + i, stride);
      _tile_loadd(6, w0 + i * 16, 64);  // input pair i / 2 starts at element i / 2 x 32
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (TwoTiles) { _tile_loadd(7, w1 + i * 16, 64); _tile_dpbf16ps(1, 4, 7); }
      if constexpr (TwoGroups) { _tile_loadd(5, x + 16 * span.k + i, stride); _tile_dpbf16ps(2, 5, 6); }
      if constexpr (TwoGroups && TwoTiles) _tile_dpbf16ps(3, 5, 7);
    }
    beside();
    _tile_stored(0, span.store, 64);
    if constexpr (TwoTiles) _tile_stored(1, span.store + 256, 64);
    if constexpr (TwoGroups) _tile_stored(2, span.store + 512, 64);
    if constexpr (TwoGroups && TwoTiles) _tile_stored(3, span.store + 768, 64);
  }

  alignas(64) float sums_[kBlockSums];
  int configured_ = -1;
};

}  // namespace amx
#endif
