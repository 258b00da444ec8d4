// The linear layer of a decode step on the CPU, for a few rows: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
//
// At decode sizes (M = the batch, a few to a few tens of rows) a linear layer is bound by reading its
// weight, which is cold in every step (the K/V stream and the other layers evict it between steps).
// MKL's sgemm at these M neither streams the weight at the machine's read bandwidth nor overlaps the
// misses with its arithmetic (a cold 1.5 MB weight at M = 8: ~3 GB/s where a ``sum`` reads ~10 GB/s).
// Here the weight is read once, in its nn.Linear layout [N, K] row-major (no second, packed copy), a
// block of NB output rows at a time: the block's NB rows are one contiguous run of NB * K values, and
// the run a few blocks ahead is prefetched while this one is multiplied. Within the block, each pair of
// input rows keeps 4 x 2 vector accumulators over K (FMA, kLanes floats wide); the block's weight rows
// stay in L1 for the later pairs. Horizontal sums at the end of the block. Past a few rows (a batch of
// decodes) the arithmetic, not the weight's bytes, bounds the layer, and broadcast tiles without horizontal
// sums take over (broadcast_tile below).
//
// Weights may be float32, bfloat16 or float16 (x and y in the same dtype), accumulated in float32: the
// input rows are widened to float32 once, the weight on the fly. K need not be a multiple of the vector
// width (a scalar tail), nor N of the block (blocks of one row at the end), nor M of the group.

// ATen's tensor and parallel headers only, not <torch/extension.h> (torch's whole C++ frontend and pybind11):
// 3 s of compiling instead of 37 per file (measured), which is most of a cold start's kernel build.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// A tile of 4 weight rows x 2 input rows holds 8 accumulators, 4 weight and 2 input vectors: 14 of AVX2's
// 16 vector registers. XINSERVE_DECODE_LINEAR_LANES forces the width: 16 on an AVX2 machine runs AVX-512's
// lane logic (folds, tails, the broadcast tiles' row groups) with each vector split in two registers, which
// tests/kernels/test_decode_linear_wide.py checks against F.linear where no AVX-512 machine is at hand.
#if defined(XINSERVE_DECODE_LINEAR_LANES)
constexpr int64_t kLanes = XINSERVE_DECODE_LINEAR_LANES;
#elif defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

// Keeps vector v in a register from here on (why: tile below). Only where a vector fits in one of x86's
// registers: one wider (the forced width above on AVX2; any of ours on NEON's 128 bits) is left to the compiler.
#if defined(__AVX512F__) || (defined(__AVX__) && !(defined(XINSERVE_DECODE_LINEAR_LANES) && XINSERVE_DECODE_LINEAR_LANES > 8))
#define PIN(v) asm("" : "+v"(v))
#else
#define PIN(v) static_cast<void>(0)
#endif
constexpr int64_t kBlock = 4;  // output rows per block
// How far ahead of the block being multiplied its weight is prefetched, in bytes of the flat weight:
// enough to cover the memory latency at the machine's bandwidth (measured with the weight cold).
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kLine = 64;

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vbits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vbits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
// IEEE half precision as the compiler knows it: _Float16 on x86, __fp16 on ARM (Kunpeng, Ascend's hosts).
#if defined(__aarch64__) || defined(__arm__)
typedef __fp16 half_t;
#else
typedef _Float16 half_t;
#endif
typedef half_t vhalf __attribute__((vector_size(kLanes * sizeof(half_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes weights widened to float32: bfloat16 is the high half of a float32, float16 converts (F16C).
template <typename w_t>
inline vfloat load_weight(const w_t* p) {
  if constexpr (std::is_same_v<w_t, float>) {
    return load(p);
  } else if constexpr (std::is_same_v<w_t, at::BFloat16>) {
    vbits16 bits;
    std::memcpy(&bits, p, sizeof(bits));
    vbits32 wide = __builtin_convertvector(bits, vbits32) << 16;
    vfloat v;
    std::memcpy(&v, &wide, sizeof(v));
    return v;
  } else {
    vhalf h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, vfloat);
  }
}

typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));

// 8 lanes holding the partial sums of one vector accumulator (16 lanes: the halves added). A template so that
// the branch of the other width is discarded, not compiled: in a plain function ``if constexpr`` still
// type-checks both, and a 16-lane build failed on ``return v`` (the whole extension did not build on
// AVX-512 machines, which then ran the reference kernels).
template <typename V>
inline vfloat8 fold(V v) {
  if constexpr (sizeof(V) == 16 * sizeof(float)) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  } else {
    return v;
  }
}

