// Linear layers over int8 weights in blocks of 32 inputs with one fp16 scale each (llama.cpp's q8_0), times
// activations quantized to int8 per token and block on the fly (the arithmetic of llama.cpp's q8_0 x q8_0 dot
// product), at every batch size. The kernels take the weight format as a template argument (Int8Format here,
// Int7Format in int7_linear.cpp, Int4Format in int4_linear.cpp).
//
// The weights are repacked once at load into tiles of 8 rows. Per block of 32 inputs a tile holds 272 bytes:
// the 8 rows' scales in fp16 (34 bytes per 32 weights, as q8_0; fp32 scales took 36, and batch 1 reads every
// byte each token), then 4 chunks of 8 inputs, each as rows 0-3 then rows 4-7 (8 bytes per row). One 32-byte
// load thus holds 4 rows x 8 inputs; multiplied by 8 activations repeated 4 times, 4 such products give all 8
// rows' dot products for a block in one vector, scaled by one multiply-add. That is a third fewer
// instructions per weight byte than a row at a time, and one contiguous stream per thread, prefetched ahead:
// batch-1 decode reads every weight once per token, so this is what sets its speed. With more tokens a tile
// stays in cache while the tokens go by up to eight at a time: on AVX2 this beat expanding the weights to fp32 for
// FMAs or for the BLAS GEMM at every batch size measured (1-512 tokens; benchmarks/README.md).
// The VNNI builds (avx512_vnni, avx512_bf16) pack their own layout: tiles of 16 rows, each block as the 16 rows'
// scales (fp16, row order) then 8 chunks of 64 bytes (chunk c: inputs 4c..4c+3 of rows 0-15, 4 bytes a row), so that one
// vpdpbusd multiplies a chunk by 4 activations repeated 16 times and leaves each row's sum in its own lane.
// Per token and block that is 8 dot products and one scale multiply-add for 16 rows, where 8-row chunks
// took 4 and one for 8 rows (the scale work is per lane): 1.2x at 32 tokens, 1.3x at 128 (1 thread).
// Scales kept after all of a tile's weights (aligned chunks, two streams) made batch 1 1.5x slower.
// vpdpbusd multiplies unsigned by signed bytes: the weights are stored + 128 (as u8) and 128 x each token's
// block sum, computed once when the activations are quantized, is taken back off.
// The amx build loads those tiles as they lie into AMX tiles: tdpbsud from 16 tokens (amx_tile), and from 32
// tokens weights widened to bf16 for tdpbf16ps (amx_widened_tiles).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "errors.h"
#include "simd.h"
#include "work_split.h"

