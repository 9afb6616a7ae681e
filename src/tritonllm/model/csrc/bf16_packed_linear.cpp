// bf16 linears on weights packed for vdpbf16ps (the avx512_bf16 and amx builds; linear.cpp keeps the row-major
// weights that oneDNN's AMX GEMM takes where an AMX CPU runs the avx512_bf16 build). The amx build multiplies the
// same tiles on AMX from kAmxBf16MinTokens on (amx.h). A tile of 16 rows holds, per pair of inputs, the 16
// rows' two weights side by side (64 bytes: oneDNN's "VNNI" layout for bf16): one vdpbf16ps multiplies them by
// a token's pair repeated 16 times and leaves each row's sum in its own lane. No horizontal sums, and a tile is
// one contiguous stream. linear.cpp's dot tiles (a row by a token, 32 inputs a step) reduced 16 vectors per tile
// and ran 1B-Llama shapes at ~140 GMAC/s at 32 tokens, rows of 2^n inputs 14% slower (cache-set conflicts).
// Over Llama-3.2-1B's four linears x 4 layers on 2 MB pages (bench_bf16_packed.py, 2 threads, Zen 4, paired)
// these took, of the row-major paths' time: 1 token 0.94 (there the AVX2 tile, widening bf16 to fp32), 2-4 tokens
// 0.70-0.87, 8-64 tokens 0.69-0.72, and 0.85-0.92 of oneDNN's GEMM at 128-512 tokens, so they run every size.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "errors.h"
#include "simd.h"
#include "work_split.h"

namespace {

constexpr int64_t kPairRows = 16;  // rows a tile: one 512-bit vector of fp32 sums
constexpr int kGroupTiles = 4, kGroupTokens = 6;  // a register tile: 4 x 6 sums + 4 weight vectors + a token pair

void check_bf16_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == 2 * kPairRows,
              errors::message("packed bf16 weights must be contiguous bfloat16 [tiles, input pairs, ", 2 * kPairRows,
                              "] (from bf16_pack)"));
}

#ifdef TRITONLLM_AVX512_BF16
// sums[r][m] lane j = row 16 r + j of RT consecutive tiles times token m of RM, over all k inputs. With few sums
// (batch 1: 4) each is split in CH chains so that vdpbf16ps's latency hides behind independent ones.
template <int RT, int RM>
inline void packed_tile(const uint16_t* w, int64_t tile_elems, const uint16_t* x, int64_t k, __m512 (&sums)[RT][RM]) {
  constexpr int CH = RT * RM >= 8 ? 1 : (RT * RM >= 4 ? 2 : 4);
  const int64_t pairs = k / 2;
  __m512 acc[CH][RT][RM];
  TRITONLLM_UNROLL for (int c = 0; c < CH; ++c) TRITONLLM_UNROLL for (int r = 0; r < RT; ++r)
    TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) acc[c][r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t i, int c) {  // input pair i into chain c
    __m512bh wv[RT];
    TRITONLLM_UNROLL for (int r = 0; r < RT; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * tile_elems + i * 2 * kPairRows);
    TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * k + 2 * i, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      TRITONLLM_UNROLL for (int r = 0; r < RT; ++r) acc[c][r][m] = _mm512_dpbf16_ps(acc[c][r][m], wv[r], xv);
    }
  };
  int64_t i = 0;
  for (; i + CH <= pairs; i += CH) TRITONLLM_UNROLL for (int c = 0; c < CH; ++c) step(i + c, c);
  for (; i < pairs; ++i) step(i, 0);
  TRITONLLM_UNROLL for (int r = 0; r < RT; ++r) TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) {
    sums[r][m] = acc[0][r][m];
    TRITONLLM_UNROLL for (int c = 1; c < CH; ++c) sums[r][m] = _mm512_add_ps(sums[r][m], acc[c][r][m]);
  }
}

// RT tiles from `tile` x RM tokens from `token` (RM <= kGroupTokens), + bias, rounded to bf16 into out [m, n].
template <int RT, int RM>
void packed_group(const uint16_t* w, int64_t tile, int64_t tile_elems, const uint16_t* x, int64_t token, int64_t k,
                  const float* bias, int64_t n, uint16_t* out) {
  __m512 sums[RT][RM];
  packed_tile<RT, RM>(w + tile * tile_elems, tile_elems, x + token * k, k, sums);
  TRITONLLM_UNROLL for (int r = 0; r < RT; ++r) {
    const int64_t row = (tile + r) * kPairRows;
    const __m512 b = bias ? _mm512_loadu_ps(bias + row) : _mm512_setzero_ps();
    TRITONLLM_UNROLL for (int m = 0; m < RM; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (token + m) * n + row),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums[r][m], b)));
  }
}

// Calls packed_group with compile-time RT (1..kGroupTiles) and RM (1..kGroupTokens).
template <int RT, int RM = kGroupTokens>
void dispatch_group(int64_t tiles, int64_t tokens, const uint16_t* w, int64_t tile, int64_t tile_elems,
                    const uint16_t* x, int64_t token, int64_t k, const float* bias, int64_t n, uint16_t* out) {
  if constexpr (RT > 1) {
    if (tiles < RT) return dispatch_group<RT - 1, RM>(tiles, tokens, w, tile, tile_elems, x, token, k, bias, n, out);
  }
  if constexpr (RM > 1) {
    if (tokens < RM) return dispatch_group<RT, RM - 1>(tiles, tokens, w, tile, tile_elems, x, token, k, bias, n, out);
  }
  packed_group<RT, RM>(w, tile, tile_elems, x, token, k, bias, n, out);
}
#endif

