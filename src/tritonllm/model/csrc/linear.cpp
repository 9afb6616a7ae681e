// Linear layers over bf16 weights (fp32 or bf16 activations, fp32 accumulation; int8 weights: int8_linear.cpp).
// Batch-1 decode is memory-bound, so reading half of fp32's bytes is the speed-up: a few tokens multiply the
// bf16 rows straight from memory. More tokens are compute-bound: tiles of rows are expanded to fp32 in cache
// and every token goes over them with FMAs. With AVX512_BF16 (the avx512_bf16 build) bf16 activations take
// vdpbf16ps tiles straight from the bf16 rows at every size instead.
// The AVX2 paths are used when the translation unit is compiled with AVX2+FMA (cpu_kernels.py builds one
// variant per instruction set and picks it from the CPU's flags); otherwise portable loops run.
// On CPUs with AMX, bf16 activations from a number of tokens on go to ATen's GEMM instead (oneDNN), the number
// cpu_kernels.py sets at load (set_onednn_bf16_min_tokens). With AVX512_BF16 and no such GEMM, bf16 weights are
// packed for bf16_packed_linear.cpp instead, and these row-major paths do not run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "errors.h"
#include "simd.h"
#include "work_split.h"

namespace {

using simd::bf16_to_float;
using simd::to_float;
#ifdef TRITONLLM_AVX2
using simd::hsum;
using simd::load8;
using simd::load_bf16x8;
#endif

// RN bf16 weight rows x RM tokens, fp32 accumulation. The rows are contiguous, and so are the next tile's:
// while it reads this tile, the loop prefetches the next one, a cache line per step.
template <int RN, int RM, typename T>
void bf16_tile(const uint16_t* w, const T* x, int64_t k, float* acc_out) {
  int64_t i = 0;
  float tail[RN][RM] = {};
#ifdef TRITONLLM_AVX2
  __m256 acc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc[n][m] = _mm256_setzero_ps();
  const char* next_tile = reinterpret_cast<const char*>(w + RN * k);
  for (; i + 8 <= k; i += 8) {
    _mm_prefetch(next_tile + i * RN * 2, _MM_HINT_T0);  // RN rows x 8 bf16 = RN * 16 bytes per step
    __m256 wv[RN];
    for (int n = 0; n < RN; ++n) wv[n] = load_bf16x8(w + n * k + i);
    for (int m = 0; m < RM; ++m) {
      const __m256 xv = load8(x + m * k + i);
      for (int n = 0; n < RN; ++n) acc[n][m] = _mm256_fmadd_ps(wv[n], xv, acc[n][m]);
    }
  }
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) tail[n][m] = hsum(acc[n][m]);
#endif
  for (; i < k; ++i)
    for (int n = 0; n < RN; ++n)
      for (int m = 0; m < RM; ++m) tail[n][m] += bf16_to_float(w[n * k + i]) * to_float(x[m * k + i]);
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc_out[m * RN + n] = tail[n][m];
}

#ifdef TRITONLLM_AVX512_BF16
// RN bf16 weight rows x RM bf16 tokens with vdpbf16ps: 32 pairs of a row and a token per instruction, summed in
// fp32, where the AVX2 tile widens 8 weights to fp32 and takes an FMA for them. Prefetches the next tile as above.
// Over SmolLM2's layers (2 threads): 4 tokens 1.14x, 8 tokens 1.7x the AVX2 tile.
template <int RN, int RM>
void bf16_dot_tile(const uint16_t* w, const uint16_t* x, int64_t k, float* acc_out) {
  __m512 acc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc[n][m] = _mm512_setzero_ps();
  const char* next_tile = reinterpret_cast<const char*>(w + RN * k);
  for (int64_t i = 0; i < k; i += 32) {
    const __mmask32 live = k - i >= 32 ? ~__mmask32{0} : (__mmask32{1} << (k - i)) - 1;  // the row's tail
    for (int n = 0; n < RN; ++n) _mm_prefetch(next_tile + (i * RN + 32 * n) * 2, _MM_HINT_T0);  // RN lines per step
    __m512bh wv[RN];
    for (int n = 0; n < RN; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(live, w + n * k + i);
    for (int m = 0; m < RM; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * k + i);
      for (int n = 0; n < RN; ++n) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], wv[n], xv);
    }
  }
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc_out[m * RN + n] = _mm512_reduce_add_ps(acc[n][m]);
}