namespace {

using simd::to_float;

constexpr int64_t kBlock = 32;
// How far ahead a tile's stream is prefetched: 4 blocks of 8 rows, 2 of 16; measured best of 2-8 8-row blocks
// for a thread streaming from DRAM.
constexpr int64_t kPrefetchBytes = 1088;

#ifdef TRITONLLM_AVX512_VNNI
constexpr int64_t kTileRows = 16;
constexpr int64_t kChunkBytes = 64, kScaleBytes = kTileRows * 2;
constexpr uint8_t kWeightOffset = 0x80;  // weights stored + 128, as vpdpbusd's unsigned operand

// Where weight i (< 32) of row r in block b, and row r's scale for block b, sit in a tile.
inline int64_t weight_offset(int64_t b, int64_t r, int64_t i) {
  return b * kTileRows * (kBlock + 2) + kScaleBytes + (i / 4) * kChunkBytes + r * 4 + i % 4;
}
inline int64_t scale_offset(int64_t b, int64_t r) { return b * kTileRows * (kBlock + 2) + 2 * r; }
#else
constexpr int64_t kTileRows = 8, kScaleBytes = kTileRows * 2;
constexpr uint8_t kWeightOffset = 0;
// Scales are stored in the order the AVX2 kernel's horizontal add leaves the rows' sums. The map is its own
// inverse: slot s holds row kSlot[s], and row r sits in slot kSlot[r] (one permute puts a tile's sums back in
// row order before they are written straight into the output).
alignas(32) constexpr int32_t kSlot[kTileRows] = {0, 1, 4, 5, 2, 3, 6, 7};

inline int64_t weight_offset(int64_t b, int64_t r, int64_t i) {
  return b * kTileRows * (kBlock + 2) + kScaleBytes + (i / 8) * 64 + (r / 4) * 32 + (r % 4) * 8 + i % 8;
}
inline int64_t scale_offset(int64_t b, int64_t r) { return b * kTileRows * (kBlock + 2) + 2 * kSlot[r]; }
#endif
constexpr int64_t kTileBlock = kTileRows * (kBlock + 2);  // a tile's bytes per block: weights and fp16 scales

// The weight formats the kernels below run. Both keep per block of 32 inputs and tile of kTileRows rows the
// rows' fp16 scales first (at 2 x slot(r)), then the weights as int8's chunks give them (Int4Format: a mask or a
// shift away; int4_linear.cpp). A format gives its bytes a block, the offset its stored weights carry (taken back
// off as offset x the activations' block sum), its weights as the kernels' chunks, how many chunks' int16 products
// may add up (AVX2), and one weight (the portable path; Int7Format, only in AVX2 builds, never takes it).
struct Int8Format {
  static constexpr int64_t kBlockBytes = kTileBlock;
  static constexpr int32_t kOffset = kWeightOffset;
  static constexpr int kChunksPerSum = 1;  // (AVX2) |w| x |x| x 2 fills int16: each chunk widens alone
  static int32_t weight(const uint8_t* tile, int64_t b, int64_t r, int64_t i) {
    return static_cast<int8_t>(tile[weight_offset(b, r, i)] ^ kWeightOffset);
  }
#ifdef TRITONLLM_AVX512_VNNI
  static void load_chunks(const uint8_t* block, __m512i* w) {  // chunk c: inputs 4c..4c+3 of the 16 rows
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(block + kScaleBytes + kChunkBytes * c);
  }
#elif defined(TRITONLLM_AVX2)
  // Chunk c (inputs 8c..8c+7) times activations xc (|xc| in abs_xc), as int16 pairs for rows 0-3 and 4-7. maddubs
  // needs one unsigned operand: |x| and w carrying x's sign give the same products (|values| <= 127, no saturation).
  static void chunk_products(const uint8_t* block, int c, __m256i xc, __m256i abs_xc, __m256i& rows0123,
                             __m256i& rows4567) {
    const __m256i* w = reinterpret_cast<const __m256i*>(block + kScaleBytes);
    rows0123 = _mm256_maddubs_epi16(abs_xc, _mm256_sign_epi8(_mm256_loadu_si256(w + 2 * c), xc));
    rows4567 = _mm256_maddubs_epi16(abs_xc, _mm256_sign_epi8(_mm256_loadu_si256(w + 2 * c + 1), xc));
  }
#endif
};

// Calls fn(std::integral_constant<int, t>{}) with t = min(tokens, kMax) (tokens >= 1): the tile kernels take their
// number of tokens at compile time, so their sums stay in registers. Counts are tried from 1 up: one token (batch-1
// decode, a call per tile) takes one comparison.
template <int kMax, int kCount = 1, typename Fn>
inline void with_tokens(int64_t tokens, Fn&& fn) {
  if constexpr (kCount < kMax) {
    if (tokens > kCount) return with_tokens<kMax, kCount + 1>(tokens, fn);
  }
  fn(std::integral_constant<int, kCount>{});
}

// Row r's scale for block b of a tile (fp16).
template <typename Format>
inline float block_scale(const uint8_t* tile, int64_t b, int64_t r) {
  c10::Half h;
  std::memcpy(&h, tile + b * Format::kBlockBytes + scale_offset(0, r), 2);
  return static_cast<float>(h);
}

#ifdef TRITONLLM_AVX2
inline void store_floats(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
#ifdef TRITONLLM_AVX512
inline void store_floats(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
#endif

// Asks for the block `ahead` bytes past `block` (its weights and scales) in L1: the kernels below stream their
// weights once, block after block.
template <typename Format>
inline void prefetch_block(const uint8_t* block, int64_t ahead) {
  const char* lines = reinterpret_cast<const char*>(block + ahead);
  for (int64_t line = 0; line < Format::kBlockBytes; line += 64) _mm_prefetch(lines + line, _MM_HINT_T0);
}

// A tile's rows (one vector: 8 lanes, 16 in the VNNI builds) for one token, written straight into the output:
// fp32 as is, bf16 rounded to nearest even (one instruction where the CPU has it, else lane by lane).
template <typename T, typename Vector>
inline void store_rows(Vector rows, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    store_floats(out, rows);
#ifdef TRITONLLM_AVX512_BF16
  } else if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<Vector, __m512>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(rows));
#endif
  } else {
    float lanes[kTileRows];
    store_floats(lanes, rows);
    for (int64_t r = 0; r < kTileRows; ++r) out[r] = static_cast<T>(lanes[r]);
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// One whole block of 32 activations to int8 (rounded to nearest even, as the scalar path) and, where asked,
// their absolute values (AVX2's unsigned operand); returns the block's largest magnitude and sets `sum` to the
// sum of its int8 values (from the int32 lanes: |values| <= 127, so packing saturates nothing).
template <typename T>
inline float quantize_block(const T* x, int8_t* q, int8_t* operand, int32_t& sum) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int j = 0; j < 4; ++j) {
    v[j] = simd::load8(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  const float largest = hmax(amax);
  const __m256 inv = _mm256_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
  __m256i i32[4];
  for (int j = 0; j < 4; ++j) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
  // packs work within 128-bit lanes: the bytes come out in 4-byte groups 0 2 4 6 1 3 5 7 of 8 in order.
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  if (operand != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(operand), _mm256_abs_epi8(bytes));
  const __m256i lanes = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  __m128i total = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
  total = _mm_add_epi32(total, _mm_unpackhi_epi64(total, total));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(total, _mm_shuffle_epi32(total, 1)));
  return largest;
}
#endif

// The scalar version of quantize_block, for any element type and for a block cut short (`len` < 32 inputs,
// the rest zeros).
template <typename T>
float quantize_block_scalar(const T* x, int64_t len, int8_t* q, int8_t* abs_q, int32_t& sum) {
  float amax = 0.f;
  for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    q[i] = i < len ? static_cast<int8_t>(std::nearbyint(to_float(x[i]) * inv)) : 0;
    if (abs_q) abs_q[i] = static_cast<int8_t>(std::abs(q[i]));
    sum += q[i];
  }
  return amax;
}

