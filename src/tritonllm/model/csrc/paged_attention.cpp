// Decode attention straight from the paged KV cache: no gather copy, no padding.
// Work is split into tasks of (sequence, kv head, span of at most `split` keys): the query heads of a group
// share each key and value they load, and long contexts are cut into spans so that batch 1 (3 kv heads on
// SmolLM2) keeps every thread busy. Each span keeps its own softmax maximum and sum; a second pass merges
// the spans of a (sequence, kv head) exactly (the log-sum-exp rescaling of flash-decoding).
// An int8 cache (kv_rows.h) is read as its int8 values: each key's scale multiplies its scores, each value's
// its probabilities, so the dot products are those of the float caches.
// A bf16 cache on AVX512_BF16 CPUs (head sizes 64 and 128) takes decode_bf16.h's vdpbf16ps paths instead of
// widening its values for fp32 FMAs; the amx build scores its keys on AMX tiles where the queries fit them.
// On AVX2 CPUs without AVX-512 a bf16 cache takes decode_avx2.h's paths (each key and value loaded once for
// the group's heads, 16 values per load in two operations): engine decode steps 1.03-1.06x faster (Zen 3).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_avx2.h"
#include "decode_bf16.h"
#include "kv_rows.h"
#include "simd.h"
#include "work_split.h"

namespace {

constexpr int64_t kMinSplit = 64;  // a span shorter than this costs more to merge than it saves
constexpr int64_t kMergeGrain = 16;  // (sequence, kv head) pairs merged per thread at least
constexpr int64_t kKeysAhead = 3;  // blocks of keys prefetched ahead (2-6 measured alike; 1 was 0.87-0.92x)

struct Task {
  int64_t seq, head, begin, end;  // keys [begin, end) of `seq` for kv head `head`
};

struct Geometry {
  int64_t heads, kv_heads, group, head_dim, num_blocks, block_size, width;
  int64_t row;  // a cached key's or value's elements (kv_rows::width)

  // The row width for a cache of C: head_dim itself for float caches, so that the compiler knows the two
  // strides are one (a separate stride cost 6% of decode attention's time).
  template <typename C>
  int64_t row_of() const {
    return kv_rows::kQuantized<C> ? row : head_dim;
  }
};

// Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at each one: ask for the keys
// kKeysAhead blocks ahead (and this block's values, read by the second pass) while this block is computed.
template <typename T>
inline void prefetch_block(const T* first, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(first);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 2);
}

// Calls fn(std::integral_constant<int, G>, g0) over the group's heads, three at a time.
template <typename Fn>
inline void in_threes(int64_t group, Fn&& fn) {
  int64_t g0 = 0;
  for (; g0 + 3 <= group; g0 += 3) fn(std::integral_constant<int, 3>{}, g0);
  if (group - g0 == 2) fn(std::integral_constant<int, 2>{}, g0);
  if (group - g0 == 1) fn(std::integral_constant<int, 1>{}, g0);
}

#ifdef TRITONLLM_AVX2
// The scales of 8 int8 rows `row` bytes apart (kv_rows.h), in one gather: what their keys' scores are multiplied by.
inline __m256 scales_of_8_rows(const int8_t* first, int64_t d, int64_t row) {
  const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(row)));
  return _mm256_i32gather_ps(reinterpret_cast<const float*>(first + d), offsets, 1);
}
#endif

#ifdef TRITONLLM_AVX512
// scores[g][j] = q_g . k_j for 8 keys from `k` (`row` elements apart) and query heads [g0, g0 + G): each 16
// dims of a key are loaded and widened once for the G heads (8 x G accumulators; G <= 3 keeps them in 32
// registers).
template <int G, typename T>
inline void scores_of_8_keys(const float* q, const T* k, int64_t d, int64_t row, int64_t g0, int64_t len, float* scores) {
  __m512 acc[G][8];
  for (auto& head : acc)
    for (auto& a : head) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    __m512 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = _mm512_loadu_ps(q + (g0 + g) * d + i);
    for (int u = 0; u < 8; ++u) {
      const __m512 kv = simd::load16(k + u * row + i);
      for (int g = 0; g < G; ++g) acc[g][u] = _mm512_fmadd_ps(qv[g], kv, acc[g][u]);
    }
  }
  if constexpr (kv_rows::kQuantized<T>) {
    const __m256 scales = scales_of_8_rows(k, d, row);
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(scores + (g0 + g) * len, _mm256_mul_ps(scales, simd::hsum8(acc[g])));
  } else {
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(scores + (g0 + g) * len, simd::hsum8(acc[g]));
  }
}

