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
struct Int7Format {
  static constexpr int64_t kBlockBytes = kTileBlock;
  static constexpr int32_t kOffset = 64;
  static constexpr int kChunksPerSum = 1;  // 127 x 127 x 2 a pair fills int16: each chunk widens alone
  static int32_t weight(const uint8_t* tile, int64_t b, int64_t r, int64_t i) {
    return tile[weight_offset(b, r, i)] - kOffset;
  }
  static void chunk_products(const uint8_t* block, int c, __m256i xc, __m256i, __m256i& rows0123, __m256i& rows4567) {
    const __m256i* w = reinterpret_cast<const __m256i*>(block + kScaleBytes);
    rows0123 = _mm256_maddubs_epi16(_mm256_loadu_si256(w + 2 * c), xc);
    rows4567 = _mm256_maddubs_epi16(_mm256_loadu_si256(w + 2 * c + 1), xc);
  }
};
#else
using Int7Format = Int8Format;
#endif

constexpr int kInt7Steps = 63;

void check_int7_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kTileBlock,
              errors::message("packed int7 weights must be contiguous int8 [tiles, blocks, ", kTileBlock, "] (from int7_pack)"));
}

}  // namespace

// w int8 [N, Kp] in -63..63 (Kp = K rounded up to 32), ws float32 [N, Kp/32] -> int8's tiles (int8_pack), each
// weight stored + Int7Format::kOffset, as an int8 tensor.
at::Tensor int7_pack(const at::Tensor& w, const at::Tensor& ws) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) % kBlock == 0, "weight must be contiguous int8 [N, K padded to 32]");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.size(0) == w.size(0) && ws.size(1) == w.size(1) / kBlock, "scales must be float32 [N, K/32]");
  TORCH_CHECK(w.numel() == 0 || (w.max().item<int8_t>() <= kInt7Steps && w.min().item<int8_t>() >= -kInt7Steps),
              "int7 weights must lie in -63..63 (quant.quantize_int7_blocks)");
  const int64_t n = w.size(0), kp = w.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  at::Tensor packed = packed_tiles<Int7Format>(n, kp / kBlock, ws, [&](uint8_t* tile, int64_t b, int64_t r, int64_t row) {
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t weight = row < n ? wp[row * kp + b * kBlock + i] : 0;
      tile[weight_offset(b, r, i)] = static_cast<uint8_t>(weight + Int7Format::kOffset);
    }
  });
  return packed.view(at::kChar);
}

void int7_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  check_int7_packed(packed);
  block_linear_into<Int7Format>(x, packed, bias, out);
}

at::Tensor int7_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  check_int7_packed(packed);
  at::Tensor out = linear_output(x, packed.size(0) * kTileRows);
  int7_linear_into(x, packed, bias, out);
  return out;
}