// Quantize `m` rows of `k` activations to int8 per block of 32 (zero-padded to `kp`), with one scale per
// block; where asked, also their absolute values (`abs_xq`, AVX2's maddubs operand for int8 weights) and
// -offset x each block's sum (`corrections`: what weights stored + offset add to a dot product).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, int8_t* xq, int8_t* abs_xq, float* xs,
                   int32_t* corrections, int32_t offset) {
  const int64_t nb = kp / kBlock;
  work_split::for_each(m, 16, [&](int64_t begin, int64_t end) {
    // A row's pointers in locals: int8 stores may alias anything, so pointers reached through the captures
    // were re-read after every block.
    const int32_t minus_offset = -offset;
    for (int64_t r = begin; r < end; ++r) {
      const T* in = x + r * k;
      int8_t* q = xq + r * kp;
      int8_t* abs_q = abs_xq ? abs_xq + r * kp : nullptr;
      float* scales = xs + r * nb;
      int32_t* row_corrections = corrections ? corrections + r * nb : nullptr;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t len = std::min(kBlock, k - b * kBlock);
        int8_t* abs_block = abs_q ? abs_q + b * kBlock : nullptr;
        int32_t sum;
        float largest;
#ifdef TRITONLLM_AVX2
        if constexpr (simd::kVectorLoad<T>)
          largest = len == kBlock ? quantize_block(in + b * kBlock, q + b * kBlock, abs_block, sum)
                                  : quantize_block_scalar(in + b * kBlock, len, q + b * kBlock, abs_block, sum);
        else
#endif
          largest = quantize_block_scalar(in + b * kBlock, len, q + b * kBlock, abs_block, sum);
        scales[b] = largest / 127.f;
        if (row_corrections) row_corrections[b] = minus_offset * sum;
      }
    }
  });
}

#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512_VNNI)
// Tokens per pass over a tile. With the sums in registers (packed_tile) a pass holds 8 tokens' sums besides its
// working set in AVX2's 16 registers; against 2 a pass, SmolLM2's 30 layers of int8 linears (2 threads, Zen 3,
// bench_linears_ab.py) took 0.83-0.89 of the time at 8-64 tokens and 0.88-0.94 at 128-512, int4 0.75-0.81 at
// 8-128 tokens.
constexpr int kPackedTokens = 8;

inline __m256i broadcast8(const int8_t* p) {  // 8 int8 values, repeated 4 times
  int64_t chunk;
  std::memcpy(&chunk, p, 8);
  return _mm256_set1_epi64x(chunk);
}

// acc[m] = the 8 rows' dot products (in slot order) with RM tokens, over a tile's nb blocks. xq and its absolute
// values abs_xq are [tokens, nb * 32]; corrections [tokens, nb] (formats with an offset).
template <typename Format, int RM>
void packed_tile(const uint8_t* tile, int64_t nb, const int8_t* xq, const int8_t* abs_xq, const int32_t* corrections,
                 const float* xs, __m256* acc) {
  // Sums in registers, as vnni_tile's: summed through `acc`, they were stored and loaded again every block (the
  // loads of xs may alias an __m256 store), and those stores and the multiply before them took ~a third of the
  // kernel's samples (perf, Zen 3, 32 requests).
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sums[RM];
  TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) sums[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = tile + b * Format::kBlockBytes;
    prefetch_block<Format>(block, kPrefetchBytes);
    const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) {
      const int64_t at = (m * nb + b) * kBlock;
      __m256i rows0123 = _mm256_setzero_si256(), rows4567 = _mm256_setzero_si256();
      // maddubs leaves int16 pairs of products: Format::kChunksPerSum chunks' pairs add up in int16 (as many as
      // cannot overflow) before one madd widens them to int32 and adds each row's pairs.
      constexpr int kStep = Format::kChunksPerSum;
      for (int c = 0; c < 4; c += kStep) {
        __m256i p0, p1;
        TRITONLLM_UNROLL for (int j = 0; j < kStep; ++j) {
          const __m256i xc = broadcast8(xq + at + 8 * (c + j));
          const __m256i abs_xc = Format::kOffset ? xc : broadcast8(abs_xq + at + 8 * (c + j));
          __m256i q0, q1;
          Format::chunk_products(block, c + j, xc, abs_xc, q0, q1);
          p0 = j == 0 ? q0 : _mm256_add_epi16(p0, q0);
          p1 = j == 0 ? q1 : _mm256_add_epi16(p1, q1);
        }
        rows0123 = _mm256_add_epi32(rows0123, _mm256_madd_epi16(p0, ones));
        rows4567 = _mm256_add_epi32(rows4567, _mm256_madd_epi16(p1, ones));
      }
      // Lanes hold 2 partial sums per row; hadd adds the pairs: rows 0 1 4 5 | 2 3 6 7 (kSlot's order).
      __m256i dots = _mm256_hadd_epi32(rows0123, rows4567);
      if constexpr (Format::kOffset != 0)
        dots = _mm256_add_epi32(dots, _mm256_set1_epi32(corrections[m * nb + b]));
      sums[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scales, _mm256_set1_ps(xs[m * nb + b])), sums[m]);
    }
  }
  TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) acc[m] = sums[m];
}
#endif

#ifdef TRITONLLM_AVX512_VNNI
constexpr int kVnniTokens = 8;  // tokens per pass over a tile: 8 accumulators + 8 weight chunks + 4 in 32 registers