#ifdef TRITONLLM_AMX
// From how many tokens the amx build multiplies packed weights on AMX tiles (amx.h); below, vdpbf16ps as above.
// A weight tile is 16 pairs of bf16_pack's layout as they lie (64-byte rows), so both paths read the same weights.
constexpr int64_t kAmxBf16MinTokens = 4;

// out [m, n] (bf16, + bias) for tiles [begin, end), two at a time (amx::Bf16Tiles).
void amx_bf16_tiles(const uint16_t* w, int64_t begin, int64_t end, int64_t tile_elems, const uint16_t* x, int64_t m,
                    int64_t k, const float* bias, int64_t n, uint16_t* out) {
  amx::Bf16Tiles tiles;
  for (int64_t tile = begin; tile < end; tile += 2) {
    const int count = tile + 1 < end ? 2 : 1;
    __m512 bias_rows[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; bias && j < count; ++j) bias_rows[j] = _mm512_loadu_ps(bias + (tile + j) * kPairRows);
    tiles.multiply(x, m, k, w + tile * tile_elems, w + (tile + 1) * tile_elems, count, [&](int64_t token, int j, __m512 sums) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + token * n + (tile + j) * kPairRows),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, bias_rows[j])));
    });
  }
}
#endif

}  // namespace

// w bfloat16 [N, K] (K even) -> bfloat16 [ceil(N/16), K/2, 32]: tile t, pair i holds inputs 2i, 2i+1 of rows
// 16t..16t+15, row by row. Rows past N are zeros.
at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(), "weight must be contiguous bfloat16 [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, errors::message("packed bf16 weights take pairs of inputs; this weight has ", w.size(1)));
  const int64_t n = w.size(0), k = w.size(1), pairs = k / 2, tiles = (n + kPairRows - 1) / kPairRows;
  at::Tensor packed = at::empty({tiles, pairs, 2 * kPairRows}, w.options());  // every element written below
  // A pair of bf16 is 32 bits: each tile is a transpose of its rows' pairs, written in order (16 rows read side by
  // side); element by element, row by row, a 1B model took ~2 s more to load than row-major weights.
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<at::BFloat16>());
  work_split::for_each(tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = std::min(kPairRows, n - t * kPairRows);
      const uint32_t* tile_rows = src + t * kPairRows * pairs;
      uint32_t* tile = dst + t * pairs * kPairRows;
      for (int64_t i = 0; i < pairs; ++i)
        for (int64_t r = 0; r < kPairRows; ++r) tile[i * kPairRows + r] = r < rows ? tile_rows[r * pairs + i] : 0;
    }
  });
  return packed;
}

// Whether bf16 weights are packed here (bf16_pack) rather than kept row-major for linear.cpp: in the avx512_bf16
// build, unless bf16 activations go to oneDNN's GEMM from some number of tokens (AMX), which takes row-major ones.
bool packs_bf16() {
#ifdef TRITONLLM_AVX512_BF16
  return onednn_bf16_min_tokens() == 0;
#else
  return false;
#endif
}

// x bfloat16 [..., K]; packed from bf16_pack (K inputs); bias (optional) float32, padded like the rows to ceil(N/16) * 16.
// out bfloat16 [..., ceil(N/16) * 16], written: callers drop the padded rows.
void bf16_packed_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  check_bf16_packed(packed);
  const int64_t tiles = packed.size(0), n = tiles * kPairRows, k = x.size(-1), m = x.numel() / k;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "activations must be contiguous bfloat16");
  TORCH_CHECK(k == 2 * packed.size(1), errors::message("activations have ", k, " features; the weight holds ", 2 * packed.size(1)));
  check_bias(bias, n);
  check_output(out, x, n);
#ifdef TRITONLLM_AVX512_BF16
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t tile_elems = packed.size(1) * 2 * kPairRows;
#ifdef TRITONLLM_AMX
  if (m >= kAmxBf16MinTokens && k % amx::kBf16Inputs == 0) {
    // Pieces of 8 tiles: a tile configuration a piece (and the short last block of tokens) against 4 tile pairs.
    work_split::for_each(tiles, 8, [&](int64_t begin, int64_t end) {
      amx_bf16_tiles(w, begin, end, tile_elems, xp, m, k, bp, n, op);
    });
    return;
  }
#endif
  // Threads split the tiles (work_split.h), kGroupTiles at a time; each group stays in cache while the tokens go by.
  work_split::for_each(tiles, kGroupTiles, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += kGroupTiles)
      for (int64_t m0 = 0; m0 < m; m0 += kGroupTokens)
        dispatch_group<kGroupTiles>(std::min<int64_t>(kGroupTiles, end - tile), m - m0, w, tile, tile_elems, xp, m0, k, bp, n, op);
  });
#else
  TORCH_CHECK(false, "packed bf16 weights need the avx512_bf16 or amx build (packs_bf16() is false here)");
#endif
}

at::Tensor bf16_packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  check_bf16_packed(packed);
  at::Tensor out = linear_output(x, packed.size(0) * kPairRows);
  bf16_packed_linear_into(x, packed, bias, out);
  return out;
}
