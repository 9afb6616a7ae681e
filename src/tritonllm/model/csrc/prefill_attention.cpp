// Causal attention of all of a step's prefill chunks in one call (variable lengths), straight from the paged KV
// cache: rope_and_cache has already written each chunk's own keys and values there, so a chunk after a cached
// prefix and a whole prompt are the same case. Query i of a chunk of L queries over C keys sits at position
// C - L + i and sees keys [0, C - L + i].
// Work is split into tasks of (sequence, kv head, tile of kQueryTile queries); a task runs its rows (each query
// times the query heads of the kv head's group) over tiles of up to kKeyTile keys, converted to fp32 once per
// tile, with an online softmax (flash attention's running max and sum). Tasks differ in cost (later tiles see
// more keys), so threads take them from a shared counter, longest first.
// The avx512_bf16 build runs bf16 caches (and head sizes that are a multiple of 64) on vdpbf16ps: probabilities
// rounded to bf16 (as the values already are), fp32 queries split into two bf16 parts, 32 products per
// instruction into fp32 sums, with key and value tiles laid out in pairs as the instruction reads them
// (Bf16PairTiles). An int8 cache (kv_rows.h) goes through the same tiles: its int8 values are exact in bf16, each
// key's scale multiplies its scores and each value's its probabilities; other builds convert it to fp32 tiles.
// The amx build multiplies the same pair layouts on AMX tiles, 16 rows of queries or probabilities at a time, over
// 128 keys a step.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "amx.h"
#include "errors.h"
#include "kv_rows.h"
#include "simd.h"
#include "work_split.h"

namespace {

constexpr int64_t kQueryTile = 64;  // queries per task: each key tile loaded and converted serves 64 x group rows
constexpr int64_t kKeyTile = 16;  // keys per step: one AVX-512 or two AVX2 vectors of scores per query row
#ifdef TRITONLLM_AVX512
constexpr int kScoreRows = 12, kValueRows = 6;  // 12 or 24 accumulators of AVX-512's 32 registers
#else
constexpr int kScoreRows = 6, kValueRows = 3;  // 12 accumulators + their operands fit AVX2's 16 registers
#endif

struct PrefillTask {
  int64_t seq, head, first, last;  // queries [first, last) of `seq` (0 = the chunk's first), kv head `head`
  int64_t keys;                    // keys its last query sees: the task's cost
};

// Up to kKeyTile keys of the cache (key j's row at cache + at[j]) as fp32, transposed [d, kKeyTile] and
// zero-padded, for the scores.
template <typename C>
void load_keys_transposed(const C* cache, const int64_t* at, int64_t n, int64_t d, float* kt) {
  std::fill(kt, kt + d * kKeyTile, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const C* row = cache + at[j];
    if constexpr (kv_rows::kQuantized<C>) {
      const float s = kv_rows::scale(row, d);
      for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = simd::to_float(row[i]) * s;
    } else {
      for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = simd::to_float(row[i]);
    }
  }
}

// A cached row of d values as fp32.
template <typename C>
void load_values(const C* src, int64_t d, float* out) {
  int64_t i = 0;
#ifdef TRITONLLM_AVX2
  if constexpr (simd::kVectorLoad<C>)
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, simd::load8(src + i));
#endif
  for (; i < d; ++i) out[i] = simd::to_float(src[i]);
  if constexpr (kv_rows::kQuantized<C>) {
    const float s = kv_rows::scale(src, d);
    for (i = 0; i < d; ++i) out[i] *= s;
  }
}