// acc[g][0, 64) += sum_j p_g[j] v_j[i, i + 64) over `run` values (`row` elements apart; an int8 row's scale
// multiplies its probabilities), for query heads [g0, g0 + G): each 16 dims of a value are loaded and widened
// once for the G heads.
template <int G, typename T>
inline void values_of_run(const float* p, int64_t len, const T* v, int64_t run, int64_t d, int64_t row, int64_t i,
                          int64_t g0, float* acc) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * d + i + 16 * c);
  for (int64_t j = 0; j < run; ++j) {
    __m512 vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = simd::load16(v + j * row + i + 16 * c);
    const float scale = kv_rows::scale(v + j * row, d);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(kv_rows::kQuantized<T> ? p[(g0 + g) * len + j] * scale : p[(g0 + g) * len + j]);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g0 + g) * d + i + 16 * c, a[g][c]);
}

#endif

// scores[g][t - begin] = q_g . k_t for the keys of one span, reading each key once for the whole group.
template <typename T>
void span_scores(const float* q, const T* keys, const T* values, const int64_t* table, const Geometry& geo,
                 int64_t begin, int64_t end, float* scores) {
  const int64_t d = geo.head_dim, row = geo.row_of<T>(), len = end - begin, block_elems = geo.block_size * row;
#ifdef TRITONLLM_AVX512_BF16
  thread_local decode_bf16::Query bf16_query;
  const bool bf16_dots = std::is_same_v<T, at::BFloat16> && decode_bf16::supports(d);
  if (bf16_dots) bf16_query.set(q, geo.group * d);
#ifdef TRITONLLM_AMX
  decode_bf16::Tiles tiles;
  const bool tile_dots = bf16_dots && tiles.load(bf16_query, geo.group, d);
#endif
#endif
#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512)
  thread_local std::vector<float> even_odd_query;
  const bool even_odd = std::is_same_v<T, at::BFloat16> && decode_avx2::supports(d);
  if (even_odd) decode_avx2::even_odd(q, geo.group * d, even_odd_query);
#else
  constexpr bool even_odd = false;
#endif
#ifdef TRITONLLM_AVX512
  bool eights = simd::kVectorLoad<T> && d % 16 == 0;  // the 8-key loop below scores the whole run
#ifdef TRITONLLM_AVX512_BF16
  eights = eights && !bf16_dots;
#endif
#else
  constexpr bool eights = false;
#endif
  for (int64_t t = begin; t < end;) {
    const int64_t in_block = t % geo.block_size, run = std::min(end - t, geo.block_size - in_block);
    const int64_t block = t / geo.block_size, offset = (table[block] * geo.block_size + in_block) * row;
    const T* k = keys + offset;  // `run` contiguous keys
    const T* v = values + offset;
    const int64_t last = (end - 1) / geo.block_size;
    // After a span's first block, the AVX2 bf16 loop asks for the block kKeysAhead ahead and this block's values
    // 4 keys at a time, between its products: a block's 64 prefetches at once filled the miss buffers and held
    // the products behind them (32 x 200 keys from DRAM, Zen 3: 1.155x faster spread). The AVX-512 8-key loop
    // does the same 8 keys at a time (an int8 cache, 64 x 336 keys over 30 layers' caches, Xeon: 0.956 of the
    // time, paired median of 4).
    const bool spread = (even_odd || eights) && t != begin;
    [[maybe_unused]] const T* keys_ahead = spread && block + kKeysAhead <= last ? keys + table[block + kKeysAhead] * block_elems : nullptr;
    if (!spread) {
      for (int64_t ahead = (t == begin ? 1 : kKeysAhead); ahead <= kKeysAhead; ++ahead)
        if (block + ahead <= last) prefetch_block(keys + table[block + ahead] * block_elems, block_elems);
      prefetch_block(v, run * row);
    }
    float* out = scores + (t - begin);
    int64_t j = 0;
#ifdef TRITONLLM_AVX512_BF16
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (bf16_dots) {
#ifdef TRITONLLM_AMX
        if (tile_dots) tiles.scores(bf16_query, geo.group, d, k, run, len, out);
        else
#endif
          decode_bf16::scores(bf16_query, geo.group, d, k, run, len, out);
        j = run;
      }
#endif
#ifdef TRITONLLM_AVX512
    if constexpr (simd::kVectorLoad<T>)
      if (eights) {
        for (; j + 8 <= run; j += 8) {
          if (spread) {
            if (keys_ahead != nullptr) prefetch_block(keys_ahead + j * row, 8 * row);
            prefetch_block(v + j * row, 8 * row);
          }
          in_threes(geo.group, [&](auto heads, int64_t g0) {
            scores_of_8_keys<decltype(heads)::value>(q, k + j * row, d, row, g0, len, out + j);
          });
        }
        if (spread && j < run) prefetch_block(v + j * row, (run - j) * row);
      }
#endif
#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (even_odd) {
        const float* qd = even_odd_query.data();
        for (; j + 4 <= run; j += 4) {
          if (spread) {  // blocks after a span's first start at their first key: in_block is 0
            if (keys_ahead != nullptr) prefetch_block(keys_ahead + j * row, 4 * row);
            prefetch_block(v + j * row, 4 * row);
          }
          in_threes(geo.group, [&](auto heads, int64_t g0) {
            decode_avx2::scores_of_keys<decltype(heads)::value, 4>(qd, k + j * row, d, g0, len, out + j);
          });
        }
        if (spread && j < run) prefetch_block(v + j * row, (run - j) * row);
        for (; j < run; ++j)
          in_threes(geo.group, [&](auto heads, int64_t g0) {
            decode_avx2::scores_of_keys<decltype(heads)::value, 1>(qd, k + j * row, d, g0, len, out + j);
          });
      }
#endif
#ifdef TRITONLLM_AVX2
    if constexpr (simd::kVectorLoad<T>)
      for (; d % 8 == 0 && j + 8 <= run; j += 8)
        for (int64_t g = 0; g < geo.group; ++g) {
          __m256 acc[8];
          for (auto& a : acc) a = _mm256_setzero_ps();
          for (int64_t i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + g * d + i);
            for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, simd::load8(k + (j + u) * row + i), acc[u]);
          }
          __m256 sums = simd::hsum8(acc);
          if constexpr (kv_rows::kQuantized<T>) sums = _mm256_mul_ps(scales_of_8_rows(k + j * row, d, row), sums);
          _mm256_storeu_ps(out + g * len + j, sums);
        }
