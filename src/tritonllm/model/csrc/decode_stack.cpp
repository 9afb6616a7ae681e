// All decoder layers of a decode-only step in one call: the kernels the Python layer loop calls, in the same
// order and on the same tensors (so the same results to the bit), without the ~300 Python calls a step makes
// through the layer loop (a few ms of a ~20 ms batch-1 step). Steps with prefill chunks keep the Python loop.
#include <ATen/core/Tensor.h>

#include <vector>

namespace {

// A linear as two tensors: packed int8 weights (int8_pack; rows a multiple of its tiles', so nothing to drop) or bf16
// weights, then a bias or an empty tensor.
at::Tensor run_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  c10::optional<at::Tensor> b;
  if (bias.numel() > 0) b = bias;
  if (weight.scalar_type() == at::kByte) return int8_linear(x, weight, b);
  return bf16_linear(x, weight, b);
}

}  // namespace

// x [T, H] residual stream (updated in place, as the Python loop does); each layer is [input_norm,
// post_attention_norm, then (weight, bias) for qkv, o, gate_up, down]. Returns the last layer's output.
at::Tensor decode_layers(at::Tensor x, const std::vector<std::vector<at::Tensor>>& layers, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, double eps, int64_t heads, double scale) {
  TORCH_CHECK(!layers.empty() && layers.size() == k_caches.size() && layers.size() == v_caches.size(),
              "one KV cache per layer");
  const int64_t tokens = x.size(0);
  c10::optional<at::Tensor> delta;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<at::Tensor>& l = layers[i];
    TORCH_CHECK(l.size() == 10, "a layer is 2 norms and 4 x (weight, bias)");
    at::Tensor h = add_rms_norm(x, delta, l[0], eps);
    const at::Tensor qk = rope_and_cache(run_linear(h, l[2], l[3]), cos, sin, slots, k_caches[i], v_caches[i], heads);
    const at::Tensor attention = paged_decode_attention(qk.narrow(1, 0, heads).contiguous(), k_caches[i], v_caches[i],
                                                        block_tables, context_lens, scale);
    h = add_rms_norm(x, run_linear(attention.view({tokens, -1}), l[4], l[5]), l[1], eps);
    delta = run_linear(silu_and_mul(run_linear(h, l[6], l[7])), l[8], l[9]);
  }
  return *delta;
}
