// Rows of the paged KV cache: one key or value of one kv head. A float cache (fp32, bf16, fp16) holds head_dim
// values a row. An int8 cache holds head_dim int8 values, then their fp32 scale (value = int8 x scale, the
// row's largest magnitude at +-127): half of bf16's bytes for decode attention to read, and the row's own scale
// keeps a token's keys as exact as its values (perplexity: benchmarks/README.md). The cache tensor's last
// dimension is the row's width in its elements: head_dim, or head_dim + 4 for int8.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kv_rows {

template <typename C>
inline constexpr bool kQuantized = std::is_same_v<C, int8_t>;

// A row's width in cache elements.
template <typename C>
inline constexpr int64_t width(int64_t head_dim) {
  return kQuantized<C> ? head_dim + static_cast<int64_t>(sizeof(float)) : head_dim;
}

// The head size a cache tensor [kv_heads, blocks, block_size, width] holds.
inline int64_t head_dim(const at::Tensor& cache) {
  return cache.size(3) - (cache.scalar_type() == at::kChar ? static_cast<int64_t>(sizeof(float)) : 0);
}

// What a row's elements are multiplied by: its scale (int8), else 1.
template <typename C>
inline float scale(const C* row, int64_t head_dim) {
  if constexpr (kQuantized<C>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(s));
    return s;
  } else {
    return 1.f;
  }
}

// What the caches hold against the activations' dtype; checked once for the ops that read or write them.
enum class Kind { kActivations, kBf16UnderFp32, kInt8 };

inline Kind check(const at::Tensor& k_cache, const at::Tensor& v_cache, at::ScalarType activations) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [kv_heads, blocks, block_size, row]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the caches must have one dtype");
  const at::ScalarType cache = k_cache.scalar_type();
  if (cache == at::kChar) {
    TORCH_CHECK(activations == at::kFloat || activations == at::kBFloat16, "an int8 cache needs float32 or bfloat16 activations");
    TORCH_CHECK(k_cache.size(3) > static_cast<int64_t>(sizeof(float)), "an int8 cache's rows are head_dim values and a float scale");
    return Kind::kInt8;
  }
  if (cache == at::kBFloat16 && activations == at::kFloat) return Kind::kBf16UnderFp32;
  TORCH_CHECK(cache == activations, "the caches must have the activations' dtype, bfloat16 under float32, or int8");
  return Kind::kActivations;
}

// Writes head_dim fp32 values as a row: cast, or rounded to int8 steps of the row's scale.
template <typename C>
inline void store(const float* x, int64_t head_dim, C* row) {
  if constexpr (kQuantized<C>) {
    float peak = 0.f;
    for (int64_t i = 0; i < head_dim; ++i) peak = std::max(peak, std::fabs(x[i]));
    const float s = peak / 127.f, inverse = peak > 0.f ? 127.f / peak : 0.f;
    for (int64_t i = 0; i < head_dim; ++i) row[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
    std::memcpy(row + head_dim, &s, sizeof(s));
  } else {
    for (int64_t i = 0; i < head_dim; ++i) row[i] = static_cast<C>(x[i]);
  }
}

}  // namespace kv_rows
