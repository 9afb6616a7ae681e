// Decode attention over a bf16 cache on AVX512_BF16 CPUs (paged_attention.cpp's span_scores and span_values
// take these paths): vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 sums, with no widening of the cache's
// values. fp32 queries go in as two bf16 parts (hi + lo: products as exact as fp32's, the keys being bf16;
// rounding them shifted scores where SmolLM2's outlier dims make q . k large, as in the prefill), the softmax's
// probabilities as bf16. Against the fp32 FMAs over widened values: 0.82-0.93 of decode attention's time
// (benchmarks/README.md).
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "simd.h"

#ifdef TRITONLLM_AVX512_BF16
namespace decode_bf16 {

inline bool supports(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// One span's queries [group, d] as bf16 parts, and the scratch its scores use.
struct Query {
  std::vector<uint16_t> hi, lo;
  bool split = false;  // false when every low part is zero (bf16 queries times a power-of-two scale)
  simd::LineVector<at::BFloat16> padded;  // a last group of fewer than 16 keys, zeros after it (tile rows)

  // The vector form of prefill_attention.cpp's set_query split. One helper for both was tried: the same
  // outputs to the bit, but decode attention over 30 layers' caches took 1.11-1.19x the time (paired, Zen 4;
  // not understood), so the two stay apart.
  void set(const float* q, int64_t n) {  // n: a multiple of 16
    hi.resize(n);
    lo.resize(n);
    __mmask16 any_low = 0;
    for (int64_t j = 0; j < n; j += 16) {
      const __m512 x = _mm512_loadu_ps(q + j);
      const __m256i high = (__m256i)_mm512_cvtneps_pbh(x);
      const __m512 rest = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(high), 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi.data() + j), high);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo.data() + j), (__m256i)_mm512_cvtneps_pbh(rest));
      any_low |= _mm512_cmpneq_ps_mask(rest, _mm512_setzero_ps());
    }
    split = any_low != 0;
  }
};

// Lane j of the result = the sum of a[j]'s 16 lanes: four rounds of shuffles and adds on pairs (46 operations
// for 16 keys, where 16 separate horizontal sums take about twice that), then one permute into key order.
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int j = 0; j < 8; ++j)  // 256-bit halves: lanes 0-7 of b[j] hold a[j]'s sums, 8-15 a[j + 8]'s
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit quarters: keys j, j + 8, j + 4, j + 12
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)  // in each quarter, alternating lanes: c[j]'s key, c[j + 2]'s key
    e[j] = _mm512_add_ps(_mm512_unpacklo_ps(c[j], c[j + 2]), _mm512_unpackhi_ps(c[j], c[j + 2]));
  const __m512d e0 = _mm512_castps_pd(e[0]), e1 = _mm512_castps_pd(e[1]);
  const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e0, e1)), _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e1)));
  // sums holds keys 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), sums);
}

// q . k_u for 16 keys from k (rows D apart): one vdpbf16ps per key and 32 dims, two with kSplit. D is a
// template argument so that the 16 rows are constant offsets from k (a runtime head size left GCC holding 16
// row pointers on the stack and spilling registers).
template <int D, bool kSplit>
inline __m512 scores_of_16_keys(const uint16_t* q_hi, const uint16_t* q_lo, const at::BFloat16* k) {
  __m512 acc[16];
  TRITONLLM_UNROLL for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
  TRITONLLM_UNROLL for (int i = 0; i < D; i += 32) {
    const __m512bh hi = simd::as_bf16(_mm512_loadu_si512(q_hi + i));
    const __m512bh lo = kSplit ? simd::as_bf16(_mm512_loadu_si512(q_lo + i)) : hi;
    TRITONLLM_UNROLL for (int u = 0; u < 16; ++u) {
      const __m512bh kv = simd::as_bf16(_mm512_loadu_si512(k + u * D + i));
      acc[u] = _mm512_dpbf16_ps(acc[u], hi, kv);
      if constexpr (kSplit) acc[u] = _mm512_dpbf16_ps(acc[u], lo, kv);
    }
  }
  return hsum16(acc);
}

template <int D, bool kSplit>
void scores_of_run(Query& q, int64_t group, const at::BFloat16* k, int64_t run, int64_t len, float* out) {
  for (int64_t j = 0; j < run; j += 16) {
    const int64_t keys = std::min<int64_t>(16, run - j);
    const at::BFloat16* rows = k + j * D;
    if (keys < 16) {
      q.padded.assign(16 * D, at::BFloat16(0.f));
      std::copy(rows, rows + keys * D, q.padded.begin());
      rows = q.padded.data();
    }
    const __mmask16 live = static_cast<__mmask16>((1u << keys) - 1);
    for (int64_t g = 0; g < group; ++g)
      _mm512_mask_storeu_ps(out + g * len + j, live, scores_of_16_keys<D, kSplit>(q.hi.data() + g * D, q.lo.data() + g * D, rows));
  }
}

