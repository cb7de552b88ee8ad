// torch.ops.duet_cpu.gguf_linear: y = x @ W.T (+ bias) with W kept in a GGUF file's own blocks
// (llama.cpp's ggml-common.h layouts), so a decode step reads 4.5-8.5 bits per weight, not 32.
//
// Shapes (checked here; common/model/gguf_weight.py holds W and calls it):
//   x     [M, K] float32, contiguous, K a multiple of the block's weights
//   w     [N, K / block weights * block bytes] uint8: each row of W its blocks, as the file stores them
//   kind  0: Q4_0 (32 weights: fp16 d, 16 bytes of nibbles; w = d * (q - 8))
//         1: Q4_1 (32 weights: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m)
//         2: Q8_0 (32 weights: fp16 d, 32 int8; w = d * q)
//         nibbles: value j of a block is the low nibble of byte j, value j + 16 its high nibble
//         3: Q4_K (256 weights: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128
//            bytes of nibbles; w = (d * scale) * q - dmin * min per 32 weights)
//         4: Q6_K (256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales,
//            fp16 d; w = (d * scale) * (q - 32) per 16 weights)
//   bias  [N] float32, or an empty tensor
//   out   [M, N] float32, contiguous
//
// Each weight is rebuilt to the bits common/model/gguf_dequant.py gives it (gguf's own numpy
// dequantization for the K types): the same float32 operations in the same order (d * q is exact:
// an fp16 times an integer of at most 8 bits; what rounds, rounds once, as there).
// Every output is 8 float32 lanes, lane l summing x[k] * w[k] for k = l (mod 8), k ascending, by
// fused multiply-adds, then the lanes added in one fixed order: so a row of `out` depends only on
// that row of x, never on its batch or on how outputs are split between threads (a prompt's last
// token computed inside a chunk and alone rounds alike). The AVX2 path and the portable one below
// run that same arithmetic and give the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DUET_GGUF_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRows = 2, kColumns = 4;  // a register block: 8 accumulators, 4 weight vectors, 1 of x
enum Kind : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ6_K = 4 };

int64_t block_bytes(int64_t kind) {
  constexpr int64_t bytes[] = {18, 20, 34, 144, 210};
  return bytes[kind];
}
int64_t block_weights(int64_t kind) { return kind >= kQ4_K ? 256 : kBlock; }

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A block's 32 weights as float32, in k order.
void rebuild(const uint8_t* b, int64_t kind, float* w) {
  const float d = half_at(b);
  if (kind == kQ8_0) {
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
    return;
  }
  const uint8_t* qs = b + (kind == kQ4_1 ? 4 : 2);
  const float m = kind == kQ4_1 ? half_at(b + 2) : 0.0f;
  for (int j = 0; j < 16; ++j) {
    const float lo = static_cast<float>(qs[j] & 0x0F), hi = static_cast<float>(qs[j] >> 4);
    w[j] = kind == kQ4_1 ? std::fma(d, lo, m) : (lo - 8.0f) * d;
    w[j + 16] = kind == kQ4_1 ? std::fma(d, hi, m) : (hi - 8.0f) * d;
  }
}

// A Q4_K block's 256 weights (gguf's Q4_K.get_scale_min unpacks the scales alike).
void rebuild_q4_k(const uint8_t* b, float* w) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    const float dsc = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
    const uint8_t* q = b + 16 + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) w[32 * j + i] = dsc * static_cast<float>((q[i] >> shift) & 15) - dm;
  }
}

// A Q6_K block's 256 weights: value v is in half h = v / 128; its low 4 bits are nibble (u / 64)
// of ql byte 64h + u % 64 and its high 2 bits pair (u / 32) of qh byte 32h + u % 32 (u = v % 128).
void rebuild_q6_k(const uint8_t* b, float* w) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int v = 0; v < 256; v += 32) {
    const int h = v / 128, u = v % 128;
    const uint8_t* lo = b + 64 * h + u % 64;
    const uint8_t* hi = b + 128 + 32 * h;
    const int lo_shift = 4 * (u / 64), hi_shift = 2 * (u / 32);
    for (int g = 0; g < 32; g += 16) {  // a scale per 16 weights
      const float dsc = d * static_cast<float>(scales[(v + g) / 16]);
      for (int i = g; i < g + 16; ++i) {
        const int q = (((lo[i] >> lo_shift) & 15) | (((hi[i] >> hi_shift) & 3) << 4)) - 32;
        w[v + i] = dsc * static_cast<float>(q);
      }
    }
  }
}

// The 8 lanes added in the one order both paths use.
float lanes_sum(const float* s) { return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])); }

#ifdef DUET_GGUF_AVX2
inline void rebuild_avx2(const uint8_t* b, int64_t kind, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  if (kind == kQ8_0) {
    for (int v = 0; v < 4; ++v) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v));
      w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    return;
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kind == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const __m256 m = _mm256_set1_ps(kind == kQ4_1 ? half_at(b + 2) : 0.0f), eight = _mm256_set1_ps(8.0f);
  for (int v = 0; v < 4; ++v) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[v]));
    w[v] = kind == kQ4_1 ? _mm256_fmadd_ps(d, q, m) : _mm256_mul_ps(_mm256_sub_ps(q, eight), d);
  }
}
#endif

