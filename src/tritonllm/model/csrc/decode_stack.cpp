// All decoder layers of a decode-only step in one call: the kernels the Python layer loop calls, in the same
// order and on the same tensors (so the same results to the bit), without the ~300 Python calls a step makes
// through the layer loop (a few ms of a ~20 ms batch-1 step). Steps with prefill chunks keep the Python loop.
#include <ATen/core/Tensor.h>

#include <vector>

namespace {

// A linear as two tensors: packed int8, int7 or int4 weights (int8_pack / int7_pack / int4_pack: uint8 tiles told
// apart by their bytes a block, int7's int8), packed bf16 weights (bf16_pack: 3 dimensions) or row-major bf16 ones,
// then a bias or an empty tensor. Packed rows are a multiple of their tiles', so there is nothing to drop.
bool is_int7(const at::Tensor& weight) { return weight.scalar_type() == at::kChar; }
bool is_packed(const at::Tensor& weight) { return weight.scalar_type() == at::kByte || is_int7(weight); }
bool is_packed_bf16(const at::Tensor& weight) { return weight.scalar_type() == at::kBFloat16 && weight.dim() == 3; }

int64_t out_features(const at::Tensor& weight) {
  if (is_packed(weight)) return weight.size(0) * kTileRows;
  return is_packed_bf16(weight) ? weight.size(0) * kPairRows : weight.size(0);
}

void run_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& out) {
  c10::optional<at::Tensor> b;
  if (bias.numel() > 0) b = bias;
  if (is_int7(weight)) return int7_linear_into(x, weight, b, out);
  if (is_packed(weight) && weight.size(2) == kInt4BlockBytes) return int4_linear_into(x, weight, b, out);
  if (is_packed(weight)) return int8_linear_into(x, weight, b, out);
  if (is_packed_bf16(weight)) return bf16_packed_linear_into(x, weight, b, out);
  bf16_linear_into(x, weight, b, out);
}

}  // namespace

// x [T, H] residual stream (updated in place, as the Python loop does); each layer is [input_norm,
// post_attention_norm, then (weight, bias) for qkv, o, gate_up, down]. Returns the last layer's output.
// Every layer writes the same intermediate tensors, made once a call: allocating them per layer (~300 a step)
// cost more than a batch-1 step's norms and RoPE.
at::Tensor decode_layers(at::Tensor x, const std::vector<std::vector<at::Tensor>>& layers, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, double eps, int64_t heads, double scale) {
  TORCH_CHECK(!layers.empty() && layers.size() == k_caches.size() && layers.size() == v_caches.size(),
              "one KV cache per layer");
  for (const std::vector<at::Tensor>& l : layers) TORCH_CHECK(l.size() == 10, "a layer is 2 norms and 4 x (weight, bias)");
  const std::vector<at::Tensor>& first = layers[0];
  const int64_t tokens = x.size(0), kv_heads = k_caches[0].size(0), head_dim = kv_rows::head_dim(k_caches[0]);
  const auto options = x.options();
  at::Tensor normed = at::empty_like(x), qkv = at::empty({tokens, out_features(first[2])}, options);
  at::Tensor qk = at::empty({tokens, heads + kv_heads, head_dim}, options);
  at::Tensor attention = at::empty({tokens, heads, head_dim}, options);
  at::Tensor projected = at::empty({tokens, out_features(first[4])}, options);
  at::Tensor gate_up = at::empty({tokens, out_features(first[6])}, options);
  at::Tensor activated = at::empty({tokens, gate_up.size(1) / 2}, options);
  at::Tensor delta = at::empty({tokens, out_features(first[8])}, options);
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<at::Tensor>& l = layers[i];
    add_rms_norm_into(x, i > 0 ? c10::optional<at::Tensor>(delta) : c10::nullopt, l[0], eps, normed);
    run_linear(normed, l[2], l[3], qkv);
    rope_and_cache_into(qkv, cos, sin, slots, k_caches[i], v_caches[i], heads, qk);
    // One token's queries are the first heads of its row: contiguous as they are. More tokens: copied.
    paged_decode_attention_into(qk.narrow(1, 0, heads).contiguous(), k_caches[i], v_caches[i], block_tables,
                                context_lens, scale, attention);
    run_linear(attention.view({tokens, -1}), l[4], l[5], projected);
    add_rms_norm_into(x, projected, l[1], eps, normed);
    run_linear(normed, l[6], l[7], gate_up);
    silu_and_mul_into(gate_up, activated);
    run_linear(activated, l[8], l[9], delta);
  }
  return delta;
}
