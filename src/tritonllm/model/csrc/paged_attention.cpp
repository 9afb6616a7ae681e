// Decode attention straight from the paged KV cache: one pass over each sequence's keys and values,
// no gather copy, no padding. One task per (sequence, kv head); the query heads of a group share it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                   at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), scores, acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads, len = lens[s];
      const int64_t* table = tables + s * width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          query[g * head_dim + i] = static_cast<float>(qp[(s * num_heads + h * group + g) * head_dim + i]);
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* key = kp + ((h * num_blocks + table[t / block_size]) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(&query[g * head_dim], key, head_dim) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * len];
        float peak = row[0], total = 0.f;  // len >= 1: a decode attends at least to itself
        for (int64_t t = 1; t < len; ++t) peak = std::max(peak, row[t]);
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* value = vp + ((h * num_blocks + table[t / block_size]) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = &acc[g * head_dim];
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * static_cast<float>(value[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          op[(s * num_heads + h * group + g) * head_dim + i] = static_cast<T>(acc[g * head_dim + i]);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [seqs, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv heads");
  auto out = at::empty_like(q);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}