// acc[m] lane r = row r's dot product with token m, over a tile's nb blocks. xq: the tokens' int8 activations
// [tokens, nb * 32]; corrections: -offset x their block sums [tokens, nb]; xs: their scales [tokens, nb].
template <typename Format, int RM>
void vnni_tile(const uint8_t* tile, int64_t nb, const int8_t* xq, const int32_t* corrections, const float* xs,
               __m512* acc) {
  // Sums in registers: GCC left the token loop rolled with the sums in memory (a load, FMA and store per token
  // and block): unrolled, SmolLM2's 30 layers 1.16x faster at 512 tokens, 1.04x at 32-128 (Zen 4, 2 threads).
  __m512 sums[RM];
#pragma GCC unroll 8
  for (int m = 0; m < RM; ++m) sums[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = tile + b * Format::kBlockBytes;
    // A single token keeps up with the hardware prefetcher alone (body at 1 token 1.1-1.3x faster without,
    // at 8 tokens 1.4-1.8x slower; Zen 4, 1-2 threads).
    if constexpr (RM > 1) prefetch_block<Format>(block, kPrefetchBytes);
    __m512i w[8];
    Format::load_chunks(block, w);
    const __m512 row_scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
#pragma GCC unroll 8
    for (int m = 0; m < RM; ++m) {
      const int8_t* x = xq + (m * nb + b) * kBlock;
      // Few tokens leave too few independent dot products to hide vpdpbusd's latency: split each in 4 chains.
      constexpr int kChains = RM < 4 ? 4 : 1;
      __m512i dots[kChains];
      dots[0] = _mm512_set1_epi32(corrections[m * nb + b]);
      for (int j = 1; j < kChains; ++j) dots[j] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        int32_t four;
        std::memcpy(&four, x + 4 * c, 4);
        dots[c % kChains] = _mm512_dpbusd_epi32(dots[c % kChains], w[c], _mm512_set1_epi32(four));
      }
      __m512i dot = dots[0];
      for (int j = 1; j < kChains; ++j) dot = _mm512_add_epi32(dot, dots[j]);
      sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(row_scales, _mm512_set1_ps(xs[m * nb + b])), sums[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < RM; ++m) acc[m] = sums[m];
}

// out[i][r] (+ bias[r]) for the tile's 16 rows r and tokens i in [0, m), kVnniTokens at a time; out and bias
// start at the tile's first row, out's rows are `stride` apart.
template <typename Format, typename T>
void vnni_tiles(const uint8_t* tile, int64_t nb, int64_t kp, const int8_t* xq, const int32_t* corrections, const float* xs,
                int64_t m, const float* bias, T* out, int64_t stride) {
  const __m512 bias_lanes = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t m0 = 0; m0 < m; m0 += kVnniTokens) {
    const int64_t tokens = std::min<int64_t>(kVnniTokens, m - m0);
    __m512 acc[kVnniTokens];
    const int8_t* x = xq + m0 * kp;
    const int32_t* c = corrections + m0 * nb;
    const float* s = xs + m0 * nb;
    with_tokens<kVnniTokens>(tokens, [&](auto rm) { vnni_tile<Format, decltype(rm)::value>(tile, nb, x, c, s, acc); });
    for (int64_t i = 0; i < tokens; ++i) store_rows(_mm512_add_ps(acc[i], bias_lanes), out + (m0 + i) * stride);
  }
}
#endif