inline float horizontal_sum(vfloat v) {
  const vfloat8 f = fold(v);
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += f[i];
  return s;
}

// The four horizontal sums of a, b, c, d at once, by transposing adds (lanes of a then b: [a a a a b b b b],
// then [a a b b c c d d], then a b c d in the first four lanes).
inline vfloat8 horizontal_sums4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const vfloat8 fa = fold(a), fb = fold(b), fc = fold(c), fd = fold(d);
  const vfloat8 ab = __builtin_shufflevector(fa, fb, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(fa, fb, 4, 5, 6, 7, 12, 13, 14, 15);
  const vfloat8 cd = __builtin_shufflevector(fc, fd, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(fc, fd, 4, 5, 6, 7, 12, 13, 14, 15);
  const vfloat8 abcd = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                       __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(abcd, abcd, 0, 2, 4, 6, 0, 2, 4, 6) +
         __builtin_shufflevector(abcd, abcd, 1, 3, 5, 7, 1, 3, 5, 7);
}

// y[m, n] for the NB (1 or 4) weight rows at w (row stride k) and the MB (1 or 2) input rows at x (float32,
// row stride k). Named accumulators, not arrays: with arrays GCC keeps them in registers only while it may
// fold the weight loads into the FMAs, loading each weight vector MB times; the empty asm statements pin
// each loaded vector to a register (PIN), so every k step is NB + MB loads for NB x MB FMAs. The first group of
// a block prefetches the weight run kPrefetchBytes ahead (later groups find the block in cache), into every
// cache level: a non-temporal prefetch would keep a model that fits in the L3 from staying there. y rows
// are out_stride apart; bias (float32, NB values) or null.
template <int64_t NB, int64_t MB, typename w_t>
inline void tile(const float* x, const w_t* w, int64_t k, float* y, int64_t out_stride, const float* bias,
                 bool prefetch) {
  static_assert((NB == 1 || NB == 4) && (MB == 1 || MB == 2), "tiles of 1 or 4 weight rows, 1 or 2 input rows");
  vfloat a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};  // a: input row 0, b: input row 1; digit: weight row
  const int64_t body = k - k % kLanes;
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  // the block's NB * kLanes weights of one step, in cache lines
  constexpr int64_t lines_per_step = std::max<int64_t>(1, NB * kLanes * static_cast<int64_t>(sizeof(w_t)) / kLine);
  for (int64_t i = 0; i < body; i += kLanes) {
    if (prefetch) {
      for (int64_t l = 0; l < lines_per_step; ++l) __builtin_prefetch(ahead + l * kLine, 0, 3);
      ahead += lines_per_step * kLine;
    }
    vfloat x0 = load(x + i);
    PIN(x0);
    if constexpr (NB == 1) {
      vfloat w0 = load_weight(w + i);
      PIN(w0);
      a0 += x0 * w0;
      if constexpr (MB == 2) b0 += load(x + k + i) * w0;
    } else {
      vfloat w0 = load_weight(w + i), w1 = load_weight(w + k + i), w2 = load_weight(w + 2 * k + i),
             w3 = load_weight(w + 3 * k + i);
      PIN(w0);
      PIN(w1);
      PIN(w2);
      PIN(w3);
      a0 += x0 * w0;
      a1 += x0 * w1;
      a2 += x0 * w2;
      a3 += x0 * w3;
      if constexpr (MB == 2) {
        vfloat x1 = load(x + k + i);
        PIN(x1);
        b0 += x1 * w0;
        b1 += x1 * w1;
        b2 += x1 * w2;
        b3 += x1 * w3;
      }
    }
  }
  const vfloat rows[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
  for (int64_t m = 0; m < MB; ++m) {
    float sums[NB];
    if constexpr (NB == 4) {
      const vfloat8 four = horizontal_sums4(rows[m][0], rows[m][1], rows[m][2], rows[m][3]);
      for (int64_t n = 0; n < NB; ++n) sums[n] = four[n];
    } else {
      sums[0] = horizontal_sum(rows[m][0]);
    }
    for (int64_t n = 0; n < NB; ++n) {
      float s = sums[n];
      for (int64_t i = body; i < k; ++i) s += x[m * k + i] * static_cast<float>(w[n * k + i]);
      y[m * out_stride + n] = bias ? s + bias[n] : s;
    }
  }
}

// Every input row against the NB weight rows at w: pairs of rows, then the odd one.
template <int64_t NB, typename w_t>
void rows_block(const float* x, int64_t rows, const w_t* w, int64_t k, float* y, int64_t out_stride,
                const float* bias) {
  int64_t m = 0;
  for (; m + 2 <= rows; m += 2) tile<NB, 2>(x + m * k, w, k, y + m * out_stride, out_stride, bias, m == 0);
  if (m < rows) tile<NB, 1>(x + m * k, w, k, y + m * out_stride, out_stride, bias, m == 0);
}

// Past kInnerRows input rows the dot-product tiles above lose to their horizontal sums and to re-reading x
// (all M rows stream from L2 for every block of weight rows): there a broadcast tile takes over. It sees
// y^T [N, M] = W [N, K] @ x^T [K, M]: each weight value is broadcast to a vector and multiplied with kLanes
// input rows at once, read from x transposed (xt [K, MV * kLanes], rows past M zero). kBroadcastRows weight
// rows x MV vectors of input rows are 12 accumulators (MV = 4), 3 broadcasts and one x vector: AVX2's 16
// registers; no horizontal sums. Measured on the 2-core AVX2 EPYC, weight cold, the 5M Llama's shapes: at 16
// and 32 rows 62-80 GF/s where the dot-product tiles reach 40-62; level at 12 rows; 6-12% behind at 9-11
// (a vector of input rows partly empty).
constexpr int64_t kInnerRows = 12;
constexpr int64_t kBroadcastRows = 3;

// y[m, n] for the NB weight rows at w (float32, row stride k) and the M <= MV * kLanes rows of xt. ``ahead``
// walks the weight's bytes kPrefetchBytes ahead, one line every 4 steps (a block's NB rows are 3 short
// streams, too short for the hardware prefetcher to pick up).
template <int64_t NB, int64_t MV>
inline void broadcast_tile(const float* xt, const float* w, int64_t k, int64_t rows, float* y, int64_t out_stride,
                           const float* bias, const char* ahead) {
  vfloat c[NB][MV];
  for (int64_t n = 0; n < NB; ++n)
    for (int64_t j = 0; j < MV; ++j) c[n][j] = vfloat{};
  for (int64_t i = 0; i < k; ++i) {
    if ((i & 3) == 0) {
      __builtin_prefetch(ahead, 0, 3);
      ahead += kLine;
    }
    vfloat b[NB];
    for (int64_t n = 0; n < NB; ++n) {
      b[n] = vfloat{} + w[n * k + i];
      PIN(b[n]);
    }
    const float* row = xt + i * MV * kLanes;
    for (int64_t j = 0; j < MV; ++j) {
      vfloat xv = load(row + j * kLanes);
      PIN(xv);
      for (int64_t n = 0; n < NB; ++n) c[n][j] += b[n] * xv;
    }
  }
  for (int64_t n = 0; n < NB; ++n) {
    const float add = bias ? bias[n] : 0.0f;
    for (int64_t m = 0; m < rows; ++m) y[m * out_stride + n] = c[n][m / kLanes][m % kLanes] + add;
  }
}

// The NB weight rows at w against every row of xt: widened to float32 into ``wide`` first (NB * k floats)
// unless they are float32 already.
template <int64_t NB, int64_t MV, typename w_t>
inline void broadcast_block(const float* xt, const w_t* w, int64_t k, int64_t rows, float* y, int64_t out_stride,
                            const float* bias, float* wide) {
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  if constexpr (std::is_same_v<w_t, float>) {
    broadcast_tile<NB, MV>(xt, w, k, rows, y, out_stride, bias, ahead);
  } else {
    const int64_t count = NB * k, body = count - count % kLanes;
    for (int64_t i = 0; i < body; i += kLanes) {
      const vfloat v = load_weight(w + i);
      std::memcpy(wide + i, &v, sizeof(v));
    }
    for (int64_t i = body; i < count; ++i) wide[i] = static_cast<float>(w[i]);
    broadcast_tile<NB, MV>(xt, wide, k, rows, y, out_stride, bias, ahead);
  }
}

// y [M, N] with the broadcast tiles, MV = ceil(M / kLanes): x transposed once (xt, shared by the threads),
// blocks of kBroadcastRows output rows split over torch's threads, the last N % 3 one row at a time.
template <int64_t MV, typename w_t>
void broadcast_linear(const float* x, int64_t rows, const w_t* w, int64_t n_out, int64_t k, const float* bias,
                      float* y) {
  std::vector<float> xt(k * MV * kLanes, 0.0f);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) xt[i * MV * kLanes + m] = x[m * k + i];
  const int64_t blocks = n_out / kBroadcastRows;
  const int64_t grain =
      std::max<int64_t>(1, (64 << 10) / (kBroadcastRows * k * static_cast<int64_t>(sizeof(w_t))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(std::is_same_v<w_t, float> ? 0 : kBroadcastRows * k);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kBroadcastRows;
      broadcast_block<kBroadcastRows, MV>(xt.data(), w + n * k, k, rows, y + n, n_out, bias ? bias + n : nullptr,
                                          wide.data());
    }
  });
  std::vector<float> wide(std::is_same_v<w_t, float> ? 0 : k);
  for (int64_t n = blocks * kBroadcastRows; n < n_out; ++n) {
    broadcast_block<1, MV>(xt.data(), w + n * k, k, rows, y + n, n_out, bias ? bias + n : nullptr, wide.data());
  }
}