// The same products for kDotBlockTokens tokens or more, 4 rows x up to 4 tokens a tile: AVX-512's 32
// registers hold the 16 accumulators, so each row loaded serves 4 tokens. The loops are unrolled early
// (TRITONLLM_UNROLL) and the tail step is apart, so the accumulators stay in registers: bf16_dot_tile's
// are also stored to the stack on every step. Over SmolLM2's layers (2 threads, paired against
// bf16_dot_tile): 8 tokens 0.68-0.75 of the time, 16 tokens 0.52-0.55, 32 tokens 0.49. At 2-4 tokens, where
// the weights' stream is the limit, bf16_dot_tile was faster (these took 1.1-1.3x its time; not understood,
// the prefetch is the same), so few tokens keep it.
constexpr int kBlockRows = 4, kBlockTokens = 4;
constexpr int64_t kDotBlockTokens = 6;

template <int RN, int RM>
inline void bf16_block_step(const uint16_t* w, const uint16_t* x, int64_t k, int64_t i, __mmask32 live,
                            const char* next_tile, __m512 (&acc)[RN][RM]) {
  TRITONLLM_UNROLL for (int n = 0; n < RN; ++n) _mm_prefetch(next_tile + (i * RN + 32 * n) * 2, _MM_HINT_T0);
  __m512bh wv[RN];
  TRITONLLM_UNROLL for (int n = 0; n < RN; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(live, w + n * k + i);
  TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) {
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * k + i);
    TRITONLLM_UNROLL for (int n = 0; n < RN; ++n) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], wv[n], xv);
  }
}

template <int RN, int RM>
void bf16_block_tile(const uint16_t* w, const uint16_t* x, int64_t k, float* acc_out) {
  __m512 acc[RN][RM];
  TRITONLLM_UNROLL for (int n = 0; n < RN; ++n)
    TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) acc[n][m] = _mm512_setzero_ps();
  const char* next_tile = reinterpret_cast<const char*>(w + RN * k);
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) bf16_block_step<RN, RM>(w, x, k, i, ~__mmask32{0}, next_tile, acc);
  if (i < k) bf16_block_step<RN, RM>(w, x, k, i, (__mmask32{1} << (k - i)) - 1, next_tile, acc);
  TRITONLLM_UNROLL for (int n = 0; n < RN; ++n)
    TRITONLLM_UNROLL for (int m = 0; m < RM; ++m) acc_out[m * RN + n] = _mm512_reduce_add_ps(acc[n][m]);
}
#endif

// Runs `tile` over all (row tile, token tile) pairs: threads split the rows, each keeps its weight rows in cache
// while it walks the tokens. Tokens go RM at a time; a remainder of 1-3 tokens gets its own tile shape.
template <int RN, int RM, typename Out, typename TileFn>
void run_tiles(int64_t n_rows, int64_t m_tokens, const float* bias, Out* out, TileFn tile) {
  const int64_t row_tiles = (n_rows + RN - 1) / RN;
  // Pieces of ~16 rows (work_split.h: each thread streams its own rows, then helps a delayed one).
  work_split::for_each(row_tiles, std::max(1, 16 / RN), [&](int64_t begin, int64_t end) {
    float acc[RN * RM];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * RN, rows = std::min<int64_t>(RN, n_rows - n0);
      for (int64_t m0 = 0; m0 < m_tokens; m0 += RM) {
        const int64_t tokens = std::min<int64_t>(RM, m_tokens - m0);
        tile(n0, rows, m0, tokens, acc);
        for (int64_t m = 0; m < tokens; ++m)
          for (int64_t n = 0; n < rows; ++n)
            out[(m0 + m) * n_rows + n0 + n] = static_cast<Out>(acc[m * RN + n] + (bias ? bias[n0 + n] : 0.f));
      }
    }
  });
}

constexpr int kRows = 4, kTokens = 2;  // 8 accumulators + 4 weight or token vectors fit AVX2's 16 registers

