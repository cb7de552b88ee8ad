// torch.ops.duet_cpu.bf16_linear: y = x @ W.T (+ bias) in bfloat16 with float32 sums, at the
// speed of reading W once for a decode step's few rows, and on AMX's tiles for a prefill chunk.
//
// Shapes (checked here; common/model/packed_linear.py packs W and calls it):
//   x     [M, K] bfloat16, contiguous
//   w     [N / 64, K / 2, 64, 2] bfloat16: W [N, K] in groups of 64 output columns, each group
//         one contiguous stream of k-pairs (`pack_bf16_linear` in cpu/extension.py)
//   bias  [N] float32, or an empty tensor
//   out   [M, N] bfloat16, contiguous
//   amx   take the AMX path (needs bf16_linear_amx_available() and K % 32 == 0)
//
// Two instruction paths read that one layout; each gives a row of `out` that depends only on
// that row of x, never on the other rows of its batch or on how columns are split between
// threads, so a prompt's token computed inside a chunk and alone rounds alike. Their sums are
// not each other's bits, so the caller takes one path for every call of a layer.
// - AVX512-BF16: every output is one float32 accumulator that `vdpbf16ps` advances by one k-pair
//   at a time, k ascending, then rounded once to bfloat16.
// - AMX: 16 rows x 64 columns at a time in four float32 C tiles, `tdpbf16ps` over 32 k at a
//   time, k ascending; B tiles are 16 k-pairs x 16 columns of the same packed stream (row stride
//   256 bytes). A block of fewer than 16 rows configures its tiles to its row count, so no row
//   is read or written past x and out. Each thread loads its tile configuration when it starts
//   and releases the tiles when done: nothing is assumed about the tile state between calls.
// Where AVX512-BF16 is missing the operator is not registered and callers use oneDNN.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>

#include "amx_tiles.h"

namespace {

constexpr int64_t kGroup = 64;  // output columns per packed group: 4 vectors of 16 lanes
constexpr int64_t kVectors = kGroup / 16;
constexpr int64_t kRows = 6;  // rows per register block: 6 x 4 accumulators, 4 weights, 1 input

// 16 float32 sums (+ bias), rounded once to bfloat16.
inline void store_row(__m512 y, const float* bias, uint16_t* out) {
  if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(y));
}

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
    for (int64_t v = 0; v < kVectors; ++v) store_row(acc[r][v], bias ? bias + v * 16 : nullptr, out + r * N + v * 16);
}

template <int64_t R>
inline void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, uint16_t* out,
                 int64_t N, int64_t m) {
  if constexpr (R > 1) {
    if (M - m < R) return rows<R - 1>(x, M, K, w, bias, out, N, m);
  }
  block<R>(x + m * K, K, w, bias, out + m * N, N);
}

void avx512_group(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wg, const float* bias, uint16_t* out,
                  int64_t N) {
  for (int64_t m = 0; m < M; m += kRows) rows<kRows>(x, M, K, wg, bias, out, N, m);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;  // bf16 values of a row of x per A tile (64 bytes)

// Tiles 0-3: C, rows x 16 float32 columns; 4: A, rows x 32 bf16 of x; 5-7: B, 16 k-pairs x 16 columns.
duet_amx::TileConfig tile_config(int64_t rows) {
  duet_amx::TileConfig config;
  for (int t = 0; t < 5; ++t) config.set(t, rows, 64);
  for (int t = 5; t < 8; ++t) config.set(t, kTileRows, 64);
  return config;
}

bool amx_available() { return duet_amx::available(); }

// rows (<= 16) of x times one packed group, into out; the tiles are configured for `rows`.
void amx_block(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* wg, const float* bias, uint16_t* out,
               int64_t N) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t x_stride = K * 2, w_stride = kGroup * 2 * 2;  // bytes
  for (int64_t k = 0; k < K; k += kTileK) {
    const uint16_t* wk = wg + (k / 2) * kGroup * 2;
    _tile_loadd(4, x + k, x_stride);
    _tile_loadd(5, wk + 0 * 32, w_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + 1 * 32, w_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wk + 2 * 32, w_stride);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wk + 3 * 32, w_stride);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float sums[kVectors][kTileRows][16];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t v = 0; v < kVectors; ++v)
      store_row(_mm512_load_ps(sums[v][r]), bias ? bias + v * 16 : nullptr, out + r * N + v * 16);
}

void amx_groups(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, uint16_t* out,
                int64_t N, int64_t g0, int64_t g1) {
  const int64_t full_rows = M - M % kTileRows;
  if (full_rows > 0) {
    const duet_amx::TileConfig full = tile_config(kTileRows);
    _tile_loadconfig(&full);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < full_rows; m += kTileRows)
        amx_block(x + m * K, kTileRows, K, w + g * K * kGroup, bias ? bias + g * kGroup : nullptr,
                  out + m * N + g * kGroup, N);
  }
  if (full_rows < M) {
    const duet_amx::TileConfig tail = tile_config(M - full_rows);
    _tile_loadconfig(&tail);
    for (int64_t g = g0; g < g1; ++g)
      amx_block(x + full_rows * K, M - full_rows, K, w + g * K * kGroup, bias ? bias + g * kGroup : nullptr,
                out + full_rows * N + g * kGroup, N);
  }
  _tile_release();
}

#else
bool amx_available() { return false; }
#endif

void bf16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out, bool amx) {
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
  TORCH_CHECK(!amx || (amx_available() && K % 32 == 0), "the AMX path needs AMX and K a multiple of 32");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, w.size(0), 1, [&](int64_t g0, int64_t g1) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx) return amx_groups(xp, M, K, wp, bp, op, N, g0, g1);
#endif
    for (int64_t g = g0; g < g1; ++g)
      avx512_group(xp, M, K, wp + g * K * kGroup, bp ? bp + g * kGroup : nullptr, op + g * kGroup, N);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duet_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor bias, Tensor(a!) out, bool amx) -> ()");
  m.def("bf16_linear_amx_available() -> bool");
}

TORCH_LIBRARY_IMPL(duet_cpu, CPU, m) { m.impl("bf16_linear", bf16_linear); }

TORCH_LIBRARY_IMPL(duet_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_linear_amx_available", amx_available);
}

#endif  // __AVX512BF16__
