// Greedy sampling: each row's argmax, as torch.argmax(dim=-1) picks it (the first maximum, or the first NaN
// when a row has one), vectorized. torch's CPU argmax reads one value at a time: ~80 us for one 49152-wide
// row here, over 1% of a batch-1 decode step; this reads 16 at a time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "work_split.h"

namespace {

// Bit tests rather than std::isnan, which -ffast-math (this build's flag) may fold to false.
constexpr uint32_t kAbsMask = 0x7fffffffu, kInfinityBits = 0x7f800000u;

bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & kAbsMask) > kInfinityBits;
}

// The row's largest value (in `best`), or false when the row has a NaN.
bool row_max(const float* p, int64_t n, float& best) {
  int64_t i = 0;
  best = -INFINITY;
  bool nan = false;
#if defined(TRITONLLM_AVX512)
  __m512 wide = _mm512_set1_ps(-INFINITY);
  __mmask16 nans = 0;
  const __m512i abs_mask = _mm512_set1_epi32(kAbsMask), inf = _mm512_set1_epi32(kInfinityBits);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf);
    wide = _mm512_max_ps(wide, v);
  }
  best = _mm512_reduce_max_ps(wide);
  nan = nans != 0;
#elif defined(TRITONLLM_AVX2)
  __m256 wide = _mm256_set1_ps(-INFINITY);
  __m256i nans = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi32(kAbsMask), inf = _mm256_set1_epi32(kInfinityBits);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    nans = _mm256_or_si256(nans, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), inf));
    wide = _mm256_max_ps(wide, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, wide);
  for (float lane : lanes) best = lane > best ? lane : best;
  nan = !_mm256_testz_si256(nans, nans);
#endif
  for (; i < n; ++i) {
    nan |= is_nan(p[i]);
    best = p[i] > best ? p[i] : best;
  }
  return !nan;
}

int64_t row_argmax(const float* p, int64_t n) {
  float best;
  if (!row_max(p, n, best)) {
    for (int64_t i = 0; i < n; ++i)
      if (is_nan(p[i])) return i;
  }
  int64_t i = 0;
#if defined(TRITONLLM_AVX512)
  const __m512 target = _mm512_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(TRITONLLM_AVX2)
  const __m256 target = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (p[i] == best) return i;
  return 0;  // unreachable: `best` is one of the row's values
}

}  // namespace

// logits [S, V] float32 -> int64 [S]: the index of each row's first maximum (torch.argmax(logits, -1)).
at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits must be float32 [rows, vocab]");
  const at::Tensor rows = logits.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor out = at::empty({n}, rows.options().dtype(at::kLong));
  const float* p = rows.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  work_split::for_each(n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(p + r * vocab, vocab);
  });
  return out;
}