// scores[r][j] = q_r . k_j for R rows and the tile's kKeyTile keys (padding keys score 0). Each step broadcasts
// one query value per row against 16 keys' values (AVX2: 2 loads + R broadcasts per 2R FMAs; AVX-512: 1 load
// per R FMAs with the broadcasts folded in), and no horizontal sums.
template <int R>
void score_rows(const float* q, const float* kt, int64_t d, float* scores) {
#if defined(TRITONLLM_AVX512)
  __m512 acc[R];  // one vector holds a row's kKeyTile scores
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m512 k = _mm512_loadu_ps(kt + i * kKeyTile);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), k, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * kKeyTile, acc[r]);
#elif defined(TRITONLLM_AVX2)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m256 k0 = _mm256_loadu_ps(kt + i * kKeyTile), k1 = _mm256_loadu_ps(kt + i * kKeyTile + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_set1_ps(q[r * d + i]);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(scores + r * kKeyTile, acc[r][0]);
    _mm256_storeu_ps(scores + r * kKeyTile + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kKeyTile; ++j) {
      float a = 0.f;
      for (int64_t i = 0; i < d; ++i) a += q[r * d + i] * kt[i * kKeyTile + j];
      scores[r * kKeyTile + j] = a;
    }
#endif
}

// acc[r] = acc[r] * rescale[r] + sum_j p[r][j] * values[j] for R rows over n keys (values fp32 [n, d]).
template <int R>
void accumulate_rows(const float* p, const float* values, int64_t n, int64_t d, const float* rescale, float* acc) {
  int64_t i = 0;
#if defined(TRITONLLM_AVX512)
  for (; i + 64 <= d; i += 64) {  // R rows x 64 lanes in registers over the keys
    __m512 a[R][4];
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(rescale[r]);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_mul_ps(scale, _mm512_loadu_ps(acc + r * d + i + 16 * c));
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int c = 0; c < 4; ++c) {
        const __m512 v = _mm512_loadu_ps(values + j * d + i + 16 * c);
        for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kKeyTile + j]), v, a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * d + i + 16 * c, a[r][c]);
  }
#endif
#ifdef TRITONLLM_AVX2
  for (; i + 32 <= d; i += 32) {  // R rows x 32 lanes in registers over the keys
    __m256 a[R][4];
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(rescale[r]);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm256_mul_ps(scale, _mm256_loadu_ps(acc + r * d + i + 8 * c));
    }
    for (int64_t j = 0; j < n; ++j) {
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm256_set1_ps(p[r * kKeyTile + j]);
      for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_loadu_ps(values + j * d + i + 8 * c);
        for (int r = 0; r < R; ++r) a[r][c] = _mm256_fmadd_ps(w[r], v, a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + r * d + i + 8 * c, a[r][c]);
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t k = i; k < d; ++k) {
      float a = acc[r * d + k] * rescale[r];
      for (int64_t j = 0; j < n; ++j) a += p[r * kKeyTile + j] * values[j * d + k];
      acc[r * d + k] = a;
    }
}

#ifdef TRITONLLM_AVX512
// exp(x) for x <= 88 (-inf and below -87 give ~0, masked off by the caller): 2^k x a degree-7 polynomial in the
// rest (Cephes' expf, ~1e-7 relative), inline so that the softmax keeps its registers across the call.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, f), f, _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}
#endif

// One step of a row's online softmax over a tile's first `width` scores (a multiple of 16): the first `seen`
// become exp(score - the new running max), the rest 0; the running max and sum move on. Returns the factor for
// the row's earlier sums.
inline float softmax_step(float* row, int64_t seen, int64_t width, float& row_max, float& row_sum) {
  float peak = row_max, total = 0.f;
#ifdef TRITONLLM_AVX512
  const auto live = [seen](int64_t j) {
    return static_cast<__mmask16>((1u << std::clamp<int64_t>(seen - j, 0, 16)) - 1);
  };
  __m512 top = _mm512_set1_ps(peak);
  for (int64_t j = 0; j < width; j += 16) top = _mm512_mask_max_ps(top, live(j), top, _mm512_loadu_ps(row + j));
  peak = _mm512_reduce_max_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(live(j), exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(peak))));
    _mm512_storeu_ps(row + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
  // exp(-inf) here is exp(-87), ~1e-38: the row's first tile scales zeros either way.
  const float rescale = _mm512_cvtss_f32(exp16(_mm512_set1_ps(row_max - peak)));  // no libm call: registers stay
#else
  for (int64_t j = 0; j < seen; ++j) peak = std::max(peak, row[j]);
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < width; ++j) total += (row[j] = j < seen ? std::exp(row[j] - peak) : 0.f);
  const float rescale = std::exp(row_max - peak);  // 0 for the row's first tile (its max was -inf)