// A per-thread buffer of at least `size` elements (kept for the thread's next call).
template <typename V, typename Allocator>
V* grown(std::vector<V, Allocator>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

#ifdef TRITONLLM_AMX
// From how many tokens the amx build multiplies on AMX tiles; fewer take vnni_tile.
constexpr int64_t kAmxInt8MinTokens = 16;
constexpr int kAmxTokens = 16;  // tokens a pass: one activation tile
constexpr int64_t kAmxPrefetchBytes = 8 * kTileBlock;  // how far ahead the weight stream is prefetched

// A block's 16 rows x 32 weights as a weight tile loads them (8 rows of 64 bytes, chunk c: inputs 4c..4c+3 of
// the 16 rows, as vpdpbusd takes them): int8's lie in the tile; other formats (int4's nibbles) are widened into
// `widened` first.
template <typename Format>
inline const uint8_t* amx_weights(const uint8_t* block, uint8_t* widened) {
  if constexpr (std::is_same_v<Format, Int8Format>) {
    return block + kScaleBytes;
  } else {
    __m512i w[8];
    Format::load_chunks(block, w);
    for (int c = 0; c < 8; ++c) _mm512_store_si512(widened + kChunkBytes * c, w[c]);
    amx::stores_before_tile_loads();
    return widened;
  }
}

// The int32 dot products of up to 16 tokens (xq, rows kp bytes apart) with the tile's 16 rows, for `count`
// (1-4) blocks from b0, into `products` [block][token][row]: each block in its own sum tile (0-3), activations
// and weights alternating between tiles 4/6 and 5/7. tdpbsud multiplies the signed activations by the weights
// as stored (unsigned, + Format::kOffset). GCC's tile intrinsics paste their tile numbers into the instruction:
// a macro, not a loop, names them.
template <typename Format>
inline void amx_block_products(const uint8_t* tile, int64_t b0, int count, const int8_t* xq, int64_t kp,
                               uint8_t (*widened)[8 * kChunkBytes], int32_t (*products)[kAmxTokens * 16]) {
  const int8_t* x[4];
  const uint8_t* w[4];
  for (int j = 0; j < count; ++j) {
    x[j] = xq + (b0 + j) * kBlock;
    w[j] = amx_weights<Format>(tile + (b0 + j) * Format::kBlockBytes, widened[j]);
    prefetch_block<Format>(tile + (b0 + j) * Format::kBlockBytes, kAmxPrefetchBytes);
  }
  constexpr int64_t kRowBytes = 16 * sizeof(int32_t);
// Block j's products into sum tile `sum`, through activation and weight tiles (literal tile numbers).
#define TRITONLLM_BLOCK_PRODUCT(sum, activations, weights, j) \
  do {                                                        \
    _tile_zero(sum);                                          \
    _tile_loadd(activations, x[j], kp);                       \
    _tile_loadd(weights, w[j], kChunkBytes);                  \
    _tile_dpbsud(sum, activations, weights);                  \
  } while (0)
  TRITONLLM_BLOCK_PRODUCT(0, 4, 6, 0);
  if (count > 1) TRITONLLM_BLOCK_PRODUCT(1, 5, 7, 1);
  if (count > 2) TRITONLLM_BLOCK_PRODUCT(2, 4, 6, 2);
  if (count > 3) TRITONLLM_BLOCK_PRODUCT(3, 5, 7, 3);
#undef TRITONLLM_BLOCK_PRODUCT
  _tile_stored(0, products[0], kRowBytes);
  if (count > 1) _tile_stored(1, products[1], kRowBytes);
  if (count > 2) _tile_stored(2, products[2], kRowBytes);
  if (count > 3) _tile_stored(3, products[3], kRowBytes);
}

// out[i][r] (+ bias[r]) for the tile's 16 rows r and `tokens` (<= 16) tokens. Per block, the tile products are
// taken off the offset (corrections), scaled by the rows' scales x each token's, and added to fp32 sums kept in
// registers, one per token. Blocks go 4 at a time through the tiles, and the next 4's products are under way
// while these are scaled (the scaling reads what tile stores just wrote: back to back, they waited on each
// other). corrections and xs must hold 16 tokens (rows past `tokens` are read and their sums dropped).
template <typename Format, typename T>
void amx_tile(const uint8_t* tile, int64_t nb, int64_t kp, const int8_t* xq, const int32_t* corrections,
              const float* xs, int64_t tokens, const float* bias, T* out, int64_t stride) {
  constexpr int kQuad = 4;
  alignas(64) int32_t products[2][kQuad][kAmxTokens * 16];
  alignas(64) uint8_t widened[2][kQuad][8 * kChunkBytes];
  __m512 sums[kAmxTokens];
  TRITONLLM_UNROLL for (int i = 0; i < kAmxTokens; ++i) sums[i] = _mm512_setzero_ps();
  auto scale = [&](int64_t b, const int32_t* block_products) {
    const __m512 row_scales =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + b * Format::kBlockBytes)));
    TRITONLLM_UNROLL for (int i = 0; i < kAmxTokens; ++i) {
      const __m512i dot = _mm512_add_epi32(_mm512_load_si512(block_products + 16 * i), _mm512_set1_epi32(corrections[i * nb + b]));
      sums[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(row_scales, _mm512_set1_ps(xs[i * nb + b])), sums[i]);
    }
  };
  auto quad = [&](int64_t b0) { return static_cast<int>(std::min<int64_t>(kQuad, nb - b0)); };
  amx_block_products<Format>(tile, 0, quad(0), xq, kp, widened[0], products[0]);
  for (int64_t b0 = 0, set = 0; b0 < nb; b0 += kQuad, set ^= 1) {
    if (b0 + kQuad < nb) amx_block_products<Format>(tile, b0 + kQuad, quad(b0 + kQuad), xq, kp, widened[set ^ 1], products[set ^ 1]);
    for (int j = 0; j < quad(b0); ++j) scale(b0 + j, products[set][j]);
  }
  const __m512 bias_lanes = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t i = 0; i < tokens; ++i) store_rows(_mm512_add_ps(sums[i], bias_lanes), out + i * stride);
}

// Tiles [begin, end) for all m tokens, 16 tokens at a time; a group of tokens goes through all the tiles before
// the next (the tiles stay in cache; a short last group is one more tile configuration, not one a tile).
template <typename Format, typename T>
void amx_tiles(const uint8_t* wp, int64_t begin, int64_t end, int64_t tile_bytes, int64_t nb, int64_t kp,
               const int8_t* xq, const int32_t* corrections, const float* xs, int64_t m, const float* bias, T* out,
               int64_t n) {
  for (int64_t m0 = 0; m0 < m; m0 += kAmxTokens) {
    const int tokens = static_cast<int>(std::min<int64_t>(kAmxTokens, m - m0));
    amx::configure(tokens, tokens, kBlock, 8);
    for (int64_t t = begin; t < end; ++t)
      amx_tile<Format>(wp + t * tile_bytes, nb, kp, xq + m0 * kp, corrections + m0 * nb, xs + m0 * nb, tokens,
                       bias ? bias + t * kTileRows : nullptr, out + m0 * n + t * kTileRows, n);
  }
  _tile_release();
}
#endif

#ifdef TRITONLLM_AMX
// From how many tokens the amx build widens the weights to bf16, two tiles at a time into a buffer, and
// multiplies them by bf16 activations on bf16 tiles (amx::Bf16Tiles: sums over all inputs in the tiles, no
// per-block scaling). The widening is paid once per tile for all the tokens; tdpbsud's products need scaling
// per block and token (amx_tile), which held int8 tiles to ~0.8 of bf16's speed at 128-512 tokens. SmolLM2's
// 30 layers in one process (a tree widening from 1 token against this threshold at 64, the widening prefetched),
// widened against tdpbsud: 16 tokens 10.5-10.8 ms against 8.8, 32 tokens 11.3 against 12.6, 48 tokens 14.2-14.7
// against 17.1.
constexpr int64_t kAmxWidenMinTokens = 32;
// How many blocks ahead the widening prefetches the weights it reads: each is read once, as one stream per
// thread, and the hardware's prefetch alone left the widening waiting on them (SmolLM2's 30 layers at 64 tokens:
// 12.7-13.3 ms with it, 17.0 without).
constexpr int64_t kWidenPrefetchBlocks = 16;