#endif
    for (; j < run; ++j)
      for (int64_t g = 0; g < geo.group; ++g) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; ++i) acc += q[g * d + i] * simd::to_float(k[j * row + i]);
        out[g * len + j] = kv_rows::kQuantized<T> ? acc * kv_rows::scale(k + j * row, d) : acc;
      }
    t += run;
  }
}

// fn(t, run, v) over a span's runs: its keys [begin, end) a block at most at a time, the run's first value at v.
template <typename T, typename Fn>
inline void for_each_run(const T* values, const int64_t* table, const Geometry& geo, int64_t begin, int64_t end,
                         Fn&& fn) {
  const int64_t row = geo.row_of<T>();
  for (int64_t t = begin; t < end;) {
    const int64_t in_block = t % geo.block_size, run = std::min(end - t, geo.block_size - in_block);
    fn(t, run, values + (table[t / geo.block_size] * geo.block_size + in_block) * row);
    t += run;
  }
}

// acc[g] = sum_t p[g][t] * v_t over the span (acc zeroed here); an int8 row's scale multiplies its p.
template <typename T>
void span_values(const float* p, const T* values, const int64_t* table, const Geometry& geo, int64_t begin,
                 int64_t end, float* acc) {
  const int64_t d = geo.head_dim, row = geo.row_of<T>(), len = end - begin;
  std::fill(acc, acc + geo.group * d, 0.f);
#ifdef TRITONLLM_AVX512_BF16
  // Its own loop over the blocks: folded into the loop below (a branch in it, the lane order undone after it),
  // the outputs were the same but decode attention from DRAM took 1.06-1.08x the time (paired, Zen 4).
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (decode_bf16::supports(d)) {
      thread_local std::vector<uint16_t> p16;
      decode_bf16::bf16_probabilities(p, geo.group, len, p16);
      for_each_run(values, table, geo, begin, end, [&](int64_t t, int64_t run, const T* v) {
        for (int64_t i = 0; i < d; i += 64)
          in_threes(geo.group, [&](auto heads, int64_t g0) {
            decode_bf16::values_of_run<decltype(heads)::value>(p16.data() + (t - begin), len + 1, v, run, d, i, g0, acc);
          });
      });
      decode_bf16::unpermute_sums(acc, geo.group * d);
      return;
    }
#endif
#if defined(TRITONLLM_AVX2) && !defined(TRITONLLM_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (decode_avx2::supports(d)) {
      for_each_run(values, table, geo, begin, end, [&](int64_t t, int64_t run, const T* v) {
        for (int64_t i = 0; i < d; i += 16)
          in_threes(geo.group, [&](auto heads, int64_t g0) {
            decode_avx2::values_of_run<decltype(heads)::value>(p + (t - begin), len, v, run, d, i, g0, acc);
          });
      });
      decode_avx2::unpermute_sums(acc, geo.group * d);
      return;
    }