// Calls fn.template operator()<RN, RM>() for the shape of a tile that may be cut short at the edges.
template <typename Fn>
inline void dispatch_tile(int64_t rows, int64_t tokens, Fn&& fn) {
  if (rows == kRows && tokens == kTokens) return fn(std::integral_constant<int, kRows>{}, std::integral_constant<int, kTokens>{});
  if (rows == kRows && tokens == 1) return fn(std::integral_constant<int, kRows>{}, std::integral_constant<int, 1>{});
  // Edge tiles (fewer rows than kRows): one row at a time.
  if (tokens == kTokens) return fn(std::integral_constant<int, 1>{}, std::integral_constant<int, kTokens>{});
  return fn(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
}

// The few-token driver of the bf16 kernel: `tile(rn, rm, row, token, acc)` computes rn weight rows
// from `row` x rm tokens from `token` (rn, rm compile-time); edge rows go one at a time.
template <typename T, typename TileFn>
void run_small(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias, at::Tensor& out, TileFn tile) {
  const int64_t k = x.size(-1), m = x.numel() / k;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  run_tiles<kRows, kTokens>(n, m, bp, out.data_ptr<T>(), [&](int64_t n0, int64_t rows, int64_t m0, int64_t tokens, float* acc) {
    if (rows == kRows) {
      dispatch_tile(rows, tokens, [&](auto rn, auto rm) { tile(rn, rm, n0, m0, acc); });
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {  // scattered into the kRows-strided layout
      float one[kTokens];
      dispatch_tile(1, tokens, [&](auto rn, auto rm) { tile(rn, rm, n0 + r, m0, one); });
      for (int64_t t = 0; t < tokens; ++t) acc[t * kRows + r] = one[t];
    }
  });
}

template <typename T>
void bf16_linear_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t k = x.size(-1);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const T* xp = x.data_ptr<T>();
  run_small<T>(x, w.size(0), bias, out, [&](auto rn, auto rm, int64_t row, int64_t token, float* acc) {
    bf16_tile<decltype(rn)::value, decltype(rm)::value, T>(wp + row * k, xp + token * k, k, acc);
  });
}

#ifdef TRITONLLM_AVX512_BF16
// Calls fn(rn, rm) with compile-time rn (kBlockRows, or 1 for edge rows) and rm (1..kBlockTokens). The caller
// branches on the rows too; a dispatch on tokens alone (rn fixed by the caller) gave the same outputs but bf16
// decode steps at 16 tokens took 1.03x the time (paired, 8 rounds, Zen 4), so this stays.
template <typename Fn>
inline void dispatch_block_tile(int64_t rows, int64_t tokens, Fn&& fn) {
  static_assert(kBlockTokens == 4, "the switch covers 1..4 tokens");
  auto with_tokens = [&](auto rn) {
    switch (tokens) {
      case 4: return fn(rn, std::integral_constant<int, 4>{});
      case 3: return fn(rn, std::integral_constant<int, 3>{});
      case 2: return fn(rn, std::integral_constant<int, 2>{});
      default: return fn(rn, std::integral_constant<int, 1>{});
    }
  };
  if (rows == kBlockRows) return with_tokens(std::integral_constant<int, kBlockRows>{});
  with_tokens(std::integral_constant<int, 1>{});
}

// Its own driver, not run_small with template shapes: merged that way the 4 x 4 path ran 4-6% slower at 8-32
// tokens (paired), and the old tiles' outputs changed in the last bits until pinned out of line.
void bf16_block_linear(const uint16_t* wp, const uint16_t* xp, int64_t n, int64_t m, int64_t k, const float* bp,
                       at::BFloat16* out) {
  run_tiles<kBlockRows, kBlockTokens>(n, m, bp, out, [&](int64_t n0, int64_t rows, int64_t m0, int64_t tokens, float* acc) {
    if (rows == kBlockRows) {
      dispatch_block_tile(rows, tokens, [&](auto rn, auto rm) {
        bf16_block_tile<decltype(rn)::value, decltype(rm)::value>(wp + n0 * k, xp + m0 * k, k, acc);
      });
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {  // scattered into the kBlockRows-strided layout
      float one[kBlockTokens];
      dispatch_block_tile(1, tokens, [&](auto rn, auto rm) {
        bf16_block_tile<decltype(rn)::value, decltype(rm)::value>(wp + (n0 + r) * k, xp + m0 * k, k, one);
      });
      for (int64_t t = 0; t < tokens; ++t) acc[t * kBlockRows + r] = one[t];
    }
  });
}

// bf16 activations x bf16 weights through the vdpbf16ps tiles, at any number of tokens.
void bf16_dot_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t k = x.size(-1), m = x.numel() / k;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (m >= kDotBlockTokens)
    return bf16_block_linear(wp, xp, w.size(0), m, k, bias ? bias->data_ptr<float>() : nullptr,
                             out.data_ptr<at::BFloat16>());
  run_small<at::BFloat16>(x, w.size(0), bias, out, [&](auto rn, auto rm, int64_t row, int64_t token, float* acc) {
    bf16_dot_tile<decltype(rn)::value, decltype(rm)::value>(wp + row * k, xp + token * k, k, acc);
  });
}
#endif

// The wide path: each tile of weight rows is expanded once to fp32 in a small buffer and multiplied by every
// token with FMAs (weights from cache). Up to kSmallBatch tokens the few-token kernel is faster (bench_kernels,
// 1 thread, SmolLM2's layers: 8 tokens 33.9 vs 41.7 ms; even at 16; slower from 32).
constexpr int64_t kWideRows = 4, kWideTokens = 3;  // 12 accumulators + 3 activation vectors
constexpr int64_t kSmallBatch = 8;

void expand_rows(const uint16_t* w, int64_t rows, int64_t k, float* dst) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < rows * k; ++i) out[i] = static_cast<uint32_t>(w[i]) << 16;  // bf16 -> fp32 bits
}