// y [M, N] float32 = x [M, K] float32 @ w [N, K]^T (+ bias [N] float32). Up to kInnerRows rows the
// dot-product tiles: blocks of output rows split over torch's threads, each thread's range a contiguous run
// of the weight. More rows: the broadcast tiles, with as many vectors of input rows as M needs.
template <typename w_t>
void linear(const float* x, int64_t rows, const w_t* w, int64_t n_out, int64_t k, const float* bias, float* y) {
  if (rows > kInnerRows) {
    switch ((rows + kLanes - 1) / kLanes) {
      case 2: broadcast_linear<2>(x, rows, w, n_out, k, bias, y); return;
      case 3: broadcast_linear<3>(x, rows, w, n_out, k, bias, y); return;
      case 4: broadcast_linear<4>(x, rows, w, n_out, k, bias, y); return;
      default: break;  // one vector (AVX-512: up to 16 rows) or past 4: the dot-product tiles
    }
  }
  const int64_t blocks = n_out / kBlock;
  // a thread's share is at least ~64 KB of weight: smaller ones cost more to hand out than to read
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kBlock * k * static_cast<int64_t>(sizeof(w_t))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kBlock;
      rows_block<kBlock>(x, rows, w + n * k, k, y + n, n_out, bias ? bias + n : nullptr);
    }
  });
  for (int64_t n = blocks * kBlock; n < n_out; ++n) {
    rows_block<1>(x, rows, w + n * k, k, y + n, n_out, bias ? bias + n : nullptr);
  }
}

}  // namespace