#endif
  for_each_run(values, table, geo, begin, end, [&](int64_t t, int64_t run, const T* v) {
#ifdef TRITONLLM_AVX512
    if constexpr (simd::kVectorLoad<T>)
      if (d % 64 == 0) {
        for (int64_t i = 0; i < d; i += 64)
          in_threes(geo.group, [&](auto heads, int64_t g0) {
            values_of_run<decltype(heads)::value>(p + (t - begin), len, v, run, d, row, i, g0, acc);
          });
        return;
      }
#endif
    for (int64_t g = 0; g < geo.group; ++g) {
      const float* pg = p + g * len + (t - begin);
      float* out = acc + g * d;
      int64_t i = 0;
#ifdef TRITONLLM_AVX2
      if constexpr (simd::kVectorLoad<T>)
        for (; i + 32 <= d; i += 32) {  // four accumulators stay in registers over the run
        __m256 a0 = _mm256_loadu_ps(out + i), a1 = _mm256_loadu_ps(out + i + 8);
        __m256 a2 = _mm256_loadu_ps(out + i + 16), a3 = _mm256_loadu_ps(out + i + 24);
        for (int64_t j = 0; j < run; ++j) {
          const T* r = v + j * row + i;
          const __m256 w = _mm256_set1_ps(kv_rows::kQuantized<T> ? pg[j] * kv_rows::scale(v + j * row, d) : pg[j]);
          a0 = _mm256_fmadd_ps(w, simd::load8(r), a0);
          a1 = _mm256_fmadd_ps(w, simd::load8(r + 8), a1);
          a2 = _mm256_fmadd_ps(w, simd::load8(r + 16), a2);
          a3 = _mm256_fmadd_ps(w, simd::load8(r + 24), a3);
        }
        _mm256_storeu_ps(out + i, a0);
        _mm256_storeu_ps(out + i + 8, a1);
        _mm256_storeu_ps(out + i + 16, a2);
        _mm256_storeu_ps(out + i + 24, a3);
      }
#endif
      for (; i < d; ++i) {
        float a = out[i];
        for (int64_t j = 0; j < run; ++j)
          a += (kv_rows::kQuantized<T> ? pg[j] * kv_rows::scale(v + j * row, d) : pg[j]) * simd::to_float(v[j * row + i]);
        out[i] = a;
      }
    }
  });
}

// Softmax numerators in place: each row of `scores` becomes exp(s - max); writes the row's max and sum.
void exp_rows(float* scores, int64_t rows, int64_t len, float* maxima, float* sums) {
  for (int64_t g = 0; g < rows; ++g) {
    float* row = scores + g * len;
    float peak = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t t = 0; t < len; ++t) peak = std::max(peak, row[t]);
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));  // vector expf (fast-math)
    maxima[g] = peak;
    sums[g] = total;
  }
}

// Spans of at most `split` keys per (sequence, kv head); `split` shrinks until there are a few tasks per thread.
std::vector<Task> plan_tasks(const int64_t* lens, int64_t seqs, const Geometry& geo, int64_t threads) {
  int64_t longest = 1;
  for (int64_t s = 0; s < seqs; ++s) longest = std::max(longest, lens[s]);
  const int64_t wanted = 4 * threads, have = seqs * geo.kv_heads;
  int64_t split = longest;
  if (have < wanted) split = std::max(kMinSplit, (longest * have + wanted - 1) / wanted);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t h = 0; h < geo.kv_heads; ++h)
      for (int64_t b = 0; b < lens[s]; b += split) tasks.push_back({s, h, b, std::min(lens[s], b + split)});
  return tasks;
}