// out[m][n] for `rows` (<= kWideRows) fp32 weight rows x `tokens` (<= kWideTokens) fp32 activation rows.
void fp32_tile(const float* w, int64_t rows, const float* x, int64_t tokens, int64_t k, float* acc_out) {
  int64_t i = 0;
  float total[kWideRows][kWideTokens] = {};
#ifdef TRITONLLM_AVX2
  if (rows == kWideRows && tokens == kWideTokens) {
    __m256 acc[kWideRows][kWideTokens];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
      __m256 xv[kWideTokens];
      for (int m = 0; m < kWideTokens; ++m) xv[m] = _mm256_loadu_ps(x + m * k + i);
      for (int n = 0; n < kWideRows; ++n) {
        const __m256 wv = _mm256_loadu_ps(w + n * k + i);
        for (int m = 0; m < kWideTokens; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
      }
    }
    for (int n = 0; n < kWideRows; ++n)
      for (int m = 0; m < kWideTokens; ++m) total[n][m] = hsum(acc[n][m]);
  }
#endif
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t m = 0; m < tokens; ++m)
      for (int64_t j = i; j < k; ++j) total[n][m] += w[n * k + j] * x[m * k + j];
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t m = 0; m < tokens; ++m) acc_out[m * kWideRows + n] = total[n][m];
}

// Threads split the weight rows; each expands its rows tile by tile and runs all tokens over each tile.
template <typename Out>
void run_wide(int64_t n_rows, int64_t m_tokens, int64_t k, const uint16_t* w, const float* x, const float* bias, Out* out) {
  const int64_t row_tiles = (n_rows + kWideRows - 1) / kWideRows;
  work_split::for_each(row_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows_fp32(kWideRows * k);
    float acc[kWideRows * kWideTokens];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kWideRows, rows = std::min(kWideRows, n_rows - n0);
      if (rows < kWideRows) std::fill(rows_fp32.begin(), rows_fp32.end(), 0.f);  // full tiles: zero rows
      expand_rows(w + n0 * k, rows, k, rows_fp32.data());
      for (int64_t m0 = 0; m0 < m_tokens; m0 += kWideTokens) {
        const int64_t tokens = std::min(kWideTokens, m_tokens - m0);
        fp32_tile(rows_fp32.data(), kWideRows, x + m0 * k, kWideTokens, k, acc);  // x is padded
        for (int64_t m = 0; m < tokens; ++m)
          for (int64_t n = 0; n < rows; ++n)
            out[(m0 + m) * n_rows + n0 + n] = static_cast<Out>(acc[m * kWideRows + n] + (bias ? bias[n0 + n] : 0.f));
      }
    }
  });
}

