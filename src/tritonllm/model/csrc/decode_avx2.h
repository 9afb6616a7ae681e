// Decode attention over a bf16 cache on AVX2 CPUs without AVX-512 (paged_attention.cpp's span_scores and
// span_values take these paths). One 32-byte load of 16 bf16 values gives two fp32 vectors in two operations:
// the even elements (each 32-bit lane shifted up 16 bits) and the odd ones (its low half masked off), where
// widening 8 values at a time took two operations for 8. Each key and value is loaded once for all the query
// heads of its group (up to 3 at a time: the sums stay in AVX2's 16 registers), where the generic AVX2 loops
// loaded it once per head. The queries are put in the same even/odd order once a span; the values' sums come
// out in it and are put back once a span. The values' sums add the same products in the same order as the
// generic loop's (the same bits); a score adds its products in another order (last-bit differences).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512)
namespace decode_avx2 {

inline bool supports(int64_t head_dim) { return head_dim % 32 == 0; }

// 16 bf16 values at p as fp32: elements 0, 2, ..., 14 in `even`, 1, 3, ..., 15 in `odd`.
inline void load_even_odd(const at::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// q [n] (n a multiple of 16) in even/odd order: each 16 as its 8 even elements, then its 8 odd ones.
inline void even_odd(const float* q, int64_t n, std::vector<float>& out) {
  out.resize(n);
  for (int64_t o = 0; o < n; o += 16)
    for (int64_t l = 0; l < 8; ++l) {
      out[o + l] = q[o + 2 * l];
      out[o + 8 + l] = q[o + 2 * l + 1];
    }
}

// The inverse of even_odd, in place, on fp32 sums.
inline void unpermute_sums(float* acc, int64_t n) {
  for (int64_t o = 0; o < n; o += 16) {
    const __m256 even = _mm256_loadu_ps(acc + o), odd = _mm256_loadu_ps(acc + o + 8);
    const __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);  // pairs 0 1 4 5 | 2 3 6 7
    _mm256_storeu_ps(acc + o, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(acc + o + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
}

// Lane j of the result = the sum of a[j]'s 8 lanes.
inline __m128 hsum4(const __m256* a) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// scores[g][0, U) = q_g . k_u for U keys (4, or 1 for a run's last few) from `k` (d apart) and query heads
// [g0, g0 + G); q in even/odd order. 4 x G sums and a key's two halves: 14 of the 16 registers at G = 3 (the
// queries are read from memory).
template <int G, int U>
inline void scores_of_keys(const float* q, const at::BFloat16* k, int64_t d, int64_t g0, int64_t len, float* scores) {
  static_assert(U == 4 || U == 1, "4 keys at a time, or 1");
  __m256 acc[G][U];
  TRITONLLM_UNROLL for (int g = 0; g < G; ++g)
    TRITONLLM_UNROLL for (int u = 0; u < U; ++u) acc[g][u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    TRITONLLM_UNROLL for (int u = 0; u < U; ++u) {
      __m256 even, odd;
      load_even_odd(k + u * d + i, even, odd);
      TRITONLLM_UNROLL for (int g = 0; g < G; ++g) {
        const float* qg = q + (g0 + g) * d + i;
        acc[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), even, acc[g][u]);
        acc[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8), odd, acc[g][u]);
      }
    }
  }
  TRITONLLM_UNROLL for (int g = 0; g < G; ++g) {
    if constexpr (U == 4) _mm_storeu_ps(scores + (g0 + g) * len, hsum4(acc[g]));
    else scores[(g0 + g) * len] = simd::hsum(acc[g][0]);
  }
}

// acc[g][i, i + 16) += sum_j p_g[j] v_j[i, i + 16) over `run` values (d apart), in even/odd order, for query
// heads [g0, g0 + G). 2 x G sums, a value's two halves, a probability and the mask: 10 registers at G = 3. With
// 32 dims a pass (4 x G sums) the compiler kept one sum on the stack, a store and a load on every value's chain:
// decode attention over cached rows took 1.3x as long.
template <int G>
inline void values_of_run(const float* p, int64_t len, const at::BFloat16* v, int64_t run, int64_t d, int64_t i,
                          int64_t g0, float* acc) {
  __m256 a[G][2];
  TRITONLLM_UNROLL for (int g = 0; g < G; ++g)
    TRITONLLM_UNROLL for (int c = 0; c < 2; ++c) a[g][c] = _mm256_loadu_ps(acc + (g0 + g) * d + i + 8 * c);
  for (int64_t j = 0; j < run; ++j) {
    __m256 even, odd;
    load_even_odd(v + j * d + i, even, odd);
    TRITONLLM_UNROLL for (int g = 0; g < G; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + (g0 + g) * len + j);
      a[g][0] = _mm256_fmadd_ps(w, even, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(w, odd, a[g][1]);
    }
  }
  TRITONLLM_UNROLL for (int g = 0; g < G; ++g)
    TRITONLLM_UNROLL for (int c = 0; c < 2; ++c) _mm256_storeu_ps(acc + (g0 + g) * d + i + 8 * c, a[g][c]);
}

}  // namespace decode_avx2
#endif
