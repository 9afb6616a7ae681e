// The small per-layer operations of a decoder layer, each one pass over its data: at batch 1 the dozen
// PyTorch ops they replace (pow/mean/rsqrt/mul, slice/cat/neg for RoPE, index_copy into the cache, silu
// and mul) cost more than the layer's matmuls read from memory. Arithmetic follows HF transformers (fp32
// statistics, rotate-half RoPE with cos/sin computed by PyTorch), so fp32 stays within rounding of HF.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_rows.h"
#include "work_split.h"

namespace {

template <typename T>
void add_rms_norm_kernel(T* x, const T* delta, const T* weight, float eps, int64_t rows, int64_t hidden, T* out) {
  work_split::for_each(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = x + r * hidden;
      if (delta != nullptr)
        for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(delta[r * hidden + i]));
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i)
        out[r * hidden + i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(static_cast<T>(static_cast<float>(row[i]) * inv)));
    }
  });
}

// Rotates the query and key heads of a fused qkv row (rotate-half RoPE) into `qk`, and writes the rotated
// keys and the values into the paged cache at each token's slot (as rows of the cache's dtype C: T, bf16 under
// fp32 activations, or int8: kv_rows.h).
template <typename T, typename C>
void rope_cache_kernel(const T* qkv, const T* cos, const T* sin, const int64_t* slots, int64_t tokens,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, T* qk, C* k_cache, C* v_cache,
                       int64_t slots_per_head) {
  const int64_t half = head_dim / 2, row = (heads + 2 * kv_heads) * head_dim, cached = kv_rows::width<C>(head_dim);
  work_split::for_each(tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> key(head_dim), value(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = qkv + t * row + h * head_dim;
        T* out = qk + (t * (heads + kv_heads) + h) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
          const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
          const T b = static_cast<T>(rotated * static_cast<float>(s[i]));
          out[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
        if (h >= heads) {
          const int64_t kv = h - heads;
          const T* v = qkv + t * row + (heads + kv_heads + kv) * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) {
            key[i] = static_cast<float>(out[i]);
            value[i] = static_cast<float>(v[i]);
          }
          kv_rows::store(key.data(), head_dim, k_cache + (kv * slots_per_head + slots[t]) * cached);
          kv_rows::store(value.data(), head_dim, v_cache + (kv * slots_per_head + slots[t]) * cached);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_kernel(const T* gate_up, int64_t rows, int64_t width, T* out) {
  work_split::for_each(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = static_cast<T>(g / (1.f + std::exp(-g)));
        out[r * width + i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

// Each op below also comes as `<op>_into`, writing a given output (decode_stack.cpp reuses its buffers across layers).
namespace {
void check_op_output(const at::Tensor& out, at::IntArrayRef sizes, const at::Tensor& like) {
  TORCH_CHECK(out.is_contiguous() && out.sizes() == sizes && out.scalar_type() == like.scalar_type(),
              "the output must be contiguous, of the op's shape and its input's dtype");
}
}  // namespace

// x += delta (when given), then out = rms_norm(x) * weight. x [T, H] is updated in place.
void add_rms_norm_into(at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1), "x must be contiguous [T, H]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  if (delta) TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
  check_op_output(out, x.sizes(), x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), delta ? delta->data_ptr<scalar_t>() : nullptr, weight.data_ptr<scalar_t>(),
                                  static_cast<float>(eps), x.size(0), x.size(1), out.data_ptr<scalar_t>());
  });
}

at::Tensor add_rms_norm(at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  add_rms_norm_into(x, delta, weight, eps, out);
  return out;
}

// qkv [T, (H + 2 KV) * D]; cos/sin [T, D]; slots [T] int64; caches [KV, blocks, block_size, D].
// qk receives the rotated queries and keys [T, H + KV, D]; the caches receive keys and values.
void rope_and_cache_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t heads, at::Tensor& qk) {
  const kv_rows::Kind kind = kv_rows::check(k_cache, v_cache, qkv.scalar_type());
  const int64_t kv_heads = k_cache.size(0), head_dim = kv_rows::head_dim(k_cache), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv must be contiguous [T, (H + 2 KV) D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim && sin.numel() == cos.numel(), "cos/sin must be [T, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos/sin must have qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens, "slots must be int64 [T]");
  check_op_output(qk, {tokens, heads + kv_heads, head_dim}, qkv);
  const at::Tensor slot_ids = slots.contiguous();
  const int64_t slots_per_head = k_cache.size(1) * k_cache.size(2);
  if (kind == kv_rows::Kind::kInt8) {
    const auto int8_rows = [&](auto activations) {
      using T = decltype(activations);
      rope_cache_kernel<T, int8_t>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), slot_ids.data_ptr<int64_t>(), tokens,
                                   heads, kv_heads, head_dim, qk.data_ptr<T>(), k_cache.data_ptr<int8_t>(),
                                   v_cache.data_ptr<int8_t>(), slots_per_head);
    };
    if (qkv.scalar_type() == at::kFloat) int8_rows(float{});
    else int8_rows(at::BFloat16{});
    return;
  }
  if (kind == kv_rows::Kind::kBf16UnderFp32) {
    rope_cache_kernel<float, at::BFloat16>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), slot_ids.data_ptr<int64_t>(),
                                           tokens, heads, kv_heads, head_dim, qk.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                                           v_cache.data_ptr<at::BFloat16>(), slots_per_head);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, qkv.scalar_type(), "rope_and_cache", [&] {
    rope_cache_kernel<scalar_t, scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), slot_ids.data_ptr<int64_t>(),
                                          tokens, heads, kv_heads, head_dim, qk.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                          v_cache.data_ptr<scalar_t>(), slots_per_head);
  });
}

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                          at::Tensor& k_cache, at::Tensor& v_cache, int64_t heads) {
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [KV, blocks, block_size, row]");
  at::Tensor qk = at::empty({qkv.size(0), heads + k_cache.size(0), kv_rows::head_dim(k_cache)}, qkv.options());
  rope_and_cache_into(qkv, cos, sin, slots, k_cache, v_cache, heads, qk);
  return qk;
}

// gate_up [T, 2F] (gate then up) -> out = silu(gate) * up [T, F].
void silu_and_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up must be contiguous [T, 2F]");
  const int64_t width = gate_up.size(1) / 2;
  check_op_output(out, {gate_up.size(0), width}, gate_up);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), gate_up.size(0), width, out.data_ptr<scalar_t>());
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2, "gate_up must be contiguous [T, 2F]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul_into(gate_up, out);
  return out;
}