#endif
  row_sum = row_sum * rescale + total;
  row_max = peak;
  return rescale;
}

// One key tile's operands in fp32 (keys transposed, values row-major) for score_rows and accumulate_rows.
template <typename C>
struct Fp32Tiles {
  static constexpr int64_t kKeys = kKeyTile;
  static constexpr int64_t width = kKeys;  // scores each tile step softmaxes
  std::vector<float> query, kt, values;  // [rows, d] scaled, [d, kKeyTile], [kKeyTile, d]
  int64_t d;

  Fp32Tiles(int64_t rows, int64_t d) : query(rows * d), kt(d * kKeyTile), values(kKeyTile * d), d(d) {}

  template <typename T>
  void set_query(int64_t r, const T* src, float scale) {
    for (int64_t j = 0; j < d; ++j) query[r * d + j] = simd::to_float(src[j]) * scale;
  }
  // The tile's `run` keys and values: key j's rows at k_cache + at[j] and v_cache + at[j].
  void load(const C* k_cache, const C* v_cache, const int64_t* at, int64_t run) {
    load_keys_transposed(k_cache, at, run, d, kt.data());
    for (int64_t j = 0; j < run; ++j) load_values(v_cache + at[j], d, &values[j * d]);
  }
  // scores[r] for rows [first, rows): the tile's kKeyTile keys each.
  void score(int64_t first, int64_t rows, float* scores) const {
    int64_t r = first;
    for (; r + kScoreRows <= rows; r += kScoreRows) score_rows<kScoreRows>(&query[r * d], kt.data(), d, &scores[r * kKeyTile]);
    for (; r < rows; ++r) score_rows<1>(&query[r * d], kt.data(), d, &scores[r * kKeyTile]);
  }
  // acc[r] = acc[r] * rescale[r] + probs[r] . values for rows [first, rows) over the tile's `run` keys.
  void accumulate(int64_t first, int64_t rows, const float* probs, int64_t run, const float* rescale, float* acc) {
    int64_t r = first;
    for (; r + kValueRows <= rows; r += kValueRows)
      accumulate_rows<kValueRows>(&probs[r * kKeyTile], values.data(), run, d, &rescale[r], &acc[r * d]);
    for (; r < rows; ++r) accumulate_rows<1>(&probs[r * kKeyTile], values.data(), run, d, &rescale[r], &acc[r * d]);
  }
};

#ifdef TRITONLLM_AVX512_BF16
using simd::as_bf16;

// vpermt2w indices that interleave two rows of 32 bf16 lane by lane (index i < 32 picks lane i of the first row,
// 32 + i lane i of the second): lanes 0-15 of each, then lanes 16-31.
constexpr std::array<uint16_t, 32> interleave_lanes(uint16_t first) {
  std::array<uint16_t, 32> picks{};
  for (uint16_t i = 0; i < 16; ++i) picks[2 * i] = first + i, picks[2 * i + 1] = 32 + first + i;
  return picks;
}
alignas(64) constexpr std::array<uint16_t, 32> kPickLow = interleave_lanes(0), kPickHigh = interleave_lanes(16);

// Keys per bf16 tile step. vdpbf16ps: 32, the softmax's per-row work spread over twice the keys. AMX: 128, so
// that the sums' rescaling and their tile loads and stores (one per 16 rows and 32 keys at 32 keys a step) happen
// once per 128 keys; the tile's last step covers its run rounded up to 32 (Bf16PairTiles::width).
#ifdef TRITONLLM_AMX
constexpr int64_t kPairKeys = 128;
#else
constexpr int64_t kPairKeys = 32;
#endif