// Element 2r + j of a pair row takes element 16j + r of _mm512_cvtne2ps_pbh(second, first): row r's input j.
struct PairIndex {
  alignas(64) int16_t index[32];
  constexpr PairIndex() : index{} {
    for (int e = 0; e < 32; ++e) index[e] = static_cast<int16_t>(16 * (e % 2) + e / 2);
  }
};
constexpr PairIndex kPairIndex;

// A block of 16 rows x 32 inputs as bf16_pack lays out bf16 weights (16 pairs of inputs x 16 rows x 2), each
// weight less its format's offset and times its row's scale, rounded to bf16. A chunk holds row r's 4 inputs in
// 32-bit lane r, as the row scales lie: each input's bytes are shifted and masked out in place (widening them
// to 32 bits through 128-bit quarters took 2 shuffles per 16 weights and a permuted scale per quarter).
template <typename Format>
inline void widen_block(const uint8_t* block, uint16_t* pairs) {
  __m512i w[8];
  Format::load_chunks(block, w);  // chunk c: inputs 4c..4c+3 of the 16 rows, 4 bytes a row
  const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  const __m512 shifts = _mm512_mul_ps(scales, _mm512_set1_ps(-static_cast<float>(Format::kOffset)));
  const __m512i low_byte = _mm512_set1_epi32(0xFF), pair_order = _mm512_load_si512(kPairIndex.index);
  const auto weights = [&](__m512i bytes) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(bytes), scales, shifts); };
  for (int c = 0; c < 8; ++c) {
    const __m512 f0 = weights(_mm512_and_si512(w[c], low_byte));
    const __m512 f1 = weights(_mm512_and_si512(_mm512_srli_epi32(w[c], 8), low_byte));
    const __m512 f2 = weights(_mm512_and_si512(_mm512_srli_epi32(w[c], 16), low_byte));
    const __m512 f3 = weights(_mm512_srli_epi32(w[c], 24));
    _mm512_storeu_si512(pairs + 64 * c, _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)));
    _mm512_storeu_si512(pairs + 64 * c + 32, _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(f3, f2)));
  }
}

// m rows of k activations as bf16, zero-padded to kp inputs (the bf16 tiles' rows).
template <typename T>
void bf16_rows(const T* x, int64_t m, int64_t k, int64_t kp, uint16_t* out) {
  work_split::for_each(m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* in = x + i * k;
      uint16_t* row = out + i * kp;
      int64_t j = 0;
      if constexpr (std::is_same_v<T, float>)
        for (; j + 16 <= k; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + j)));
      for (; j < k; ++j) row[j] = c10::BFloat16(static_cast<float>(in[j])).x;
      std::fill(row + k, row + kp, uint16_t{0});
    }
  });
}

// out [m, n] (+ bias) for tiles [begin, end) of a packed weight, widened two tiles at a time (widen_block), times
// xb (bf16 [m, kp]). The next two tiles are widened into a second buffer while the tiles multiply the current two
// (Bf16Tiles::multiply's beside): widening first, then multiplying, left ~9% of the samples to the widening at 512
// tokens; beside the tile products, 30 layers' linears took ~3% less time.
template <typename Format, typename T>
void amx_widened_tiles(const uint8_t* wp, int64_t begin, int64_t end, int64_t tile_bytes, int64_t nb, const uint16_t* xb,
                       int64_t m, const float* bias, T* out, int64_t n) {
  const int64_t kp = nb * kBlock, tile_elems = kp * kTileRows;
  thread_local simd::LineVector<uint16_t> widened_tiles;
  uint16_t* buffers = grown(widened_tiles, 4 * tile_elems);
  // Blocks [from, to) (of 2 x nb) of the two tiles from `first` into buffer `set`.
  const auto widen = [&](int64_t first, int set, int64_t from, int64_t to) {
    for (int64_t b = from; b < to; ++b) {
      const uint8_t* block = wp + (first + b / nb) * tile_bytes + b % nb * Format::kBlockBytes;
      prefetch_block<Format>(block, kWidenPrefetchBlocks * Format::kBlockBytes);
      widen_block<Format>(block, buffers + (2 * set + b / nb) * tile_elems + b % nb * kBlock * kTileRows);
    }
  };
  const auto blocks_of = [&](int64_t first) { return first < end ? std::min<int64_t>(2, end - first) * nb : 0; };
  widen(begin, 0, 0, blocks_of(begin));
  amx::Bf16Tiles tiles;
  const int64_t calls = amx::Bf16Tiles::beside_calls(m, kp);
  for (int64_t t = begin; t < end; t += 2) {
    const int set = static_cast<int>((t - begin) / 2 % 2), count = t + 1 < end ? 2 : 1;
    __m512 bias_rows[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; bias && j < count; ++j) bias_rows[j] = _mm512_loadu_ps(bias + (t + j) * kTileRows);
    const int64_t next_blocks = blocks_of(t + 2), per_call = (next_blocks + calls - 1) / calls;
    int64_t widened = 0;  // blocks of the next two tiles widened so far
    const uint16_t* current = buffers + 2 * set * tile_elems;
    amx::stores_before_tile_loads();
    tiles.multiply(
        xb, m, kp, current, current + tile_elems, count,
        [&](int64_t token, int j, __m512 sums) {
          store_rows(_mm512_add_ps(sums, bias_rows[j]), out + token * n + (t + j) * kTileRows);
        },
        [&] {
          const int64_t stop = std::min(next_blocks, widened + per_call);
          widen(t + 2, set ^ 1, widened, stop);
          widened = stop;
        });
    widen(t + 2, set ^ 1, widened, next_blocks);
  }
}
#endif