// x [M, K] (rows any stride apart, K contiguous), weight [N, K] contiguous, bias [N] or none; all one dtype
// (float32, bfloat16 or float16). Returns y [M, N] in that dtype.
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "decode_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "decode_linear: CPU tensors expected");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype, "decode_linear: x and weight differ in dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "decode_linear: float32, bfloat16 or float16 expected, got ", dtype);
  TORCH_CHECK(weight.is_contiguous(), "decode_linear: the weight must be contiguous");
  const int64_t rows = x.size(0), n_out = weight.size(0), k = weight.size(1);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_out, "decode_linear: bias [N] expected");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  // the input rows in float32, contiguous: a few KB, read once per block of weight rows
  const auto x32 = x.to(at::kFloat).contiguous();
  auto y32 = at::empty({rows, n_out}, x.options().dtype(at::kFloat));
  if (rows == 0 || n_out == 0) return y32.to(dtype);
  const float* bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  switch (dtype) {
    case at::kFloat:
      linear(x32.data_ptr<float>(), rows, weight.data_ptr<float>(), n_out, k, bias_ptr, y32.data_ptr<float>());
      break;
    case at::kBFloat16:
      linear(x32.data_ptr<float>(), rows, weight.data_ptr<at::BFloat16>(), n_out, k, bias_ptr, y32.data_ptr<float>());
      break;
    default:
      linear(x32.data_ptr<float>(), rows, weight.data_ptr<at::Half>(), n_out, k, bias_ptr, y32.data_ptr<float>());
  }
  return dtype == at::kFloat ? y32 : y32.to(dtype);
}

// The vector width the kernel was built with, in floats: 8 (AVX2), 16 (AVX-512 or the forced width above).
int64_t decode_linear_lanes() { return kLanes; }