// T: the queries' and output's dtype; C: the cache's (T, bf16 under fp32 activations, or int8).
template <typename T, typename C>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const Geometry geo{q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0), q.size(2), k_cache.size(1),
                     k_cache.size(2), block_tables.size(1), k_cache.size(3)};
  const int64_t seqs = q.size(0), d = geo.head_dim, gd = geo.group * d;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const std::vector<Task> tasks = plan_tasks(lens, seqs, geo, work_split::num_threads());
  const int64_t n = static_cast<int64_t>(tasks.size());
  // Per task: the unnormalized output of its span and, per query head, the span's max and sum.
  std::vector<float> partial(n * gd), maxima(n * geo.group), sums(n * geo.group);
  const int64_t per_head = geo.num_blocks * geo.block_size * geo.row;

  // Tasks differ in length, and a thread may lose its core for a while: work_split.h lets a thread that is done
  // take the others' remaining tasks.
  work_split::for_each(n, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> query, scores;
    query.resize(gd);
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      for (int64_t j = 0; j < gd; ++j)
        query[j] = simd::to_float(qp[(task.seq * geo.heads + task.head * geo.group) * d + j]) * static_cast<float>(scale);
      const int64_t len = task.end - task.begin;
      scores.resize(geo.group * len);
      const int64_t* table = tables + task.seq * geo.width;
      span_scores(query.data(), kp + task.head * per_head, vp + task.head * per_head, table, geo, task.begin,
                  task.end, scores.data());
      exp_rows(scores.data(), geo.group, len, &maxima[i * geo.group], &sums[i * geo.group]);
      span_values(scores.data(), vp + task.head * per_head, table, geo, task.begin, task.end, &partial[i * gd]);
    }
  });

  // Merge the spans of each (sequence, kv head): tasks of one pair are consecutive. A pair's merge is a few
  // hundred multiply-adds per span, so a small batch merges on this thread: a parallel region (a barrier that
  // waits for every thread) costs more, and a decode step runs one per layer.
  std::vector<int64_t> first(seqs * geo.kv_heads + 1, n);
  for (int64_t i = n - 1; i >= 0; --i) first[tasks[i].seq * geo.kv_heads + tasks[i].head] = i;
  T* op = out.data_ptr<T>();
  work_split::for_each(seqs * geo.kv_heads, kMergeGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t lo = first[pair], hi = first[pair + 1];
      for (int64_t g = 0; g < geo.group; ++g) {
        float peak = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t i = lo; i < hi; ++i) peak = std::max(peak, maxima[i * geo.group + g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = lo; i < hi; ++i) {
          const float w = std::exp(maxima[i * geo.group + g] - peak);
          total += w * sums[i * geo.group + g];
          const float* src = &partial[i * gd + g * d];
          for (int64_t j = 0; j < d; ++j) acc[j] += w * src[j];
        }
        T* dst = op + (pair * geo.group + g) * d;  // pair = seq * kv_heads + head: heads of a group are adjacent
        for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[j] / total);
      }
    }
  });
}

}  // namespace

void paged_decode_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [seqs, heads, head_dim]");
  const kv_rows::Kind kind = kv_rows::check(k_cache, v_cache, q.scalar_type());
  TORCH_CHECK(kv_rows::head_dim(k_cache) == q.size(2), "q's head size does not fit the cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "the output must be like q");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(lens.numel() == q.size(0), "one context length per decode");
  // A loop, not lens.min().item(): two ATen calls per layer cost more than the check's few reads.
  const int64_t* lengths = lens.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(lengths, lengths + lens.numel(), [](int64_t n) { return n >= 1; }),
              "every decode attends to at least one key");
  if (kind == kv_rows::Kind::kInt8) {
    if (q.scalar_type() == at::kFloat) decode_kernel<float, int8_t>(q, k_cache, v_cache, tables, lens, scale, out);
    else decode_kernel<at::BFloat16, int8_t>(q, k_cache, v_cache, tables, lens, scale, out);
    return;
  }
  if (kind == kv_rows::Kind::kBf16UnderFp32) {
    decode_kernel<float, at::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t, scalar_t>(q, k_cache, v_cache, tables, lens, scale, out);
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  at::Tensor out = at::empty_like(q);
  paged_decode_attention_into(q, k_cache, v_cache, block_tables, context_lens, scale, out);
  return out;
}