#ifdef DUET_GGUF_AVX2
// 16 bytes as 16 float32 values, stored at w (signed: int8; else uint8).
template <bool Signed>
inline void store_bytes(__m128i bytes, __m256 scale, __m256 minus, float* w) {
  for (int half = 0; half < 2; ++half) {
    const __m128i b = half ? _mm_srli_si128(bytes, 8) : bytes;
    const __m256 q = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
    _mm256_storeu_ps(w + 8 * half, _mm256_fmsub_ps(scale, q, minus));  // scale * q exact: one rounding
  }
}

void rebuild_q4_k_avx2(const uint8_t* b, float* w) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    const __m256 dsc = _mm256_set1_ps(d * static_cast<float>(sc)), dm = _mm256_set1_ps(dmin * static_cast<float>(mn));
    for (int h = 0; h < 2; ++h) {
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 32 * (j / 2) + 16 * h));
      if (j % 2) q = _mm_srli_epi16(q, 4);
      store_bytes<false>(_mm_and_si128(q, mask), dsc, dm, w + 32 * j + 16 * h);
    }
  }
}

void rebuild_q6_k_avx2(const uint8_t* b, float* w) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  const __m128i low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03), bias = _mm_set1_epi8(32);
  const __m256 zero = _mm256_setzero_ps();
  for (int v = 0; v < 256; v += 16) {
    const int h = v / 128, u = v % 128;
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 * h + u % 64));
    __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * h + u % 32));
    if (u >= 64) lo = _mm_srli_epi16(lo, 4);
    hi = _mm_srl_epi16(hi, _mm_cvtsi32_si128(2 * (u / 32)));
    const __m128i q = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(lo, low4), _mm_slli_epi16(_mm_and_si128(hi, low2), 4)), bias);
    store_bytes<true>(q, _mm256_set1_ps(d * static_cast<float>(scales[v / 16])), zero, w + v);
  }
}
#endif

// Weight row n rebuilt into `w` (K floats): read from memory and rebuilt once, whatever M is.
void rebuild_row(const uint8_t* wn, int64_t K, int64_t kind, float* w) {
  const int64_t bytes = block_bytes(kind);
  if (kind >= kQ4_K) {
#ifdef DUET_GGUF_AVX2
    const auto rebuild_k = kind == kQ4_K ? rebuild_q4_k_avx2 : rebuild_q6_k_avx2;
#else
    const auto rebuild_k = kind == kQ4_K ? rebuild_q4_k : rebuild_q6_k;
#endif
    for (int64_t blk = 0; blk < K / 256; ++blk) rebuild_k(wn + blk * bytes, w + blk * 256);
    return;
  }
  for (int64_t blk = 0; blk < K / kBlock; ++blk) {
#ifdef DUET_GGUF_AVX2
    __m256 wv[4];
    rebuild_avx2(wn + blk * bytes, kind, wv);
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(w + blk * kBlock + 8 * v, wv[v]);
#else
    rebuild(wn + blk * bytes, kind, w + blk * kBlock);
#endif
  }
}

// out[r][c] for R rows of x against C rebuilt weight rows (`w`, C x K floats): each weight
// vector loaded once for the R rows, each x vector once for the C columns.
template <int R, int C>
void dot_block(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t N) {
  float sums[R][C][8];
#ifdef DUET_GGUF_AVX2
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(sums[r][c], acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int l = 0; l < 8; ++l) sums[r][c][l] = 0.0f;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c][k % 8] = std::fma(x[r * K + k], w[c * K + k], sums[r][c][k % 8]);
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = lanes_sum(sums[r][c]) + (bias != nullptr ? bias[c] : 0.0f);
}

// Every row of x against C weight rows.
template <int C>
void dot_columns(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* out, int64_t N) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) dot_block<kRows, C>(x + r * K, K, w, bias, out + r * N, N);
  for (; r < M; ++r) dot_block<1, C>(x + r * K, K, w, bias, out + r * N, N);
}

void gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, const at::Tensor& bias, at::Tensor& out) {
  TORCH_CHECK(kind >= kQ4_0 && kind <= kQ6_K, "gguf_linear: unknown block kind ", kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "gguf_linear: x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % block_weights(kind) == 0, "gguf_linear: K must be a multiple of the block's weights");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) == K / block_weights(kind) * block_bytes(kind),
              "gguf_linear: w must be [N, K / block weights * block bytes] uint8");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "gguf_linear: bias must be empty or [N] float32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "gguf_linear: out must be [M, N] float32");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> rebuilt(kColumns * K);  // the weight rows of one pass, as float32
    int64_t n = n0;
    for (; n + kColumns <= n1; n += kColumns) {
      for (int64_t c = 0; c < kColumns; ++c) rebuild_row(wp + (n + c) * row_bytes, K, kind, rebuilt.data() + c * K);
      dot_columns<kColumns>(xp, M, K, rebuilt.data(), bp != nullptr ? bp + n : nullptr, op + n, N);
    }
    for (; n < n1; ++n) {
      rebuild_row(wp + n * row_bytes, K, kind, rebuilt.data());
      dot_columns<1>(xp, M, K, rebuilt.data(), bp != nullptr ? bp + n : nullptr, op + n, N);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duet_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int kind, Tensor bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(duet_cpu, CPU, m) { m.impl("gguf_linear", gguf_linear); }