// Scores of `run` keys from k (rows d apart, d as `supports`) into out, head g's at out + g * len, 16 keys at a
// time; a last group of fewer keys is scored from a zero-padded copy, and only its own lanes are stored.
inline void scores(Query& q, int64_t group, int64_t d, const at::BFloat16* k, int64_t run, int64_t len, float* out) {
  if (d == 64) q.split ? scores_of_run<64, true>(q, group, k, run, len, out) : scores_of_run<64, false>(q, group, k, run, len, out);
  else q.split ? scores_of_run<128, true>(q, group, k, run, len, out) : scores_of_run<128, false>(q, group, k, run, len, out);
}

#ifdef TRITONLLM_AMX
// The same scores on AMX tiles (the amx build), 16 keys a tdpbf16ps: tile 0 sums the keys' rows as they lie in the
// cache (tiles 1 and 2: 16 keys x 32 dims, one per 32 dims) times the group's queries as a weight tile (tiles
// 4-7: 16 pairs of dims x G heads, the hi and lo parts each their own tile, loaded once a span). A gather a head
// puts the 16 x G sums in key order. Where vdpbf16ps needs 2 x D / 32 products and a horizontal sum per key and
// head, this is D / 32 tile products (twice with lo parts) per 16 keys for the whole group. It takes what fits
// the four weight tiles: D / 32 x parts <= 4 (head size 64, or 128 with bf16 queries), and groups up to 16 heads.
class Tiles {
 public:
  // Loads q's parts into the weight tiles; false (nothing loaded) where they do not fit.
  bool load(const Query& q, int64_t group, int64_t d) {
    const int parts = q.split ? 2 : 1, steps = static_cast<int>(d / 32);
    if (group > 16 || steps * parts > 4) return false;
    amx::TileConfig config;
    config.rows[0] = config.rows[1] = config.rows[2] = 16;
    config.colsb[0] = static_cast<uint16_t>(4 * group);
    config.colsb[1] = config.colsb[2] = 64;
    alignas(64) uint32_t pairs[16 * 16];
    for (int s = 0; s < steps; ++s)
      for (int part = 0; part < parts; ++part) {
        const int tile = 4 + s * parts + part;
        config.rows[tile] = 16;
        config.colsb[tile] = static_cast<uint16_t>(4 * group);
      }
    _tile_loadconfig(&config);
    loaded_ = true;
    for (int s = 0; s < steps; ++s)
      for (int part = 0; part < parts; ++part) {
        const uint16_t* src = (part == 0 ? q.hi : q.lo).data() + 32 * s;
        for (int p = 0; p < 16; ++p)  // row p: each head's dims 32s + 2p and 32s + 2p + 1
          for (int64_t g = 0; g < group; ++g) std::memcpy(&pairs[p * group + g], src + g * d + 2 * p, 4);
        amx::stores_before_tile_loads();
        switch (s * parts + part) {  // tile numbers must be literals
          case 0: _tile_loadd(4, pairs, 4 * group); break;
          case 1: _tile_loadd(5, pairs, 4 * group); break;
          case 2: _tile_loadd(6, pairs, 4 * group); break;
          default: _tile_loadd(7, pairs, 4 * group); break;
        }
      }
    return true;
  }

  // decode_bf16::scores on the loaded tiles (same arguments).
  void scores(Query& q, int64_t group, int64_t d, const at::BFloat16* k, int64_t run, int64_t len, float* out) {
    if (d == 64) q.split ? run_scores<64, true>(q, group, k, run, len, out) : run_scores<64, false>(q, group, k, run, len, out);
    else run_scores<128, false>(q, group, k, run, len, out);
  }

  ~Tiles() {
    if (loaded_) _tile_release();
  }

