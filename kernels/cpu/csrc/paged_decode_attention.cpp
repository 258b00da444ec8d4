// Decode attention on the CPU that reads K/V blocks where they lie in the paged cache.
//
// The reference gathers every sequence's context out of the cache (one copy per layer) and runs
// SDPA with a mask for a single query row; here each (sequence, KV head) walks its block table and
// keeps an online softmax, so nothing is copied and nothing is masked. The G query heads that share
// a KV head are done together, so each key and value row is read once per group.
//
// Shapes: query [S, H, D]; key_cache, value_cache [N, BS, KVH, W] (contiguous); block_tables [S, B]
// int32; seq_lens [S] int32 (context including the new token); out [S, H, D]. H = KVH * G.
// The cache may be stored in another dtype than the query (--kv-cache-dtype, kernels/kv_quant.py):
// float32 / bfloat16 / float16 rows of W = D, or 8-bit rows (int8, float8_e4m3fn) of W = D + 4: D
// codes, then the row's float32 scale in the last 4 bytes. Accumulation is float32 whatever the
// storage dtype; an 8-bit row's codes are multiplied by its scale as the row is widened.

// ATen's tensor and parallel headers only, not <torch/extension.h> (torch's whole C++ frontend and pybind11):
// 3 s of compiling instead of 37 per file (measured), which is most of a cold start's kernel build.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_math.h"

#if defined(__F16C__) && defined(__SSE4_1__)
#include <immintrin.h>
#define XINSERVE_F16C 1
#endif

