// The KV cache write on the CPU: this step's keys and values stored into their slots of the paged
// cache, in place, in the cache's dtype (kernels/kv_quant.py's layout), with the same bits as the
// reference (kernels/reference.py::write_kv: quantize, then index_copy_).
//
// The reference costs a quantize call (a dtype conversion even when there is nothing to convert), a
// view and an index_copy_ per K and V, each a dispatch through torch; here one loop copies (or
// converts) each token's KVH rows straight into its slot.
//
// Shapes: key, value [T, KVH, D] (any row strides, D contiguous); key_cache, value_cache [N, BS, KVH, W]
// (contiguous; W = D, or D + 4 for the 8-bit kinds: D codes, then the float32 scale's 4 bytes);
// slot_mapping [T] int64, slot = block * BS + offset.

// ATen's tensor and parallel headers only, not <torch/extension.h> (torch's whole C++ frontend and pybind11):
// 3 s of compiling instead of 37 per file (measured), which is most of a cold start's kernel build.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace {

// One head row of D values into the cache's dtype. Conversions use c10's (round to nearest even), as
// ``Tensor.to`` does; the 8-bit kinds follow kv_quant.quantize step by step in float32: scale =
// absmax / code max (1 for an all-zero row), code = x / scale, rounded half to even and clamped to
// +-127 for int8, converted for e4m3; the scale's bytes after the codes.
template <typename in_t, typename cache_t>
inline void store_row(const in_t* x, cache_t* row, int64_t head_dim) {
  if constexpr (std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, c10::Float8_e4m3fn>) {
    constexpr float code_max = std::is_same_v<cache_t, int8_t> ? 127.0f : 448.0f;
    float absmax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::fabs(static_cast<float>(x[d])));
    const float scale = absmax > 0.0f ? absmax / code_max : 1.0f;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float scaled = static_cast<float>(x[d]) / scale;
      if constexpr (std::is_same_v<cache_t, int8_t>) {
        row[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(scaled))));
      } else {
        row[d] = c10::Float8_e4m3fn(scaled);
      }
    }
    std::memcpy(row + head_dim, &scale, sizeof(scale));
  } else if constexpr (std::is_same_v<in_t, cache_t>) {
    std::memcpy(row, x, head_dim * sizeof(cache_t));
  } else {
    for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<cache_t>(static_cast<float>(x[d]));
  }
}

template <typename in_t, typename cache_t>
void write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
           const at::Tensor& value_cache, const int64_t* slots) {
  const int64_t tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t width = key_cache.size(3), slot_stride = num_kv_heads * width;
  for (const auto* pair : {&key, &value}) {
    const at::Tensor& src = *pair;
    cache_t* cache = static_cast<cache_t*>((pair == &key ? key_cache : value_cache).data_ptr());
    const in_t* x = src.data_ptr<in_t>();
    const int64_t token_stride = src.stride(0), head_stride = src.stride(1);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        store_row(x + t * token_stride + h * head_stride, cache + slots[t] * slot_stride + h * width, head_dim);
      }
    }
  }
}

template <typename in_t>
void write_cache_kind(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const int64_t* slots) {
  switch (key_cache.scalar_type()) {
    case at::kFloat: write<in_t, float>(key, value, key_cache, value_cache, slots); break;
    case at::kBFloat16: write<in_t, at::BFloat16>(key, value, key_cache, value_cache, slots); break;
    case at::kHalf: write<in_t, at::Half>(key, value, key_cache, value_cache, slots); break;
    case at::kChar: write<in_t, int8_t>(key, value, key_cache, value_cache, slots); break;
    case at::kFloat8_e4m3fn: write<in_t, c10::Float8_e4m3fn>(key, value, key_cache, value_cache, slots); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", key_cache.scalar_type());
  }
}

// A row of D values: D elements one apart (any token and head strides).
at::Tensor rows(const at::Tensor& x) { return x.stride(2) == 1 ? x : x.contiguous(); }

}  // namespace

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4,
              "key, value [T, KVH, D] and cache [N, BS, KVH, W] expected");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value differ in dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes()
                  && key_cache.scalar_type() == value_cache.scalar_type(),
              "the paged caches must be contiguous and alike");
  const auto kind = key_cache.scalar_type();
  const bool quantized = kind == at::kChar || kind == at::kFloat8_e4m3fn;
  const int64_t head_dim = key.size(2);
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == head_dim + (quantized ? 4 : 0),
              "head shapes do not match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64 [T]");
  auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < slots.size(0); ++t) {  // as index_copy_ does: an out-of-range slot is an error
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < num_slots, "slot ", slot_ptr[t], " out of range [0, ", num_slots, ")");
  }
  const auto k = rows(key), v = rows(value);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    write_cache_kind<scalar_t>(k, v, key_cache, value_cache, slot_ptr);
  });
}