// Activations as fp32 rows, zero-padded to whole tiles of kWideTokens so every tile takes the vector path.
at::Tensor fp32_activations(const at::Tensor& x, int64_t m, int64_t k) {
  const int64_t padded = (m + kWideTokens - 1) / kWideTokens * kWideTokens;
  at::Tensor out = at::zeros({padded, k}, x.options().dtype(at::kFloat));
  out.narrow(0, 0, m).copy_(x.reshape({m, k}));
  return out;
}

void check_activations(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "activations must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "activations must be float32 or bfloat16");
  TORCH_CHECK(x.size(-1) == k, errors::message("activations have ", x.size(-1), " features; the weight expects ", k));
}

void check_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias must be float32 [out_features]");
}

// A linear's output for activations x [..., K] and n output features: [..., n] in x's dtype.
at::Tensor linear_output(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return at::empty(shape, x.options());
}

void check_output(const at::Tensor& out, const at::Tensor& x, int64_t n) {
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.numel() == x.numel() / x.size(-1) * n,
              errors::message("the output must be contiguous, in the activations' dtype, with ", n, " features a token"));
}

void wide_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t k = x.size(-1), m = x.numel() / k, n = weight.size(0);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const at::Tensor x32 = fp32_activations(x, m, k);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    run_wide(n, m, k, w, x32.data_ptr<float>(), bp, out.data_ptr<float>());
  else
    run_wide(n, m, k, w, x32.data_ptr<float>(), bp, out.data_ptr<at::BFloat16>());
}

// oneDNN's bf16 GEMM (AMX tiles where the CPU has them; fp32 accumulation, rounded once to bf16), then the
// bias in fp32 as the kernels add it.
void gemm_bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t k = x.size(-1), m = x.numel() / k;
  at::Tensor out_rows = out.view({m, w.size(0)});
  at::mm_out(out_rows, x.view({m, k}), w.t());
  if (bias) out_rows.add_(*bias);
}

// From how many tokens bf16 activations take gemm_bf16_linear (0: never).
std::atomic<int64_t> onednn_bf16_min_tokens_{0};

}  // namespace

void set_onednn_bf16_min_tokens(int64_t tokens) {
  TORCH_CHECK(tokens >= 0, "a number of tokens, or 0 for never");
  onednn_bf16_min_tokens_.store(tokens);
}

int64_t onednn_bf16_min_tokens() { return onednn_bf16_min_tokens_.load(); }

// x [..., K] float32/bfloat16; w bfloat16 [N, K]; out [..., N] in x's dtype, written.
void bf16_linear_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(), "weight must be contiguous bfloat16 [N, K]");
  check_activations(x, w.size(1));
  check_bias(bias, w.size(0));
  check_output(out, x, w.size(0));
  const int64_t k = x.size(-1), m = x.numel() / k;
  const int64_t gemm_from = onednn_bf16_min_tokens_.load(std::memory_order_relaxed);
  if (x.scalar_type() == at::kBFloat16 && gemm_from > 0 && m >= gemm_from) return gemm_bf16_linear(x, w, bias, out);
#ifdef TRITONLLM_AVX512_BF16
  // bf16 activations below the GEMM's threshold take the dot tiles from 2 tokens: over SmolLM2's layers they
  // beat the fp32 expansion 2.2x at 16 tokens, 1.75x at 32 and 1.3x at 128 (2 threads). One token is
  // memory-bound: there they were no faster than the AVX2 tile on 2 threads (0.87-1.22x over four runs on a
  // Zen 5 host, served batch 1 0.88 vs 1.12 of llama.cpp's speed), so it keeps the AVX2 tile.
  if (x.scalar_type() == at::kBFloat16 && m > 1) return bf16_dot_linear(x, w, bias, out);
#endif
  if (m > kSmallBatch) return wide_linear(x, w, bias, out);
  if (x.scalar_type() == at::kFloat) return bf16_linear_impl<float>(x, w, bias, out);
  bf16_linear_impl<at::BFloat16>(x, w, bias, out);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2, "weight must be contiguous bfloat16 [N, K]");
  at::Tensor out = linear_output(x, w.size(0));
  bf16_linear_into(x, w, bias, out);
  return out;
}

bool built_with_avx2() {
#ifdef TRITONLLM_AVX2
  return true;
#else
  return false;
#endif
}
