// torch.ops.duet_cpu.bf16_linear: y = x @ W.T (+ bias) in bfloat16 with float32 sums, for the
// few rows of a decode step, at the speed of reading W once.
//
// Shapes (checked here; common/model/packed_linear.py packs W and calls it):
//   x     [M, K] bfloat16, contiguous
//   w     [N / 64, K / 2, 64, 2] bfloat16: W [N, K] in groups of 64 output columns, each group
//         one contiguous stream of k-pairs (`pack_bf16_linear` in packed_linear.py)
//   bias  [N] float32, or an empty tensor
//   out   [M, N] bfloat16, contiguous
//
// Every output is one float32 accumulator that `vdpbf16ps` advances by one k-pair at a time,
// k ascending, then rounded once to bfloat16: a row's result never depends on the other rows
// of its batch or on how the columns are split between threads. Where AVX512-BF16 is missing
// the operator is not registered and callers use oneDNN.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t kGroup = 64;  // output columns per packed group: 4 vectors of 16 lanes
constexpr int64_t kVectors = kGroup / 16;
constexpr int64_t kRows = 6;  // rows per register block: 6 x 4 accumulators, 4 weights, 1 input

template <int64_t R>
inline void block(const uint16_t* x, int64_t K, const uint16_t* w, const float* bias, uint16_t* out, int64_t N) {
  __m512 acc[R][kVectors];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    const uint16_t* wp = w + p * kGroup * 2;
    __m512bh wv[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wp + v * 32);
    for (int64_t r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVectors; ++v) {
      __m512 y = acc[r][v];
      if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + v * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + v * 16), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

template <int64_t R>
inline void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, uint16_t* out,
                 int64_t N, int64_t m) {
  if constexpr (R > 1) {
    if (M - m < R) return rows<R - 1>(x, M, K, w, bias, out, N, m);
  }
  block<R>(x + m * K, K, w, bias, out + m * N, N);
}

void bf16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous [M, K] bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) * 2 == K &&
                  w.size(2) == kGroup && w.size(3) == 2,
              "w must be packed [N / 64, K / 2, 64, 2] bfloat16");
  const int64_t N = w.size(0) * kGroup;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kBFloat16 &&
                  out.is_contiguous(),
              "out must be a contiguous [M, N] bfloat16 tensor");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias must be empty or [N] float32");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, w.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* wg = wp + g * K * kGroup;
      for (int64_t m = 0; m < M; m += kRows)
        rows<kRows>(xp, M, K, wg, bp ? bp + g * kGroup : nullptr, op + g * kGroup, N, m);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duet_cpu, m) { m.def("bf16_linear(Tensor x, Tensor w, Tensor bias, Tensor(a!) out) -> ()"); }

TORCH_LIBRARY_IMPL(duet_cpu, CPU, m) { m.impl("bf16_linear", bf16_linear); }

#endif  // __AVX512BF16__