// scores[r][j] = q_r . k_j from bf16 pairs: q [R, d/2] (2 dims a word), kt [d/2, kPairKeys] (key j's dims 2p and
// 2p+1 at word p * kPairKeys + j). One vdpbf16ps per row, pair of dims and 16 keys; kSplit adds q_lo's (fp32
// queries as bf16 q + q_lo: products as exact as fp32's, as the keys are bf16 already).
template <int R, bool kSplit>
void score_rows_bf16(const uint32_t* q, const uint32_t* q_lo, const uint32_t* kt, int64_t pairs, float* scores) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k0 = as_bf16(_mm512_loadu_si512(kt + p * kPairKeys));
    const __m512bh k1 = as_bf16(_mm512_loadu_si512(kt + p * kPairKeys + 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh qr = as_bf16(_mm512_set1_epi32(q[r * pairs + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, k1);
      if constexpr (kSplit) {
        const __m512bh lo = as_bf16(_mm512_set1_epi32(q_lo[r * pairs + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], lo, k1);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(scores + r * kPairKeys, acc[r][0]);
    _mm512_storeu_ps(scores + r * kPairKeys + 16, acc[r][1]);
  }
}

// acc[r] = acc[r] * rescale[r] + sum_j p[r][j] * v_j for R rows: p [R, kPairKeys / 2] (keys 2m and 2m+1 at
// word m), values [kPairKeys / 2, d, 2] (value lane l of keys 2m and 2m+1 side by side).
template <int R>
void accumulate_rows_bf16(const uint32_t* p, const uint16_t* values, int64_t pairs, int64_t d, const float* rescale,
                          float* acc) {
  constexpr int64_t kRowWords = kPairKeys / 2;
  for (int64_t i = 0; i < d; i += 64) {  // R rows x 64 lanes in registers over the key pairs
    __m512 a[R][4];
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(rescale[r]);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_mul_ps(scale, _mm512_loadu_ps(acc + r * d + i + 16 * c));
    }
    for (int64_t m = 0; m < pairs; ++m) {
      for (int c = 0; c < 4; ++c) {
        const __m512bh v = as_bf16(_mm512_loadu_si512(values + m * 2 * d + 2 * (i + 16 * c)));
        for (int r = 0; r < R; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], as_bf16(_mm512_set1_epi32(p[r * kRowWords + m])), v);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * d + i + 16 * c, a[r][c]);
  }
}

#ifdef TRITONLLM_AMX
// The same products on AMX tiles (the amx build), 16 rows at a time: the pair layouts above are what tdpbf16ps
// reads as they lie (queries and probabilities: 64-byte rows of 32 bf16; kt and values: 16 pairs a weight tile).
// Every tile is 16 rows x 64 bytes: sums 0-1 (value sums 0-3), rows of queries or probabilities 4 (and 5: the
// low parts), keys or values 6-7.
namespace prefill_amx {

inline void configure() {
  amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// scores[r][j] (rows kPairKeys floats apart) = q_r . k_j for 16 rows and the first `width` keys (a multiple of
// 32): q [16, d/2] (and q_lo), kt [d/2, kPairKeys], as score_rows_bf16 takes them.
template <bool kSplit>
inline void score_rows(const uint32_t* q, const uint32_t* q_lo, const uint32_t* kt, int64_t pairs, int64_t width,
                       float* scores) {
  for (int64_t j = 0; j < width; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t p = 0; p < pairs; p += 16) {
      _tile_loadd(4, q + p, pairs * 4);
      _tile_loadd(6, kt + p * kPairKeys + j, kPairKeys * 4);
      _tile_loadd(7, kt + p * kPairKeys + j + 16, kPairKeys * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (kSplit) {
        _tile_loadd(5, q_lo + p, pairs * 4);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(1, 5, 7);
      }
    }
    _tile_stored(0, scores + j, kPairKeys * 4);
    _tile_stored(1, scores + j + 16, kPairKeys * 4);
  }
}

// acc[r] += sum_j p[r][j] * v_j for 16 rows (d floats apart, d a multiple of 64) over the first `width` keys (a
// multiple of 32): p [16, kPairKeys / 2], values [kPairKeys / 2, d, 2], as accumulate_rows_bf16 takes them (which
// also rescales acc: done before, here). 64 lanes of sums stay in tiles 0-3 across the keys.
inline void accumulate_rows(const uint32_t* p, const uint16_t* values, int64_t d, int64_t width, float* acc) {
  for (int64_t i = 0; i < d; i += 64) {
    _tile_loadd(0, acc + i, d * 4);
    _tile_loadd(1, acc + i + 16, d * 4);
    _tile_loadd(2, acc + i + 32, d * 4);
    _tile_loadd(3, acc + i + 48, d * 4);
    for (int64_t j = 0; j < width; j += 32) {
      const uint16_t* pairs = values + j * d;  // key pair j / 2 on
      _tile_loadd(4, p + j / 2, kPairKeys / 2 * 4);
      _tile_loadd(6, pairs + 2 * i, d * 4);
      _tile_loadd(7, pairs + 2 * (i + 16), d * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, pairs + 2 * (i + 32), d * 4);
      _tile_loadd(7, pairs + 2 * (i + 48), d * 4);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc + i, d * 4);
    _tile_stored(1, acc + i + 16, d * 4);
    _tile_stored(2, acc + i + 32, d * 4);
    _tile_stored(3, acc + i + 48, d * 4);
  }
}

}  // namespace prefill_amx
#endif

// A row of d int8 values (d a multiple of 16) as bf16, exactly.
inline void widen_int8_row(const int8_t* src, int64_t d, at::BFloat16* dst) {
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(x));
  }
}

// A key tile's operands as vdpbf16ps reads them (a bf16 or int8 cache C; d a multiple of 64): keys and values in
// pairs, probabilities rounded to bf16, queries too unless kSplitQuery (fp32 queries as two bf16 parts: rounding
// them shifted scores by up to ~0.1 where SmolLM2's outlier dims make q . k large, +1.2% perplexity under int8).
// Padding keys are zeros.
template <bool kSplitQuery, typename C = at::BFloat16>
struct Bf16PairTiles {
  static constexpr int64_t kKeys = kPairKeys;
  // Tile operands, on cache lines: [rows, d/2] x 2, [d/2, kKeys], [rows, kKeys/2]: bf16 pairs; [kKeys/2, d, 2].
  simd::LineVector<uint32_t> query, query_lo, kt, probs;
  simd::LineVector<uint16_t> values;
  // An int8 cache's tile widened to bf16 ([kKeys, d] each), and each key's and value's scale (0 past the run).
  std::vector<at::BFloat16> wide_keys, wide_values;
  alignas(64) float key_scale[kKeys], value_scale[kKeys];
  int64_t d;
  int64_t width = kKeys;  // the loaded tile's run rounded up to 32: what score, softmax and accumulate cover

  Bf16PairTiles(int64_t rows, int64_t d)
      : query(rows * d / 2), query_lo(kSplitQuery ? rows * d / 2 : 0), kt(d / 2 * kKeys), probs(rows * kKeys / 2),
        values(kKeys * d), wide_keys(kv_rows::kQuantized<C> ? kKeys * d : 0),
        wide_values(kv_rows::kQuantized<C> ? kKeys * d : 0), d(d) {
#ifdef TRITONLLM_AMX
    prefill_amx::configure();  // this thread's tiles for the whole kernel (rows: a multiple of 16, kQueryTile x group)
#endif
  }
#ifdef TRITONLLM_AMX
  ~Bf16PairTiles() { _tile_release(); }
  Bf16PairTiles(const Bf16PairTiles&) = delete;
  Bf16PairTiles& operator=(const Bf16PairTiles&) = delete;
#endif

  template <typename T>
  void set_query(int64_t r, const T* src, float scale) {
    auto* hi = reinterpret_cast<at::BFloat16*>(&query[r * d / 2]);
    auto* lo = reinterpret_cast<at::BFloat16*>(lo_row(r));
    for (int64_t j = 0; j < d; ++j) {
      const float x = simd::to_float(src[j]) * scale;
      hi[j] = at::BFloat16(x);
      if constexpr (kSplitQuery) lo[j] = at::BFloat16(x - float(hi[j]));
    }
  }
  // Row r's low query parts; null without kSplitQuery (query_lo is empty then).
  uint32_t* lo_row(int64_t r) { return kSplitQuery ? &query_lo[r * d / 2] : nullptr; }
  const uint32_t* lo_row(int64_t r) const { return kSplitQuery ? &query_lo[r * d / 2] : nullptr; }
  void load(const C* k_cache, const C* v_cache, const int64_t* at, int64_t run) {
    width = (run + 31) / 32 * 32;
    if constexpr (kv_rows::kQuantized<C>) {
      int64_t rows[kKeys];
      for (int64_t j = 0; j < kKeys; ++j) {
        rows[j] = j * d;
        key_scale[j] = j < run ? kv_rows::scale(k_cache + at[j], d) : 0.f;
        value_scale[j] = j < run ? kv_rows::scale(v_cache + at[j], d) : 0.f;
      }
      for (int64_t j = 0; j < run; ++j) {
        widen_int8_row(k_cache + at[j], d, &wide_keys[j * d]);
        widen_int8_row(v_cache + at[j], d, &wide_values[j * d]);
      }
      load_pairs(wide_keys.data(), wide_values.data(), rows, run);
    } else {
      load_pairs(k_cache, v_cache, at, run);
    }
  }
  void load_pairs(const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int64_t* at, int64_t run) {
    const int64_t pairs = d / 2;
    for (int64_t j = 0; j < width; ++j) {
      const auto* words = reinterpret_cast<const uint32_t*>(k_cache + at[std::min(j, run - 1)]);
      for (int64_t p = 0; p < pairs; ++p) kt[p * kKeys + j] = j < run ? words[p] : 0;
    }
    const __m512i pick_low = _mm512_load_si512(kPickLow.data()), pick_high = _mm512_load_si512(kPickHigh.data());
    const auto row = [&](int64_t j, int64_t i) {
      return j < run ? _mm512_loadu_si512(v_cache + at[j] + i) : _mm512_setzero_si512();
    };
    for (int64_t m = 0; m < width / 2; ++m)
      for (int64_t i = 0; i < d; i += 32) {
        const __m512i first = row(2 * m, i), second = row(2 * m + 1, i);
        _mm512_storeu_si512(&values[m * 2 * d + 2 * i], _mm512_permutex2var_epi16(first, pick_low, second));
        _mm512_storeu_si512(&values[m * 2 * d + 2 * i + 32], _mm512_permutex2var_epi16(first, pick_high, second));
      }
  }
  void score(int64_t first, int64_t rows, float* scores) const {
    const int64_t pairs = d / 2;
#ifdef TRITONLLM_AMX
    // Blocks of 16 rows from first rounded down: rows before first and past rows (still inside the buffers, which
    // hold a multiple of 16) are scored too, and nobody reads those scores.
    amx::stores_before_tile_loads();
    for (int64_t r = first / 16 * 16; r < rows; r += 16)
      prefill_amx::score_rows<kSplitQuery>(&query[r * pairs], lo_row(r), kt.data(), pairs, width, &scores[r * kKeys]);
#else
    int64_t r = first;
    for (; r + kScoreRows <= rows; r += kScoreRows)
      score_rows_bf16<kScoreRows, kSplitQuery>(&query[r * pairs], lo_row(r), kt.data(), pairs, &scores[r * kKeys]);
    for (; r < rows; ++r)
      score_rows_bf16<1, kSplitQuery>(&query[r * pairs], lo_row(r), kt.data(), pairs, &scores[r * kKeys]);
#endif
    if constexpr (kv_rows::kQuantized<C>) {
      for (int64_t r = first; r < rows; ++r)
        for (int64_t j = 0; j < width; j += 16)
          _mm512_storeu_ps(&scores[r * kKeys + j], _mm512_mul_ps(_mm512_load_ps(key_scale + j), _mm512_loadu_ps(&scores[r * kKeys + j])));
    }
  }
  void accumulate(int64_t first, int64_t rows, const float* p, int64_t run, const float* rescale, float* acc) {
    for (int64_t r = first; r < rows; ++r)
      for (int64_t j = 0; j < width; j += 32) {
        __m512 low = _mm512_loadu_ps(p + r * kKeys + j), high = _mm512_loadu_ps(p + r * kKeys + j + 16);
        if constexpr (kv_rows::kQuantized<C>) {
          low = _mm512_mul_ps(low, _mm512_load_ps(value_scale + j));
          high = _mm512_mul_ps(high, _mm512_load_ps(value_scale + j + 16));
        }
        _mm512_storeu_si512(&probs[r * kKeys / 2 + j / 2], (__m512i)_mm512_cvtne2ps_pbh(high, low));
      }
#ifdef TRITONLLM_AMX
    // Blocks of 16 rows from first rounded down: the rows before first keep their sums (zero probabilities, no
    // rescaling); the padding keys' probabilities are zeros (softmax_step) times zero values.
    const int64_t block_first = first / 16 * 16;
    std::fill(probs.begin() + block_first * kKeys / 2, probs.begin() + first * kKeys / 2, 0u);
    for (int64_t r = first; r < rows; ++r) {
      const __m512 scale = _mm512_set1_ps(rescale[r]);
      for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(acc + r * d + i, _mm512_mul_ps(scale, _mm512_loadu_ps(acc + r * d + i)));
    }
    amx::stores_before_tile_loads();
    for (int64_t r = block_first; r < rows; r += 16)
      prefill_amx::accumulate_rows(&probs[r * kKeys / 2], values.data(), d, width, &acc[r * d]);
    (void)run;  // every pair of the tile is multiplied: past the run, zero probabilities times zero values
#else
    const int64_t pairs = (run + 1) / 2;
    int64_t r = first;
    for (; r + kValueRows <= rows; r += kValueRows)
      accumulate_rows_bf16<kValueRows>(&probs[r * kKeys / 2], values.data(), pairs, d, &rescale[r], &acc[r * d]);
    for (; r < rows; ++r) accumulate_rows_bf16<1>(&probs[r * kKeys / 2], values.data(), pairs, d, &rescale[r], &acc[r * d]);
#endif
  }
};
#endif

// T: the queries' and output's dtype; C: the cache's (T, bf16 under fp32 queries, or int8); Tiles: the operands'
// layout and dot products (Fp32Tiles, or Bf16PairTiles for a bf16 cache in the avx512_bf16 build).
template <typename T, typename C, typename Tiles>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& context_lens,
                    double scale, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(0), group = heads / kv_heads;
  const int64_t block_size = k_cache.size(2), row = k_cache.size(3), per_head = k_cache.size(1) * block_size * row;
  const int64_t seqs = context_lens.size(0), width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t length = starts[s + 1] - starts[s], cached = lens[s] - length;
    for (int64_t first = 0; first < length; first += kQueryTile) {
      const int64_t last = std::min(length, first + kQueryTile);
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, first, last, cached + last});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) { return a.keys > b.keys; });

  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  work_split::for_each(std::min<int64_t>(n, work_split::num_threads()), 1, [&](int64_t, int64_t) {
    const int64_t rows_max = kQueryTile * group;
    Tiles tiles_of_task(rows_max, d);
    constexpr int64_t kKeys = Tiles::kKeys;
    simd::LineVector<float> acc(rows_max * d), scores(rows_max * kKeys);  // the AMX build's tiles load and store them
    std::vector<float> row_max(rows_max), row_sum(rows_max), rescale(rows_max);
    std::vector<int64_t> row_end(rows_max);  // keys [0, row_end[r]) are row r's
    int64_t at[kKeys];                       // the key tile's rows in the caches
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const PrefillTask& task = tasks[i];
      const int64_t cached = task.keys - task.last;
      const int64_t rows = (task.last - task.first) * group;  // row r: query first + r / group, head r % group
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + ((starts[task.seq] + task.first + r / group) * heads + task.head * group + r % group) * d;
        tiles_of_task.set_query(r, src, static_cast<float>(scale));
        row_end[r] = cached + task.first + r / group + 1;
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
      const int64_t* table = tables + task.seq * width;
      for (int64_t t = 0; t < task.keys;) {
        const int64_t run = std::min(kKeys, task.keys - t);
        for (int64_t j = 0; j < run; ++j)
          at[j] = task.head * per_head + (table[(t + j) / block_size] * block_size + (t + j) % block_size) * row;
        tiles_of_task.load(kp, vp, at, run);
        // Rows before the diagonal see the whole run; only the tile's first rows may see none of it.
        const int64_t first_row = std::max<int64_t>(0, (t - cached - task.first) * group);
        tiles_of_task.score(first_row, rows, scores.data());
        for (int64_t r = first_row; r < rows; ++r) {
          const int64_t seen = std::min(run, row_end[r] - t);  // >= 1 from first_row on
          rescale[r] = softmax_step(&scores[r * kKeys], seen, tiles_of_task.width, row_max[r], row_sum[r]);
        }
        tiles_of_task.accumulate(first_row, rows, scores.data(), run, rescale.data(), acc.data());
        t += run;
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = op + ((starts[task.seq] + task.first + r / group) * heads + task.head * group + r % group) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[r * d + j] / row_sum[r]);
      }
    }
  });
}

}  // namespace

