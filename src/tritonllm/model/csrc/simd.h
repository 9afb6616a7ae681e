// AVX2 helpers the kernels share. TRITONLLM_AVX2 is defined when the translation unit is compiled with
// AVX2+FMA (cpu_kernels.py builds one variant per instruction set); without it the kernels run portable loops.
// TRITONLLM_AVX512, TRITONLLM_AVX512_VNNI and TRITONLLM_AVX512_BF16 add AVX-512 paths on top of the AVX2 ones.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRITONLLM_AVX2 1
#endif
// AVX-512 (the avx512 builds): 16-lane paths with 32 registers where they pay (decode attention).
#if defined(TRITONLLM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define TRITONLLM_AVX512 1
#endif
// AVX-512 with VNNI (the avx512_vnni and avx512_bf16 builds): the int8 kernel's 512-bit u8 x s8 dot products.
#if defined(TRITONLLM_AVX512) && defined(__AVX512VNNI__)
#define TRITONLLM_AVX512_VNNI 1
#endif
// AVX-512 with BF16 too (the avx512_bf16 build): 512-bit bf16 pair dot products (vdpbf16ps) with fp32 sums.
#if defined(TRITONLLM_AVX512_VNNI) && defined(__AVX512BF16__)
#define TRITONLLM_AVX512_BF16 1
#endif
// AMX tiles too (the amx build: amx.h): bf16 and int8 tile products for linears of several tokens.
#if defined(TRITONLLM_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define TRITONLLM_AMX 1
#endif

// Before a loop over a register tile's rows or tokens: unrolled early, the tile's accumulator array lives in
// registers. Unrolled late (GCC 12's default), the array stayed on the stack too and every accumulator was
// stored on every step of the loop around it (16 stores a step in the 4 x 4 bf16 dot tile).
#define TRITONLLM_UNROLL _Pragma("GCC unroll 16")

namespace simd {

// Allocates on 64-byte cache lines. AMX tile rows are 64 bytes: a buffer that malloc left 16 bytes off a line
// puts every row across two lines, and the tile loads from it took ~10% longer over a whole prefill linear.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
// A vector whose data starts on a cache line (what tile loads and stores should read and write).
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// Element types the AVX2 loads below read (others take the portable loops).
template <typename T>
inline constexpr bool kVectorLoad =
    std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, int8_t>;

#ifdef TRITONLLM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The horizontal sums of eight vectors, as one vector: lane j = sum of a[j]'s lanes.
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return load_bf16x8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#ifdef TRITONLLM_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The horizontal sums of eight vectors, as one vector: lane j = sum of a[j]'s lanes.
inline __m256 hsum8(const __m512* a) {
  __m256 halves[8];
  for (int j = 0; j < 8; ++j)
    halves[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
  return hsum8(halves);
}
#endif

#ifdef TRITONLLM_AVX512_BF16
inline __m512bh as_bf16(__m512i v) { return (__m512bh)v; }  // 32 bf16 lanes, as vdpbf16ps takes them
#endif

}  // namespace simd
