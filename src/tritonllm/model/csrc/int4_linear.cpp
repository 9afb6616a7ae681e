// Linear layers over 4-bit weights in blocks of 32 inputs with one fp16 scale each (llama.cpp's q4_0: weight =
// scale x (q - 8), q in 0..15), times activations quantized to int8 per token and block, through the kernels of
// int8_linear.cpp (this file only adds the format). A block takes 18 bytes a row where int8 takes 34: batch-1
// decode, which reads every weight once a token, streams about half as much.
//
// Input (an engine directory's storage, q4_0's order): uint8 [N, Kp/2], per block 16 bytes, byte j holding weight j
// in its low nibble and weight 16 + j in its high one. Tiles as int8's, each block's 16 weight bytes a row laid out
// so that a mask or a shift gives int8's chunks:
// - VNNI builds (16 rows): the scales, then 4 chunks of 64 bytes; chunk c holds rows 0-15 x 4 bytes, byte i of row r
//   holding inputs 4c + i (low nibble) and 16 + 4c + i (high): int8's chunks c and c + 4.
// - Others (8 rows): the scales (slot order), then 2 chunks of 64 bytes, rows 0-3 then 4-7, 8 bytes a row, byte i
//   holding inputs 8c + i (low) and 16 + 8c + i (high): int8's chunks c and c + 2.
// The nibbles are the unsigned operand of vpdpbusd / maddubs as they are; 8 x the activations' block sum is
// taken back off.

namespace {

constexpr int64_t kInt4BlockBytes = kTileRows * (kBlock / 2 + 2);
constexpr int64_t kInt4ChunkInputs = kTileRows == 16 ? 4 : 8;  // inputs a row per chunk (as int8's)

// Where the byte of weights i and 16 + i (i < 16) of row r in block b sits in a tile.
inline int64_t int4_byte_offset(int64_t b, int64_t r, int64_t i) {
  const int64_t chunk = i / kInt4ChunkInputs, at = i % kInt4ChunkInputs;
  const int64_t in_chunk = kTileRows == 16 ? r * 4 + at : (r / 4) * 32 + (r % 4) * 8 + at;
  return b * kInt4BlockBytes + kScaleBytes + chunk * 64 + in_chunk;
}

struct Int4Format {
  static constexpr int64_t kBlockBytes = kInt4BlockBytes;
  static constexpr int32_t kOffset = 8;
  // (AVX2) A pair of products is at most 15 x 127 x 2 = 3,810: a block's 4 chunks add up in int16 and widen once
  // (vpmaddwd), where int8's widen every chunk: SmolLM2's linears 1.13-1.15x faster at 8-512 tokens (Zen 3).
  static constexpr int kChunksPerSum = 4;
  static int32_t weight(const uint8_t* tile, int64_t b, int64_t r, int64_t i) {
    const uint8_t both = tile[int4_byte_offset(b, r, i % 16)];
    return (i < 16 ? both & 0x0F : both >> 4) - kOffset;
  }
#ifdef TRITONLLM_AVX512_VNNI
  static void load_chunks(const uint8_t* block, __m512i* w) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i both = _mm512_loadu_si512(block + kScaleBytes + 64 * c);
      w[c] = _mm512_and_si512(both, low);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
    }
  }
#elif defined(TRITONLLM_AVX2)
  static void chunk_products(const uint8_t* block, int c, __m256i xc, __m256i, __m256i& rows0123, __m256i& rows4567) {
    const __m256i* both = reinterpret_cast<const __m256i*>(block + kScaleBytes + 64 * (c % 2));
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i w0 = _mm256_loadu_si256(both), w1 = _mm256_loadu_si256(both + 1);
    if (c >= 2) {
      w0 = _mm256_srli_epi16(w0, 4);
      w1 = _mm256_srli_epi16(w1, 4);
    }
    rows0123 = _mm256_maddubs_epi16(_mm256_and_si256(w0, low), xc);  // 15 x 127 x 2 fits int16
    rows4567 = _mm256_maddubs_epi16(_mm256_and_si256(w1, low), xc);
  }
#endif
};

}  // namespace

// w uint8 [N, Kp/2] (q4_0's nibbles, Kp = K rounded up to 32), ws float32 [N, Kp/32] -> uint8 [ceil(N/R), Kp/32,
// R * 18] for tiles of R rows (8, or 16 in the VNNI builds); rows past N are zeros (weight 8, scale 0).
at::Tensor int4_pack(const at::Tensor& w, const at::Tensor& ws) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % (kBlock / 2) == 0,
              "weight must be contiguous uint8 [N, K padded to 32 / 2] (two 4-bit weights a byte)");
  const int64_t n = w.size(0), nb = w.size(1) / (kBlock / 2);
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.dim() == 2 && ws.size(0) == n && ws.size(1) == nb,
              "scales must be float32 [N, K/32]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  constexpr int64_t kBytes = kBlock / 2;  // a row's bytes a block
  at::Tensor packed = packed_tiles<Int4Format>(n, nb, ws, [&](uint8_t* tile, int64_t b, int64_t r, int64_t row) {
    for (int64_t i = 0; i < kBytes; ++i) tile[int4_byte_offset(b, r, i)] = row < n ? wp[(row * nb + b) * kBytes + i] : 0x88;
  });
  return packed;
}

void int4_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kInt4BlockBytes,
              errors::message("packed int4 weights must be contiguous uint8 [tiles, blocks, ", kInt4BlockBytes, "] (from int4_pack)"));
  block_linear_into<Int4Format>(x, packed, bias, out);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  at::Tensor out = linear_output(x, packed.size(0) * kTileRows);
  int4_linear_into(x, packed, bias, out);
  return out;
}