// out[m][r] for a tile's rows and `tokens` tokens (the portable path).
template <typename Format>
void portable_tile(const uint8_t* tile, int64_t nb, const int8_t* xq, const float* xs, int64_t tokens, float* out) {
  for (int64_t m = 0; m < tokens; ++m)
    for (int64_t r = 0; r < kTileRows; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += Format::weight(tile, b, r, i) * xq[(m * nb + b) * kBlock + i];
        total += static_cast<float>(dot) * block_scale<Format>(tile, b, r) * xs[m * nb + b];
      }
      out[m * kTileRows + r] = total;
    }
}

// The activations quantized for one call (int8 values per block of 32, scales, and the VNNI builds' block sums
// or the AVX2 build's absolute values), kept by the calling thread for its next call: a decode step makes ~120
// int8 linear calls, and allocating these as tensors took four ATen allocations each.
struct ActivationScratch {
  simd::LineVector<uint16_t> xb;  // bf16 (the amx build's widened path: tile rows)
  simd::LineVector<int8_t> xq;  // tile rows in the amx build
  std::vector<int8_t> abs_xq;
  std::vector<float> xs;
  std::vector<int32_t> corrections;
};
thread_local ActivationScratch activation_scratch;


template <typename Format, typename T>
void dot_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t k = x.size(-1), m = x.numel() / k, tiles = packed.size(0), nb = packed.size(1), kp = nb * kBlock;
  const int64_t n = tiles * kTileRows;
  T* op = out.data_ptr<T>();
  const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());  // uint8, or int8 (int7's tiles)
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t tile_bytes = nb * Format::kBlockBytes;
  ActivationScratch& scratch = activation_scratch;
#ifdef TRITONLLM_AMX
  if (m >= kAmxWidenMinTokens) {
    // bf16 activations of whole blocks are the tiles' rows as they lie; others are converted (or padded) first.
    const uint16_t* xbp = nullptr;
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (k == kp) xbp = reinterpret_cast<const uint16_t*>(x.data_ptr<T>());
    if (xbp == nullptr) {
      uint16_t* converted = grown(scratch.xb, m * kp);
      bf16_rows(x.data_ptr<T>(), m, k, kp, converted);
      xbp = converted;
    }
    work_split::for_each(tiles, 8, [&](int64_t begin, int64_t end) {
      amx_widened_tiles<Format>(wp, begin, end, tile_bytes, nb, xbp, m, bp, op, n);
    });
    return;
  }
  const int64_t scaled_tokens = (m + kAmxTokens - 1) / kAmxTokens * kAmxTokens;  // amx_tile reads whole groups
#else
  const int64_t scaled_tokens = m;
#endif
  int8_t* xqp = grown(scratch.xq, m * kp);
  float* xsp = grown(scratch.xs, scaled_tokens * nb);
  int32_t* correctionp = Format::kOffset != 0 ? grown(scratch.corrections, scaled_tokens * nb) : nullptr;
#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512_VNNI)
  int8_t* abs_xqp = Format::kOffset == 0 ? grown(scratch.abs_xq, m * kp) : nullptr;
  quantize_rows(x.data_ptr<T>(), m, k, kp, xqp, abs_xqp, xsp, correctionp, Format::kOffset);
#else
  quantize_rows(x.data_ptr<T>(), m, k, kp, xqp, nullptr, xsp, correctionp, Format::kOffset);
#endif
  // One item per tile of rows (work_split.h: each thread streams its own tiles, then helps a delayed one).
#if defined(TRITONLLM_AMX)
  if (m >= kAmxInt8MinTokens) {
    // Pieces of 4 tiles: a tile configuration per piece and group of 16 tokens.
    work_split::for_each(tiles, 4, [&](int64_t begin, int64_t end) {
      amx_tiles<Format>(wp, begin, end, tile_bytes, nb, kp, xqp, correctionp, xsp, m, bp, op, n);
    });
    return;
  }
#endif
#if defined(TRITONLLM_AVX512_VNNI)
  work_split::for_each(tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      vnni_tiles<Format>(wp + t * tile_bytes, nb, kp, xqp, correctionp, xsp, m, bp ? bp + t * kTileRows : nullptr,
                         op + t * kTileRows, n);
  });
#elif defined(TRITONLLM_AVX2)
  const __m256i row_order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kSlot));  // slots -> rows
  work_split::for_each(tiles, 2, [&](int64_t begin, int64_t end) {  // 2 tiles of 8 rows: 16, as VNNI's
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      const __m256 bias_rows = bp ? _mm256_loadu_ps(bp + t * kTileRows) : _mm256_setzero_ps();
      for (int64_t m0 = 0; m0 < m; m0 += kPackedTokens) {
        __m256 acc[kPackedTokens];
        const int64_t tokens = std::min<int64_t>(kPackedTokens, m - m0);
        const int8_t* abs_x = abs_xqp ? abs_xqp + m0 * kp : nullptr;
        const int32_t* sums = correctionp ? correctionp + m0 * nb : nullptr;
        const int8_t* x = xqp + m0 * kp;
        const float* s = xsp + m0 * nb;
        with_tokens<kPackedTokens>(tokens, [&](auto rm) {
          packed_tile<Format, decltype(rm)::value>(tile, nb, x, abs_x, sums, s, acc);
        });
        for (int64_t i = 0; i < tokens; ++i)
          store_rows(_mm256_add_ps(_mm256_permutevar8x32_ps(acc[i], row_order), bias_rows), op + (m0 + i) * n + t * kTileRows);
      }
    }
  });