namespace {

using namespace xinserve_attention;

// One stored element widened to float. The 16- and 8-bit conversions are written as branchless integer
// arithmetic on the bits (c10's conversions are scalar calls and table lookups), so the dot-product and
// value loops that call them still vectorise.
inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename cache_t>
struct Widen {
  inline float operator()(cache_t x) const { return static_cast<float>(x); }
};

template <>
struct Widen<at::BFloat16> {  // the high half of a float32
  inline float operator()(at::BFloat16 x) const { return from_bits(static_cast<uint32_t>(x.x) << 16); }
};

template <>
struct Widen<at::Half> {  // IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits
  inline float operator()(at::Half x) const {
    const uint32_t h = x.x, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    const float normal = from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
    const float special = from_bits(sign | 0x7F800000u | (mant << 13));  // inf / nan
    const float subnormal = static_cast<float>(mant) * 5.9604645e-8f;  // mant * 2^-24
    return exp == 0 ? (sign ? -subnormal : subnormal) : (exp == 31 ? special : normal);
  }
};

template <>
struct Widen<c10::Float8_e4m3fn> {  // 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf (the write clamps)
  inline float operator()(c10::Float8_e4m3fn x) const {
    const uint32_t b = x.x, sign = (b & 0x80u) << 24, exp = (b >> 3) & 0xFu, mant = b & 0x7u;
    const float normal = from_bits(sign | ((exp + 120u) << 23) | (mant << 20));
    const float subnormal = static_cast<float>(mant) * 1.953125e-3f;  // mant * 2^-9
    return exp == 0 ? (sign ? -subnormal : subnormal) : normal;
  }
};

// The row's scale: the 4 bytes after its D codes (8-bit caches), else 1.
template <typename cache_t, bool quantized>
inline float row_scale(const cache_t* row, int64_t head_dim) {
  if constexpr (!quantized) {
    return 1.0f;
  } else {
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return scale;
  }
}

#ifdef XINSERVE_F16C
// Eight stored values widened with the CPU's half-to-float instruction (F16C, on every AVX2 machine):
// cheaper than the bit arithmetic of Widen. An e4m3 code becomes the half with the same sign, exponent
// and mantissa bits moved up (s eeee mmm -> s 0eeee mmm0000000), whose value is the code's / 2^8 (the
// exponent biases differ by 8; subnormals map to subnormals; like Widen it has no NaN, which the write
// never stores); ``block_rows`` folds the 2^8 back into the row's scale.
inline __m256 widen8(const at::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

inline __m256 widen8(const c10::Float8_e4m3fn* x) {
  int64_t bytes;
  std::memcpy(&bytes, x, sizeof(bytes));
  const __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(bytes));  // 8 x uint16
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

template <typename cache_t>
constexpr bool kHasWiden8 = std::is_same_v<cache_t, at::Half> || std::is_same_v<cache_t, c10::Float8_e4m3fn>;
#else
template <typename cache_t>
constexpr bool kHasWiden8 = false;
#endif

// A block's K or V rows of one KV head as floats, [tokens, D] at the returned stride. Float32 rows are
// read where they lie (stride: one token of the block, all KV heads); any other dtype is widened once
// into ``tile`` (stride D), 8-bit codes multiplied by their row's scale, then shared by the G query heads.
template <typename cache_t, bool quantized>
inline const float* block_rows(const cache_t* first, int64_t tokens, int64_t row_stride, int64_t head_dim,
                               const Widen<cache_t>& widen, float* tile, int64_t& stride) {
  if constexpr (std::is_same_v<cache_t, float>) {
    stride = row_stride;
    return first;
  } else {
    for (int64_t t = 0; t < tokens; ++t) {
      const cache_t* row = first + t * row_stride;
      const float scale = row_scale<cache_t, quantized>(row, head_dim);
      float* dst = tile + t * head_dim;
      int64_t d = 0;
#ifdef XINSERVE_F16C
      if constexpr (kHasWiden8<cache_t>) {
        const float factor = std::is_same_v<cache_t, at::Half> ? scale : scale * 256.0f;
        const __m256 s = _mm256_set1_ps(factor);
        for (; d + 8 <= head_dim; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(widen8(row + d), s));
      }
#endif
      for (; d < head_dim; ++d) dst[d] = widen(row[d]) * scale;
    }
    stride = head_dim;
    return tile;
  }
}

// How many blocks ahead of the one being computed the next blocks' rows are asked for. Block tables
// scatter blocks over the pool, so the hardware prefetcher cannot guess the next block; a single
// memory stream of one core keeps only a few lines in flight, so the fetch is started ahead.
constexpr int64_t kPrefetchBlocks = 2;  // for items of some of the KV heads (Ahead below for the others)

// Asks for every 64-byte line of a block's rows of the KV heads an item reads: ``span`` elements from
// ``first`` on each of ``tokens`` rows ``row_stride`` apart (one contiguous range when the item reads
// all KV heads: a block's tokens for every head lie side by side).
template <typename cache_t>
inline void prefetch_block(const cache_t* first, int64_t tokens, int64_t row_stride, int64_t span) {
  const char* start = reinterpret_cast<const char*>(first);
  const int64_t item = static_cast<int64_t>(sizeof(cache_t));
  if (span == row_stride) {
    const int64_t bytes = tokens * row_stride * item;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
    return;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const char* row = start + t * row_stride * item;
    for (int64_t offset = 0; offset < span * item; offset += 64) __builtin_prefetch(row + offset);
  }
}

// The next block's K and V runs (an item of every KV head: each one contiguous range), asked for a few lines
// at a time between the pieces of arithmetic of the block being computed, rather than all at once before it:
// a burst of a block's 256 prefetches waits for free miss buffers, and the arithmetic with it (measured on the
// 2-core AVX2 EPYC, one layer of 32 x 512 contexts, float32: 7.2-8.1 -> 9.2-9.9 GB/s where a sum reads 12).
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, done = 0, lines_per_piece = 0;
  // ``lines`` more lines (K's run, then V's)
  inline void step(int64_t lines) {
    for (; lines > 0 && done < 2 * bytes; --lines, done += 64) {
      __builtin_prefetch(done < bytes ? k + done : v + done - bytes);
    }
  }
  inline void piece() { step(lines_per_piece); }
  inline void finish() { step(2 * bytes); }
};

// Scratch of one thread, reused over its items. Shapes in floats, for the item's KV heads (up to KVH):
// qf [KVH, G, D] scaled queries; acc [KVH, G, D] unnormalised outputs; running_max, running_sum [KVH, G];
// scores [G, BS] one block's logits of one KV head, then weights; k_tile and v_tile [BS, D] a block's
// widened rows of one KV head (unused for a float32 cache).
struct Scratch {
  std::vector<float> qf, acc, scores, k_tile, v_tile, running_max, running_sum;
  Scratch(int64_t heads, int64_t group, int64_t head_dim, int64_t block_size)
      : qf(heads * group * head_dim), acc(heads * group * head_dim), scores(group * block_size),
        k_tile(block_size * head_dim), v_tile(block_size * head_dim), running_max(heads * group),
        running_sum(heads * group) {}
};

// One online-softmax update of the G query heads sharing one KV head, over one block's ``tokens`` rows
// (``k_first`` / ``v_first``: the block's first row of that head). qf, acc [G, D]; running_max,
// running_sum [G]: that KV head's slices of the scratch.
template <typename cache_t, bool quantized, int64_t kFixedDim>
inline void attend_block(const cache_t* k_first, const cache_t* v_first, int64_t tokens, int64_t row_stride,
                         int64_t group, int64_t head_dim, int64_t block_size, const float* qf, float* acc,
                         float* running_max, float* running_sum, Scratch& w, Ahead& ahead) {
  const int64_t dim = kFixedDim ? kFixedDim : head_dim;
  const Widen<cache_t> widen;
  int64_t k_stride, v_stride;
  const float* k = block_rows<cache_t, quantized>(k_first, tokens, row_stride, dim, widen, w.k_tile.data(), k_stride);
  for (int64_t g = 0; g < group; ++g) {
    ahead.piece();
    scores<kFixedDim>(qf + g * dim, k, k_stride, tokens, dim, w.scores.data() + g * block_size);
  }
  // Per query head: the block's max, the rescale of what came before (only when the max grew: after the
  // first blocks it seldom does), the block's weights.
  for (int64_t g = 0; g < group; ++g) {
    float* s = w.scores.data() + g * block_size;
    const float block_max = *std::max_element(s, s + tokens);
    const float new_max = std::max(running_max[g], block_max);
    float rescale = 1.0f;
    if (new_max > running_max[g]) {
      rescale = std::exp(running_max[g] - new_max);  // exp(-inf) = 0 on the first block
      float* a = acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < tokens; ++t) {
      s[t] = fast_exp(s[t] - new_max);
      sum += s[t];
    }
    running_sum[g] = running_sum[g] * rescale + sum;
    running_max[g] = new_max;
  }
  const float* v = block_rows<cache_t, quantized>(v_first, tokens, row_stride, dim, widen, w.v_tile.data(), v_stride);
  for (int64_t g = 0; g < group; ++g) {
    ahead.piece();
    weighted_sum(acc + g * dim, w.scores.data() + g * block_size, v, v_stride, tokens, dim);
  }
}

// One item: a sequence's KV heads [first_head, first_head + heads), walked block by block together, so
// a block's K and V rows of those heads (side by side in the pool) are read in one pass, and the blocks
// ahead are fetched meanwhile (Ahead, or kPrefetchBlocks ahead). Each head's arithmetic is the same
// whichever heads share its item (the results do not depend on the thread count). kFixedDim is D when it
// is a common size (loops of known length unroll fully), else 0.
template <typename cache_t, bool quantized, int64_t kFixedDim>
void decode_item(const int32_t* table, int64_t seq_len, const cache_t* key_cache, const cache_t* value_cache,
                 int64_t first_head, int64_t heads, int64_t group, int64_t head_dim, int64_t width,
                 int64_t block_size, int64_t num_kv_heads, Scratch& w) {
  const int64_t dim = kFixedDim ? kFixedDim : head_dim;
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  std::fill(w.running_max.begin(), w.running_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.running_sum.begin(), w.running_sum.end(), 0.0f);
  const int64_t row_stride = num_kv_heads * width;  // one token of one block, all KV heads
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  auto base = [&](int64_t b) { return static_cast<int64_t>(table[b]) * block_size * row_stride + first_head * width; };
  auto tokens_of = [&](int64_t b) { return std::min(block_size, seq_len - b * block_size); };
  auto prefetch = [&](int64_t b) {
    const int64_t span = heads == num_kv_heads ? row_stride : heads * width;
    prefetch_block(key_cache + base(b), tokens_of(b), row_stride, span);
    prefetch_block(value_cache + base(b), tokens_of(b), row_stride, span);
  };
  // An item of every KV head asks for the next block while computing this one, spread over the block's
  // pieces of arithmetic (Ahead); one of some heads reads rows in parts, asked for kPrefetchBlocks ahead at once.
  const bool whole_rows = heads == num_kv_heads;
  const int64_t distance = whole_rows ? 1 : kPrefetchBlocks;
  const int64_t pieces = 2 * heads * group;  // per block: each query head's logits, then its weighted values
  for (int64_t b = 0; b < std::min(distance, num_blocks); ++b) prefetch(b);
  Ahead ahead;
  for (int64_t b = 0; b < num_blocks; ++b) {
    ahead.finish();
    ahead = Ahead{};
    if (b + distance < num_blocks) {
      if (whole_rows) {
        const int64_t next = base(b + distance);
        const int64_t bytes = tokens_of(b + distance) * row_stride * static_cast<int64_t>(sizeof(cache_t));
        ahead = Ahead{reinterpret_cast<const char*>(key_cache + next), reinterpret_cast<const char*>(value_cache + next),
                      bytes, 0, (2 * bytes / 64 + pieces) / pieces};
      } else {
        prefetch(b + distance);
      }
    }
    const int64_t at = base(b), tokens = tokens_of(b);
    for (int64_t h = 0; h < heads; ++h) {
      attend_block<cache_t, quantized, kFixedDim>(key_cache + at + h * width, value_cache + at + h * width, tokens,
                                                  row_stride, group, head_dim, block_size, w.qf.data() + h * group * dim,
                                                  w.acc.data() + h * group * dim, w.running_max.data() + h * group,
                                                  w.running_sum.data() + h * group, w, ahead);
    }
  }
}

template <typename scalar_t, typename cache_t, bool quantized, int64_t kFixedDim>
void run(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& tables, const at::Tensor& lens, float scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2), width = key_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = static_cast<const cache_t*>(key_cache.data_ptr());
  const cache_t* v_ptr = static_cast<const cache_t*>(value_cache.data_ptr());
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  // An item is a sequence with all its KV heads; when there are fewer sequences than threads, a
  // (sequence, KV head) pair, so a lone sequence still uses every thread. Items are split into one
  // contiguous range per thread holding about the same number of context tokens (sequences differ in
  // length; an equal count of items would not balance).
  const int64_t threads = at::get_num_threads();
  const int64_t heads = num_seqs >= threads ? num_kv_heads : 1;  // KV heads per item
  const int64_t per_seq = num_kv_heads / heads;
  const int64_t items = num_seqs * per_seq;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  std::vector<int64_t> bounds(parts + 1, items);
  bounds[0] = 0;
  if (parts > 1) {
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total += len_ptr[s];
    total *= per_seq;
    int64_t seen = 0, part = 1;
    for (int64_t i = 0; i < items && part < parts; ++i) {
      seen += len_ptr[i / per_seq];
      while (part < parts && seen * parts >= total * part) bounds[part++] = i + 1;
    }
  }
  at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
    Scratch w(heads, group, head_dim, block_size);
    for (int64_t i = bounds[first_part]; i < bounds[last_part]; ++i) {
      const int64_t s = i / per_seq, first_head = (i % per_seq) * heads;
      const int64_t offset = (s * num_heads + first_head * group) * head_dim;  // the item's first query head
      const int64_t count = heads * group * head_dim;
      for (int64_t j = 0; j < count; ++j) w.qf[j] = static_cast<float>(q_ptr[offset + j]) * scale;
      decode_item<cache_t, quantized, kFixedDim>(table_ptr + s * table_width, len_ptr[s], k_ptr, v_ptr, first_head,
                                                 heads, group, head_dim, width, block_size, num_kv_heads, w);
      for (int64_t r = 0; r < heads * group; ++r) {
        const float inv = 1.0f / w.running_sum[r];
        for (int64_t d = 0; d < head_dim; ++d) {
          out_ptr[offset + r * head_dim + d] = static_cast<scalar_t>(w.acc[r * head_dim + d] * inv);
        }
      }
    }
  });
}