// q [T, heads, head_dim]: the prefill chunks' queries back to back, chunk s at rows [query_starts[s],
// query_starts[s + 1]); block_tables [S, W] and context_lens [S] (keys each chunk's last query sees) per chunk.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_starts,
                                   const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [tokens, heads, head_dim]");
  const kv_rows::Kind kind = kv_rows::check(k_cache, v_cache, q.scalar_type());
  const bool bf16_cache = kind == kv_rows::Kind::kBf16UnderFp32;
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == kv_rows::head_dim(k_cache), "q's heads do not fit the cache");
  const auto tables = block_tables.contiguous(), starts = query_starts.contiguous(), lens = context_lens.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "block tables, query starts and context lengths must be int64");
  const int64_t seqs = lens.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seqs && starts.numel() == seqs + 1, "one table, start and length per chunk");
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  TORCH_CHECK(seqs == 0 || (s[0] == 0 && s[seqs] == q.size(0)), "query starts must run from 0 to q's tokens");
  for (int64_t i = 0; i < seqs; ++i)
    TORCH_CHECK(s[i + 1] > s[i] && l[i] >= s[i + 1] - s[i] && l[i] <= tables.size(1) * k_cache.size(2),
                errors::message("chunk ", i, ": needs 1 <= queries <= keys <= its table's capacity"));
  auto out = at::empty_like(q);