#else
  work_split::for_each(tiles, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(m * kTileRows);  // [token][row]
    for (int64_t t = begin; t < end; ++t) {
      portable_tile<Format>(wp + t * tile_bytes, nb, xqp, xsp, m, rows.data());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t row = t * kTileRows + r;
          op[i * n + row] = static_cast<T>(rows[i * kTileRows + r] + (bp ? bp[row] : 0.f));
        }
    }
  });
#endif
}

// x [..., K] float32/bfloat16 times packed weights of `Format` (tiles of kTileRows rows) into out.
template <typename Format>
void block_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t tiles = packed.size(0), nb = packed.size(1);
  TORCH_CHECK(x.size(-1) <= nb * kBlock && x.size(-1) > (nb - 1) * kBlock, errors::message("activations have ", x.size(-1), " features; the weight holds ", nb * kBlock, " (padded)"));
  check_activations(x, x.size(-1));
  check_bias(bias, tiles * kTileRows);
  check_output(out, x, tiles * kTileRows);
  if (x.scalar_type() == at::kFloat) return dot_product<Format, float>(x, packed, bias, out);
  dot_product<Format, at::BFloat16>(x, packed, bias, out);
}

// A packed weight of `Format`, uint8 [ceil(n / kTileRows), nb, Format::kBlockBytes], with every row's fp16 scales in
// place (scales: float32 [n, nb]; 0 for the rows past n that fill the last tile); put(tile, b, r, row) writes row
// `row`'s weights of block b at row r of `tile` (a zero weight for row >= n).
template <typename Format, typename Put>
at::Tensor packed_tiles(int64_t n, int64_t nb, const at::Tensor& scales, Put put) {
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
  at::Tensor packed = at::zeros({tiles, nb, Format::kBlockBytes}, scales.options().dtype(at::kByte));
  const float* sp = scales.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  work_split::for_each(tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = pp + t * nb * Format::kBlockBytes;
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t row = t * kTileRows + r;
        for (int64_t b = 0; b < nb; ++b) {
          const c10::Half scale(row < n ? sp[row * nb + b] : 0.f);
          std::memcpy(tile + b * Format::kBlockBytes + scale_offset(0, r), &scale, 2);
          put(tile, b, r, row);
        }
      }
    }
  });
  return packed;
}

// Tiles of int8's layout (int8_pack, or int7_pack: `format`), stored as `dtype` (uint8; int7's int8).
void check_packed(const at::Tensor& packed, at::ScalarType dtype = at::kByte, const char* format = "int8") {
  TORCH_CHECK(packed.scalar_type() == dtype && packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kTileBlock,
              errors::message("packed ", format, " weights must be contiguous ", dtype == at::kByte ? "uint8" : "int8",
                              " [tiles, blocks, ", kTileBlock, "] (from ", format, "_pack)"));
}

// int8 weights [N, Kp] in int8's tiles of `Format`, each stored + Format::kOffset (int8_pack, int7_pack).
template <typename Format>
at::Tensor pack_int8_weights(const at::Tensor& w, const at::Tensor& ws) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) % kBlock == 0, "weight must be contiguous int8 [N, K padded to 32]");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.size(0) == w.size(0) && ws.size(1) == w.size(1) / kBlock, "scales must be float32 [N, K/32]");
  const int64_t n = w.size(0), kp = w.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  return packed_tiles<Format>(n, kp / kBlock, ws, [&](uint8_t* tile, int64_t b, int64_t r, int64_t row) {
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t weight = row < n ? wp[row * kp + b * kBlock + i] : 0;
      tile[weight_offset(b, r, i)] = static_cast<uint8_t>(weight + Format::kOffset);  // + 128: w ^ 0x80
    }
  });
}

}  // namespace

// w int8 [N, Kp] (Kp = K rounded up to 32, zero-padded), ws float32 [N, Kp/32] -> the kernels' layout,
// uint8 [ceil(N/R), Kp/32, R * 34] for tiles of R rows (8, or 16 in the VNNI builds);
// rows past N are zeros. Scales are rounded to fp16 (exact for those of quant.quantize_int8_blocks, which
// picks fp16 values).
at::Tensor int8_pack(const at::Tensor& w, const at::Tensor& ws) { return pack_int8_weights<Int8Format>(w, ws); }

// x [..., K] float32/bfloat16; packed from int8_pack; bias (optional) padded like the rows, to ceil(N/R) * R for
// tiles of R rows. out [..., ceil(N/R) * R] in x's dtype, written: callers drop the padded rows.
void int8_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  check_packed(packed);
  block_linear_into<Int8Format>(x, packed, bias, out);
}

// From how many tokens int8 and int4 linears multiply bf16 activations by weights widened to bf16 (the amx
// build); 0: never (int8 activations at every size).
int64_t widened_min_tokens() {
#ifdef TRITONLLM_AMX
  return kAmxWidenMinTokens;
#else
  return 0;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  check_packed(packed);
  at::Tensor out = linear_output(x, packed.size(0) * kTileRows);
  int8_linear_into(x, packed, bias, out);
  return out;
}
