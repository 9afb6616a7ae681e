// Causal attention of all of a step's prefill chunks in one call (variable lengths), straight from the paged KV
// cache: rope_and_cache has already written each chunk's own keys and values there, so a chunk after a cached
// prefix and a whole prompt are the same case. Query i of a chunk of L queries over C keys sits at position
// C - L + i and sees keys [0, C - L + i].
// Work is split into tasks of (sequence, kv head, tile of kQueryTile queries); a task runs its rows (each query
// times the query heads of the kv head's group) over tiles of up to kKeyTile keys, converted to fp32 once per
// tile, with an online softmax (flash attention's running max and sum). Tasks differ in cost (later tiles see
// more keys), so threads take them from a shared counter, longest first.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "errors.h"
#include "simd.h"

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

// Up to kKeyTile keys of the cache (T or bf16, [n, d]) as fp32: transposed [d, kKeyTile] (zero-padded) for the
// scores, row-major [n, d] for the values.
template <typename C>
void load_keys_transposed(const C* src, int64_t n, int64_t d, float* kt) {
  std::fill(kt, kt + d * kKeyTile, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = simd::to_float(src[j * d + i]);
}

template <typename C>
void load_values(const C* src, int64_t count, float* out) {
  int64_t i = 0;
#ifdef TRITONLLM_AVX2
  if constexpr (simd::kVectorLoad<C>)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, simd::load8(src + i));
#endif
  for (; i < count; ++i) out[i] = simd::to_float(src[i]);
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

// T: the queries' and output's dtype; C: the cache's (T, or bf16 under fp32 queries).
template <typename T, typename C>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& context_lens,
                    double scale, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(0), group = heads / kv_heads;
  const int64_t block_size = k_cache.size(2), per_head = k_cache.size(1) * block_size * d;
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
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    const int64_t rows_max = kQueryTile * group;
    std::vector<float> query(rows_max * d), acc(rows_max * d), kt(d * kKeyTile), values(kKeyTile * d);
    std::vector<float> row_max(rows_max), row_sum(rows_max), rescale(rows_max), scores(rows_max * kKeyTile);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const PrefillTask& task = tasks[i];
      const int64_t cached = task.keys - task.last;
      const int64_t rows = (task.last - task.first) * group;  // row r: query first + r / group, head r % group
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + ((starts[task.seq] + task.first + r / group) * heads + task.head * group + r % group) * d;
        for (int64_t j = 0; j < d; ++j) query[r * d + j] = simd::to_float(src[j]) * static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
      const int64_t* table = tables + task.seq * width;
      for (int64_t t = 0; t < task.keys;) {
        const int64_t in_block = t % block_size;
        const int64_t run = std::min({kKeyTile, block_size - in_block, task.keys - t});
        const int64_t offset = task.head * per_head + (table[t / block_size] * block_size + in_block) * d;
        load_keys_transposed(kp + offset, run, d, kt.data());
        load_values(vp + offset, run * d, values.data());
        // Rows before the diagonal see the whole run; only the tile's first rows may see none of it.
        const int64_t first_row = std::max<int64_t>(0, (t - cached - task.first) * group);
        int64_t r = first_row;
        for (; r + kScoreRows <= rows; r += kScoreRows) score_rows<kScoreRows>(&query[r * d], kt.data(), d, &scores[r * kKeyTile]);
        for (; r < rows; ++r) score_rows<1>(&query[r * d], kt.data(), d, &scores[r * kKeyTile]);
        for (r = first_row; r < rows; ++r) {
          float* row = &scores[r * kKeyTile];
          const int64_t seen = std::min(run, cached + task.first + r / group + 1 - t);  // >= 1 from first_row on
          float peak = row_max[r];
          for (int64_t j = 0; j < seen; ++j) peak = std::max(peak, row[j]);
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < kKeyTile; ++j) total += (row[j] = j < seen ? std::exp(row[j] - peak) : 0.f);
          rescale[r] = std::exp(row_max[r] - peak);  // 0 for the row's first run (its max was -inf)
          row_sum[r] = row_sum[r] * rescale[r] + total;
          row_max[r] = peak;
        }
        for (r = first_row; r + kValueRows <= rows; r += kValueRows)
          accumulate_rows<kValueRows>(&scores[r * kKeyTile], values.data(), run, d, &rescale[r], &acc[r * d]);
        for (; r < rows; ++r) accumulate_rows<1>(&scores[r * kKeyTile], values.data(), run, d, &rescale[r], &acc[r * d]);
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
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous [kv_heads, blocks, block_size, head_dim] of one dtype");
  const bool bf16_cache = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() || bf16_cache,
              "the caches must have q's dtype, or bfloat16 under float32 q");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "q's heads do not fit the cache");
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
  if (bf16_cache) {
    prefill_kernel<float, at::BFloat16>(q, k_cache, v_cache, tables, starts, lens, scale, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    prefill_kernel<scalar_t, scalar_t>(q, k_cache, v_cache, tables, starts, lens, scale, out);
  });
  return out;
}
