// Linear layers over 7-bit weights (-63..63) in int8's blocks of 32 with fp16 scales and in its tiles (34 bytes a
// row and block), through the kernels of int8_linear.cpp (this file only adds the format).
//
// Why: without VNNI (the AVX2 kernels) maddubs multiplies unsigned by signed bytes, so int8's signed weights take
// a vpsignb per 32 products and a second broadcast of the activations (their absolute values), on the same pipes
// as the products. Weights of 7 bits stored + 64 (0..127) are the unsigned operand as they are, as int4's nibbles
// are (127 x 127 x 2 fits maddubs' int16 sums); 64 x the activations' block sum is taken back off. The VNNI and
// AMX builds multiply int8's layout without a sign op: there the 7-bit weights are packed and run as int8.
//
// The packed tiles come back as int8 (kChar) tensors: the bytes are int8's, and the dtype is what tells the two
// formats apart (decode_stack.cpp's linears).

namespace {

#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512_VNNI)
constexpr bool kInt7OwnFormat = true;
struct Int7Format {
  static constexpr int64_t kBlockBytes = kTileBlock;
  static constexpr int32_t kOffset = 64;
  static constexpr int kChunksPerSum = 1;  // 127 x 127 x 2 a pair fills int16: each chunk widens alone
  static void chunk_products(const uint8_t* block, int c, __m256i xc, __m256i, __m256i& rows0123, __m256i& rows4567) {
    const __m256i* w = reinterpret_cast<const __m256i*>(block + kScaleBytes);
    rows0123 = _mm256_maddubs_epi16(_mm256_loadu_si256(w + 2 * c), xc);
    rows4567 = _mm256_maddubs_epi16(_mm256_loadu_si256(w + 2 * c + 1), xc);
  }
};
#else
constexpr bool kInt7OwnFormat = false;
using Int7Format = Int8Format;
#endif

constexpr int kInt7Steps = 63;

}  // namespace

// w int8 [N, Kp] in -63..63 (Kp = K rounded up to 32), ws float32 [N, Kp/32] -> int8's tiles (int8_pack), each
// weight stored + Int7Format::kOffset, as an int8 tensor.
at::Tensor int7_pack(const at::Tensor& w, const at::Tensor& ws) {
  TORCH_CHECK(w.scalar_type() != at::kChar || w.numel() == 0 ||
                  (w.max().item<int8_t>() <= kInt7Steps && w.min().item<int8_t>() >= -kInt7Steps),
              "int7 weights must lie in -63..63 (quant.quantize_int7_blocks)");
  return pack_int8_weights<Int7Format>(w, ws).view(at::kChar);
}

void int7_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  check_packed(packed, at::kChar, "int7");
  block_linear_into<Int7Format>(x, packed, bias, out);
}

at::Tensor int7_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  check_packed(packed, at::kChar, "int7");
  at::Tensor out = linear_output(x, packed.size(0) * kTileRows);
  int7_linear_into(x, packed, bias, out);
  return out;
}

bool int7_runs_as_int8() { return !kInt7OwnFormat; }
