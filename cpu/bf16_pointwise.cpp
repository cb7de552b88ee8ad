// torch.ops.duet_cpu.rms_norm_bf16 and rope_bf16_: a bf16 layer's row-wise steps in one call each,
// rounding where transformers' bf16 Llama rounds (each of its torch ops rounds its result to
// bfloat16), so that a step of a few rows is not a dozen operator dispatches.
//
//   rms_norm_bf16(x [T, D] bf16, weight [D] bf16, eps, out [T, D] bf16):
//     h = float(x); h *= rsqrt(mean(h * h) + eps) (float32); out = bf16(weight * bf16(h)); the
//     squares are summed in float64, so the mean is float32's nearest whatever the order (summed
//     in float32 in another order than torch's, teacher-forced agreement with fp32 lost 2 of 192)
//   rope_bf16_(qkv [T, W] bf16, positions [T] int64, cos [P, d] bf16, sin [P, d] bf16, heads):
//     in place on the first `heads` heads of width d of every row (the query and key heads of a
//     fused QKV row): x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) =
//     [-x[d/2:], x[:d/2]]
// Rows are independent: a row's result never depends on its batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// bfloat16 bits of `v` rounded to nearest even, NaN to the quiet NaN: c10::BFloat16's rounding,
// on integers, so that a loop of it vectorizes (c10's conversion stays one scalar call per value:
// 0.5-0.9 billion values a second here, a fifth of a 1000-token bf16 prefill).
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return v != v ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

inline float from_bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float round_bf16(float v) { return from_bits(bf16_bits(v)); }

inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<bf16>()); }

void check_bf16(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == dim, name,
              " must be a contiguous ", dim, "-D bfloat16 CPU tensor");
}

void rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_bf16(x, 2, "x");
  check_bf16(weight, 1, "weight");
  check_bf16(out, 2, "out");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.size(0) == D && out.sizes() == x.sizes(), "x, weight and out shapes differ");
  const uint16_t* xp = bits(x);
  const uint16_t* wp = bits(weight);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>());
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* row = xp + t * D;
      double squares = 0.;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < D; ++d) squares += static_cast<double>(from_bits(row[d]) * from_bits(row[d]));
      const float mean = static_cast<float>(squares / static_cast<double>(D));
      const float scale = 1.f / std::sqrt(mean + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < D; ++d)
        op[t * D + d] = bf16_bits(from_bits(wp[d]) * round_bf16(from_bits(row[d]) * scale));
    }
  });
}

void rope_bf16_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                int64_t heads) {
  check_bf16(qkv, 2, "qkv");
  check_bf16(cos, 2, "cos");
  check_bf16(sin, 2, "sin");
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "positions must be [T] int64");
  const int64_t T = qkv.size(0), d = cos.size(1), half = d / 2, P = cos.size(0), width = qkv.size(1);
  TORCH_CHECK(sin.sizes() == cos.sizes() && d % 2 == 0 && heads * d <= width, "bad rope shapes");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " out of range");
  auto* base = reinterpret_cast<uint16_t*>(qkv.data_ptr<bf16>());
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> x(d);
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* c = bits(cos) + pos[t] * d;
      const uint16_t* s = bits(sin) + pos[t] * d;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* row = base + t * width + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) x[i] = from_bits(row[i]);
        // rotate_half(x) is -x[half + i] in the first half, x[i - half] in the second
#pragma omp simd
        for (int64_t i = 0; i < half; ++i)
          row[i] = bf16_bits(round_bf16(x[i] * from_bits(c[i])) + round_bf16(-x[i + half] * from_bits(s[i])));
#pragma omp simd
        for (int64_t i = half; i < d; ++i)
          row[i] = bf16_bits(round_bf16(x[i] * from_bits(c[i])) + round_bf16(x[i - half] * from_bits(s[i])));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duet_cpu, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("rope_bf16_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(duet_cpu, CPU, m) {
  m.impl("rms_norm_bf16", rms_norm_bf16);
  m.impl("rope_bf16_", rope_bf16_);
}
