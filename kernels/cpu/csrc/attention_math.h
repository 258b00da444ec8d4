// The float32 arithmetic of the CPU decode attention (kernels/csrc/paged_decode_attention.cpp): the
// softmax's exp, the query-key logits of a block's rows, and the value rows weighted by the softmax.
// Rows are float32 here whatever the cache stores (the caller widens them first).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define XINSERVE_AVX2 1
#endif

namespace xinserve_attention {

// exp(x) for the softmax's x <= 0: 2^(x log2 e) as an integer power of two (built in the exponent
// bits) times the degree-6 Taylor polynomial of 2^f for the remainder f in [-1/2, 1/2), relative
// error about 1e-7. Unlike std::exp it has no branch or call, so the loops using it vectorise.
inline float fast_exp(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504f;
  const float whole = std::floor(t + 0.5f);
  const float f = t - whole;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Eight floats in one vector register (AVX2's ymm, half an AVX-512 zmm), written with GCC's and Clang's
// generic vector extension rather than one instruction set's intrinsics: the accumulators below are
// named registers, so the hot loops do not depend on what the auto-vectoriser makes of them.
typedef float Vec8 __attribute__((vector_size(32)));

inline Vec8 load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float sum8(Vec8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// q . k over D floats: two vector accumulators (two FMA chains in flight), one horizontal sum.
template <int64_t kFixedDim>
inline float dot(const float* q, const float* k, int64_t head_dim) {
  const int64_t dim = kFixedDim ? kFixedDim : head_dim;
  Vec8 a = {}, b = {};
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    a += load8(q + d) * load8(k + d);
    b += load8(q + d + 8) * load8(k + d + 8);
  }
  if (d + 8 <= dim) {
    a += load8(q + d) * load8(k + d);
    d += 8;
  }
  float sum = sum8(a + b);
  for (; d < dim; ++d) sum += q[d] * k[d];
  return sum;
}

#ifdef XINSERVE_AVX2
// The eight horizontal sums of a0 ... a7 as one vector: two levels of pairwise adds within 128-bit
// lanes, then the lanes' halves added (9 instructions where eight separate sums take 56).
inline __m256 horizontal_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                               __m256 a7) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // [s0..s3 | s0'..s3']
  const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));  // [s4..s7 | s4'..s7']
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

// One query head's logits over ``tokens`` key rows when D = 64: the query stays in 8 registers, each key
// row is 8 FMAs on two chains, and eight rows' sums are reduced together (the per-row horizontal sum
// was most of the dot products' cost).
inline void scores64(const float* q, const float* k, int64_t stride, int64_t tokens, float* s) {
  __m256 qv[8];
  for (int i = 0; i < 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  auto row = [&](const float* r) {
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(r)), b = _mm256_mul_ps(qv[1], _mm256_loadu_ps(r + 8));
    for (int i = 2; i < 8; i += 2) {
      a = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(r + 8 * i), a);
      b = _mm256_fmadd_ps(qv[i + 1], _mm256_loadu_ps(r + 8 * i + 8), b);
    }
    return _mm256_add_ps(a, b);
  };
  int64_t t = 0;
  for (; t + 8 <= tokens; t += 8) {
    const float* r = k + t * stride;
    _mm256_storeu_ps(s + t, horizontal_sums8(row(r), row(r + stride), row(r + 2 * stride), row(r + 3 * stride),
                                             row(r + 4 * stride), row(r + 5 * stride), row(r + 6 * stride),
                                             row(r + 7 * stride)));
  }
  for (; t < tokens; ++t) {
    Vec8 v;
    const __m256 sum = row(k + t * stride);
    std::memcpy(&v, &sum, sizeof(v));
    s[t] = sum8(v);
  }
}
#endif

// s[t] = q . k[t] over one block's ``tokens`` key rows ``stride`` apart.
template <int64_t kFixedDim>
inline void scores(const float* q, const float* k, int64_t stride, int64_t tokens, int64_t head_dim, float* s) {
#ifdef XINSERVE_AVX2
  if constexpr (kFixedDim == 64) {
    scores64(q, k, stride, tokens, s);
    return;
  }
#endif
  for (int64_t t = 0; t < tokens; ++t) s[t] = dot<kFixedDim>(q, k + t * stride, head_dim);
}

// acc[c] += sum_t p[t] * v[t][c] for c < 8 kVecs: the output chunk stays in kVecs registers over the
// block's tokens (independent FMA chains), each value row read once per query head.
template <int64_t kVecs>
inline void weighted_rows(float* acc, const float* p, const float* v, int64_t stride, int64_t tokens) {
  Vec8 r[kVecs];
  for (int64_t i = 0; i < kVecs; ++i) r[i] = load8(acc + 8 * i);
  for (int64_t t = 0; t < tokens; ++t) {
    const Vec8 w = Vec8{} + p[t];
    const float* row = v + t * stride;
    for (int64_t i = 0; i < kVecs; ++i) r[i] += w * load8(row + 8 * i);
  }
  for (int64_t i = 0; i < kVecs; ++i) store8(acc + 8 * i, r[i]);
}

// The same over D floats: chunks of 64, 32 and 8, then the last D % 8 one at a time.
inline void weighted_sum(float* acc, const float* p, const float* v, int64_t stride, int64_t tokens, int64_t dim) {
  int64_t c = 0;
  for (; c + 64 <= dim; c += 64) weighted_rows<8>(acc + c, p, v + c, stride, tokens);
  if (c + 32 <= dim) {
    weighted_rows<4>(acc + c, p, v + c, stride, tokens);
    c += 32;
  }
  for (; c + 8 <= dim; c += 8) weighted_rows<1>(acc + c, p, v + c, stride, tokens);
  for (; c < dim; ++c) {
    float r = acc[c];
    for (int64_t t = 0; t < tokens; ++t) r += p[t] * v[t * stride + c];
    acc[c] = r;
  }
}

}  // namespace xinserve_attention
