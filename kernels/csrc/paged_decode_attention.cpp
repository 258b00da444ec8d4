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
// storage dtype; an 8-bit row's scale multiplies its dot product (keys) or its weight (values) once.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

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

// A stored K or V row as floats: float32 rows are read where they lie; any other dtype is widened once
// into ``buffer`` (then shared by the G query heads), in a plain loop the compiler vectorises.
template <typename cache_t>
inline const float* widened_row(const cache_t* row, int64_t head_dim, const Widen<cache_t>& widen, float* buffer) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = widen(row[d]);
    return buffer;
  }
}

template <typename scalar_t, typename cache_t, bool quantized>
void decode_group(const scalar_t* q, const cache_t* key_cache, const cache_t* value_cache,
                  const int32_t* table, int64_t seq_len, int64_t kv_head, int64_t group, int64_t head_dim,
                  int64_t width, int64_t block_size, int64_t num_kv_heads, float scale, scalar_t* out,
                  const Widen<cache_t>& widen, std::vector<float>& qf, std::vector<float>& acc,
                  std::vector<float>& scores, std::vector<float>& buffer) {
  // qf: [G, D] scaled queries; acc: [G, D] unnormalised output; scores: [G, BS] one block's logits;
  // buffer: [D] the current K or V row widened to float.
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  std::fill(acc.begin(), acc.end(), 0.0f);
  std::vector<float> running_max(group, -std::numeric_limits<float>::infinity());
  std::vector<float> running_sum(group, 0.0f);
  const int64_t row_stride = num_kv_heads * width;  // one token of one block, all KV heads
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t tokens = std::min(block_size, seq_len - b * block_size);
    const int64_t base = static_cast<int64_t>(table[b]) * block_size * row_stride + kv_head * width;
    for (int64_t t = 0; t < tokens; ++t) {
      const cache_t* k_row = key_cache + base + t * row_stride;
      const float k_scale = row_scale<cache_t, quantized>(k_row, head_dim);
      const float* k = widened_row(k_row, head_dim, widen, buffer.data());
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * head_dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
        scores[g * block_size + t] = dot * k_scale;
      }
    }
    // Per query head: the block's max, the rescale of what came before, the block's weights.
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores.data() + g * block_size;
      const float block_max = *std::max_element(s, s + tokens);
      const float new_max = std::max(running_max[g], block_max);
      const float rescale = std::exp(running_max[g] - new_max);  // exp(-inf) = 0 on the first block
      float* a = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale;
      running_sum[g] *= rescale;
      float sum = 0.0f;
      for (int64_t t = 0; t < tokens; ++t) {
        s[t] = fast_exp(s[t] - new_max);
        sum += s[t];
      }
      running_sum[g] += sum;
      running_max[g] = new_max;
    }
    // Each value row is read once for the whole group.
    for (int64_t t = 0; t < tokens; ++t) {
      const cache_t* v_row = value_cache + base + t * row_stride;
      const float v_scale = row_scale<cache_t, quantized>(v_row, head_dim);
      const float* v = widened_row(v_row, head_dim, widen, buffer.data());
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + t] * v_scale;
        float* a = acc.data() + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / running_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
  }
}

template <typename scalar_t, typename cache_t, bool quantized>
void run(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
         const torch::Tensor& tables, const torch::Tensor& lens, float scale, torch::Tensor& out) {
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
  const Widen<cache_t> widen;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores(group * block_size), buffer(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t offset = (s * num_heads + h * group) * head_dim;  // the group's first query head
      decode_group<scalar_t, cache_t, quantized>(q_ptr + offset, k_ptr, v_ptr, table_ptr + s * table_width,
                                                 len_ptr[s], h, group, head_dim, width, block_size, num_kv_heads,
                                                 scale, out_ptr + offset, widen, qf, acc, scores, buffer);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
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
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (kind) {
      case at::kFloat: run<scalar_t, float, false>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kBFloat16: run<scalar_t, at::BFloat16, false>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kHalf: run<scalar_t, at::Half, false>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kChar: run<scalar_t, int8_t, true>(q, key_cache, value_cache, tables, lens, s, out); break;
      case at::kFloat8_e4m3fn:
        run<scalar_t, c10::Float8_e4m3fn, true>(q, key_cache, value_cache, tables, lens, s, out);
        break;
      default: TORCH_CHECK(false, "unsupported KV cache dtype ", kind);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache, in place");
}