#ifdef TRITONLLM_AVX512_BF16
  if (kind == kv_rows::Kind::kInt8 && q.size(2) % 64 == 0) {
    if (q.scalar_type() == at::kFloat) prefill_kernel<float, int8_t, Bf16PairTiles<true, int8_t>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    else prefill_kernel<at::BFloat16, int8_t, Bf16PairTiles<false, int8_t>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    return out;
  }
#endif
  if (kind == kv_rows::Kind::kInt8) {
    if (q.scalar_type() == at::kFloat) prefill_kernel<float, int8_t, Fp32Tiles<int8_t>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    else prefill_kernel<at::BFloat16, int8_t, Fp32Tiles<int8_t>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    return out;
  }
#ifdef TRITONLLM_AVX512_BF16
  if (k_cache.scalar_type() == at::kBFloat16 && q.size(2) % 64 == 0) {
    if (bf16_cache) prefill_kernel<float, at::BFloat16, Bf16PairTiles<true>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    else prefill_kernel<at::BFloat16, at::BFloat16, Bf16PairTiles<false>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    return out;
  }
#endif
  if (bf16_cache) {
    prefill_kernel<float, at::BFloat16, Fp32Tiles<at::BFloat16>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    prefill_kernel<scalar_t, scalar_t, Fp32Tiles<scalar_t>>(q, k_cache, v_cache, tables, starts, lens, scale, out);
  });
  return out;
}