 private:
  template <int D, bool kSplit>
  void run_scores(Query& q, int64_t group, const at::BFloat16* k, int64_t run, int64_t len, float* out) {
    const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int64_t j = 0; j < run; j += 16) {
      const int64_t keys = std::min<int64_t>(16, run - j);
      const at::BFloat16* first = k + j * D;
      if (keys < 16) {  // a full tile of rows from a zero-padded copy: reading past the run could leave the cache
        q.padded.assign(16 * D, at::BFloat16(0.f));
        std::copy(first, first + keys * D, q.padded.begin());
        first = q.padded.data();
        amx::stores_before_tile_loads();
      }
      _tile_zero(0);
      _tile_loadd(1, first, 2 * D);
      _tile_dpbf16ps(0, 1, 4);
      if constexpr (kSplit) _tile_dpbf16ps(0, 1, 5);
      _tile_loadd(2, first + 32, 2 * D);
      if constexpr (kSplit) {
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(0, 2, 7);
      } else {
        _tile_dpbf16ps(0, 2, 5);
      }
      if constexpr (D == 128) {
        _tile_loadd(1, first + 64, 2 * D);
        _tile_dpbf16ps(0, 1, 6);
        _tile_loadd(2, first + 96, 2 * D);
        _tile_dpbf16ps(0, 2, 7);
      }
      _tile_stored(0, sums_, 64);
      const __mmask16 live = static_cast<__mmask16>((1u << keys) - 1);
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(out + g * len + j, live, _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(g))), sums_, 4));
    }
  }

  alignas(64) float sums_[16 * 16];  // [key][head]
  bool loaded_ = false;
};
#endif

// Probabilities [rows, len] as bf16 rows of len + 1 (a zero last: an odd run's pair reads one past it).
inline void bf16_probabilities(const float* p, int64_t rows, int64_t len, std::vector<uint16_t>& out) {
  out.resize(rows * (len + 1));
  for (int64_t g = 0; g < rows; ++g) {
    uint16_t* dst = out.data() + g * (len + 1);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + g * len + t)));
    for (; t < len; ++t) dst[t] = at::BFloat16(p[g * len + t]).x;
    dst[len] = 0;
  }
}

// acc[g] += sum_j p_g[j] v_j over a run of values (rows d apart), 64 dims [i, i + 64) for query heads
// [g0, g0 + G). Two keys' values are interleaved by unpacklo/unpackhi, which leaves each 32 dims' sums as
// [the low quarters' 4 lanes ...][the high quarters' ...] in acc: unpermute_sums puts them back once a span.
// p: bf16 probabilities, head g's at p + g * stride, readable one past the run.
template <int G>
inline void values_of_run(const uint16_t* p, int64_t stride, const at::BFloat16* v, int64_t run, int64_t d,
                          int64_t i, int64_t g0, float* acc) {
  __m512 a[G][4];
  TRITONLLM_UNROLL for (int g = 0; g < G; ++g)
    TRITONLLM_UNROLL for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * d + i + 16 * c);
  for (int64_t j = 0; j < run; j += 2) {
    const __m512i first_low = _mm512_loadu_si512(v + j * d + i), first_high = _mm512_loadu_si512(v + j * d + i + 32);
    const bool pair = j + 1 < run;  // an odd run's last value pairs with zeros
    const __m512i second_low = pair ? _mm512_loadu_si512(v + (j + 1) * d + i) : _mm512_setzero_si512();
    const __m512i second_high = pair ? _mm512_loadu_si512(v + (j + 1) * d + i + 32) : _mm512_setzero_si512();
    const __m512bh pairs[4] = {simd::as_bf16(_mm512_unpacklo_epi16(first_low, second_low)), simd::as_bf16(_mm512_unpackhi_epi16(first_low, second_low)),
                               simd::as_bf16(_mm512_unpacklo_epi16(first_high, second_high)), simd::as_bf16(_mm512_unpackhi_epi16(first_high, second_high))};
    TRITONLLM_UNROLL for (int g = 0; g < G; ++g) {
      uint32_t two;
      std::memcpy(&two, p + (g0 + g) * stride + j, sizeof(two));
      const __m512bh w = simd::as_bf16(_mm512_set1_epi32(static_cast<int>(two)));
      TRITONLLM_UNROLL for (int c = 0; c < 4; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], w, pairs[c]);
    }
  }
  TRITONLLM_UNROLL for (int g = 0; g < G; ++g)
    TRITONLLM_UNROLL for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g0 + g) * d + i + 16 * c, a[g][c]);
}

// values_of_run's lane order back to dims: in each 32 dims, lane 4q + t of the first 16 holds dim 8q + t,
// of the second 16 dim 8q + 4 + t.
inline void unpermute_sums(float* acc, int64_t n) {
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t o = 0; o < n; o += 32) {
    const __m512 first = _mm512_loadu_ps(acc + o), second = _mm512_loadu_ps(acc + o + 16);
    _mm512_storeu_ps(acc + o, _mm512_permutex2var_ps(first, low, second));
    _mm512_storeu_ps(acc + o + 16, _mm512_permutex2var_ps(first, high, second));
  }
}

}  // namespace decode_bf16
#endif