template <typename scalar_t, typename cache_t, bool quantized>
void run_dim(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& tables, const at::Tensor& lens, float scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: run<scalar_t, cache_t, quantized, 64>(q, key_cache, value_cache, tables, lens, scale, out); break;
    case 128: run<scalar_t, cache_t, quantized, 128>(q, key_cache, value_cache, tables, lens, scale, out); break;
    default: run<scalar_t, cache_t, quantized, 0>(q, key_cache, value_cache, tables, lens, scale, out);
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, H, D] and cache [N, BS, KVH, W] expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the paged cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches differ in dtype");
  auto q = query.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = key_cache.size(2);
  const auto kind = key_cache.scalar_type();
  const bool quantized = kind == at::kChar || kind == at::kFloat8_e4m3fn;
  TORCH_CHECK(num_heads % num_kv_heads == 0 && key_cache.size(3) == head_dim + (quantized ? 4 : 0),
              "head shapes do not match");
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (kind) {
      case at::kFloat: run_dim<scalar_t, float, false>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kBFloat16: run_dim<scalar_t, at::BFloat16, false>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kHalf: run_dim<scalar_t, at::Half, false>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kChar: run_dim<scalar_t, int8_t, true>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kFloat8_e4m3fn:
        run_dim<scalar_t, c10::Float8_e4m3fn, true>(q, key_cache, value_cache, tables, lens, s, out);
        break;
      default: TORCH_CHECK(false, "unsupported KV cache dtype ", kind);
    }
  });
  return out;
}
