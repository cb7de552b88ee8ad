// torch.ops.duet_cpu.bf16_prefill_attention: causal attention of a prompt chunk's bfloat16 queries
// over its whole context, on AMX's tiles or with `vdpbf16ps`, for AVX512-BF16 CPUs.
//
// Shapes (checked here; common/model/paged_attention.py gathers the context and calls it):
//   q, out   [n, num_heads, HD] bfloat16, contiguous: the chunk's queries, the last n positions
//   k, v     [L, num_kv_heads, HD] bfloat16, contiguous: the context's keys and values, in
//            position order (L >= n); query i attends positions 0 .. L - n + i
//   amx      take the AMX path (needs bf16_linear_amx_available())
// Query head h reads KV head h / (num_heads / num_kv_heads), as transformers' repeat_kv does.
//
// Each query row walks the keys in blocks of 32 from position 0: scores in float32, online
// softmax over the block, the block's probabilities rounded to bfloat16 and summed with the
// values into float32. A row's result depends on nothing but its own query, its position and the
// context, never on the other rows of its chunk or on how the chunk was cut: a prompt prefilled
// in one piece or in several (a prefill node, a colocated node's chunks) gets the same bits. The
// two paths round differently, so a machine takes one for every call:
// - AVX512-BF16: 8 rows at a time; each score k-pair by k-pair (d ascending), the probabilities
//   summed with the values pair by pair into the row's running output.
// - AMX: 16 rows at a time (fewer in a chunk's last block: the tiles are configured to its row
//   count); a block's scores are C tiles of `tdpbf16ps` over 32 dims at a time, its
//   probabilities times the values one more product into fresh C tiles, added to the rescaled
//   running output. On Sapphire Rapids, 2.5-3x the AVX512-BF16 path at 1000 tokens.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int64_t kKeys = 32;  // keys per block: two vectors of 16 scores
constexpr int64_t kRows = 8;  // query rows per work item: 8 x 2 score accumulators in registers

// exp(x) for x <= 0 (a score minus its row's running max): 2^n * e^r with r in [-ln2/2, ln2/2]
// by a degree-6 Taylor polynomial, within 2 ulp of expf; x below -87 gives a denormal or 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);  // and the low part
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// One row's scores for the keys j0 .. j0 + 31 (s0, s1, before scaling) against its position:
// their probabilities under the row's running max (which moves), as bfloat16 into probs[32], and
// in `rescale` the factor for what the row summed before. False, and nothing changed, when the
// block starts after the row's position.
inline bool block_probs(__m512 s0, __m512 s1, int64_t pos, int64_t j0, float scale, float& max, float& sum,
                        float& rescale, uint16_t* probs) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Keys j0 + lane (+ 16) up to `pos` are attended; later ones, and padding, are not.
  const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(pos - j0));
  const __mmask16 in0 = _mm512_cmple_epi32_mask(lane, limit);
  const __mmask16 in1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit);
  if (!in0) return false;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 a = _mm512_mask_mul_ps(ninf, in0, s0, _mm512_set1_ps(scale));
  const __m512 b = _mm512_mask_mul_ps(ninf, in1, s1, _mm512_set1_ps(scale));
  const float m = std::max(max, _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
  const __m512 mv = _mm512_set1_ps(m);
  const __m512 pa = _mm512_maskz_mov_ps(in0, exp_nonpositive(_mm512_sub_ps(a, mv)));
  const __m512 pb = _mm512_maskz_mov_ps(in1, exp_nonpositive(_mm512_sub_ps(b, mv)));
  rescale = std::exp(max - m);  // 0 when nothing was attended before
  sum = sum * rescale + _mm512_reduce_add_ps(_mm512_add_ps(pa, pb));
  max = m;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs), (__m256i)_mm512_cvtneps_pbh(pa));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + 16), (__m256i)_mm512_cvtneps_pbh(pb));
  return true;
}

// Row r of out: acc / sum, rounded to bfloat16.
template <int64_t HD>
inline void store_row(const float* acc, float sum, uint16_t* out) {
  const __m512 inv = _mm512_set1_ps(1.f / sum);  // > 0: every row attends itself
  for (int64_t d = 0; d < HD; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + d), inv)));
}

// K of one KV head as [blocks][HD / 2][32 keys][2]: a block's k-pair p for 32 keys is one vector
// pair. V as [L / 2][HD][2]: the values of two consecutive keys, interleaved per dimension.
// Positions past L are zero (their scores are masked, their probabilities 0).
template <int64_t HD>
void pack(const uint16_t* k, const uint16_t* v, int64_t L, int64_t kv_heads, int64_t g, uint16_t* kp, uint16_t* vp) {
  const int64_t blocks = (L + kKeys - 1) / kKeys, row = kv_heads * HD;
  std::memset(kp, 0, blocks * kKeys * HD * sizeof(uint16_t));
  std::memset(vp, 0, blocks * kKeys * HD * sizeof(uint16_t));
  for (int64_t j = 0; j < L; ++j) {
    const uint16_t* kr = k + j * row + g * HD;
    const uint16_t* vr = v + j * row + g * HD;
    uint16_t* kb = kp + (j / kKeys) * kKeys * HD + (j % kKeys) * 2;
    uint16_t* vb = vp + (j / 2) * HD * 2 + (j % 2);
    for (int64_t p = 0; p < HD / 2; ++p) std::memcpy(kb + p * kKeys * 2, kr + 2 * p, 2 * sizeof(uint16_t));
    for (int64_t d = 0; d < HD; ++d) vb[2 * d] = vr[d];
  }
}

// Rows [i0, i0 + rows) of query head h (positions pos0 + i), over the packed K/V of its KV head.
template <int64_t HD>
void attend_rows(const uint16_t* q, int64_t heads, int64_t h, int64_t i0, int64_t rows, int64_t pos0,
                 const uint16_t* kp, const uint16_t* vp, float scale, uint16_t* out) {
  constexpr int64_t kVecs = HD / 16;
  alignas(64) float acc[kRows][HD];
  alignas(64) uint16_t probs[kRows][kKeys];
  float maxes[kRows], sums[kRows];
  int32_t qpairs[kRows][HD / 2];
  for (int64_t r = 0; r < kRows; ++r) {
    maxes[r] = -std::numeric_limits<float>::infinity();
    sums[r] = 0.f;
    for (int64_t d = 0; d < HD; ++d) acc[r][d] = 0.f;
    const int64_t i = i0 + std::min(r, rows - 1);  // a short item repeats its last row, unused
    std::memcpy(qpairs[r], q + (i * heads + h) * HD, HD * sizeof(uint16_t));
  }
  const int64_t last = pos0 + i0 + rows - 1;  // the item's furthest position
  for (int64_t j0 = 0; j0 <= last; j0 += kKeys) {
    const uint16_t* kb = kp + j0 * HD;
    __m512 s[kRows][2];
    for (int64_t r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < HD / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kKeys * 2);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * kKeys * 2 + 32);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(qpairs[r][p]);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float rescale;
      if (!block_probs(s[r][0], s[r][1], pos0 + i0 + r, j0, scale, maxes[r], sums[r], rescale, probs[r])) continue;
      for (int64_t d = 0; d < HD; d += 16)
        _mm512_store_ps(acc[r] + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), _mm512_set1_ps(rescale)));
    }
    // acc[r] += probs[r] . V, two keys per vdpbf16ps, keys ascending; rows whose block was
    // skipped above are left alone.
    const uint16_t* vb = vp + j0 * HD;
    for (int64_t r = 0; r < rows; ++r) {
      if (pos0 + i0 + r < j0) continue;
      __m512 o[kVecs];
      for (int64_t x = 0; x < kVecs; ++x) o[x] = _mm512_load_ps(acc[r] + 16 * x);
      for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
        int32_t pair;
        std::memcpy(&pair, probs[r] + 2 * jp, sizeof pair);
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
        for (int64_t x = 0; x < kVecs; ++x)
          o[x] = _mm512_dpbf16_ps(o[x], pv, (__m512bh)_mm512_loadu_si512(vb + jp * HD * 2 + 32 * x));
      }
      for (int64_t x = 0; x < kVecs; ++x) _mm512_store_ps(acc[r] + 16 * x, o[x]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_row<HD>(acc[r], sums[r], out + ((i0 + r) * heads + h) * HD);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

constexpr int64_t kTileRows = 16;

// Tiles 0, 1: C, the block's scores (rows x 16 keys each); 2: A, 32 dims of the rows' queries;
// 3: B, 16 dim-pairs x 16 keys; 4: A, the rows' 32 probabilities; 5: B, 16 key-pairs x 16 dims of
// V; 6, 7: C, the rows' probabilities times 16 dims of V each.
duet_amx::TileConfig tile_config(int64_t rows) {
  duet_amx::TileConfig config;
  for (int t : {0, 1, 2, 4, 6, 7}) config.set(t, rows, 64);
  for (int t : {3, 5}) config.set(t, kTileRows, 64);
  return config;
}

// As attend_rows, for up to 16 rows on tiles configured for `rows`.
template <int64_t HD>
void attend_rows_amx(const uint16_t* q, int64_t heads, int64_t h, int64_t i0, int64_t rows, int64_t pos0,
                     const uint16_t* kp, const uint16_t* vp, float scale, uint16_t* out) {
  alignas(64) float acc[kTileRows][HD] = {};
  alignas(64) float scores[kTileRows][kKeys];
  alignas(64) float pv[2][kTileRows][16];
  alignas(64) uint16_t probs[kTileRows][kKeys];
  float maxes[kTileRows], sums[kTileRows] = {}, rescale[kTileRows];
  std::fill(maxes, maxes + kTileRows, -std::numeric_limits<float>::infinity());
  const uint16_t* qh = q + (i0 * heads + h) * HD;
  const int64_t q_stride = heads * HD * 2, last = pos0 + i0 + rows - 1;  // bytes; the furthest position
  for (int64_t j0 = 0; j0 <= last; j0 += kKeys) {
    const uint16_t* kb = kp + j0 * HD;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < HD / 32; ++c) {
      _tile_loadd(2, qh + 32 * c, q_stride);
      _tile_loadd(3, kb + 16 * c * kKeys * 2, kKeys * 2 * 2);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(3, kb + 16 * c * kKeys * 2 + 32, kKeys * 2 * 2);
      _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, scores[0], kKeys * 4);
    _tile_stored(1, scores[0] + 16, kKeys * 4);
    for (int64_t r = 0; r < rows; ++r) {
      if (!block_probs(_mm512_load_ps(scores[r]), _mm512_load_ps(scores[r] + 16), pos0 + i0 + r, j0, scale, maxes[r],
                       sums[r], rescale[r], probs[r])) {
        std::memset(probs[r], 0, sizeof probs[r]);  // adds nothing to the row
        rescale[r] = 1.f;
      }
    }
    _tile_loadd(4, probs[0], kKeys * 2);
    const uint16_t* vb = vp + j0 * HD;
    for (int64_t x = 0; x < HD / 16; x += 2) {
      _tile_zero(6);
      _tile_zero(7);
      _tile_loadd(5, vb + 32 * x, HD * 2 * 2);
      _tile_dpbf16ps(6, 4, 5);
      _tile_loadd(5, vb + 32 * (x + 1), HD * 2 * 2);
      _tile_dpbf16ps(7, 4, 5);
      _tile_stored(6, pv[0][0], 64);
      _tile_stored(7, pv[1][0], 64);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 f = _mm512_set1_ps(rescale[r]);
        for (int64_t y = 0; y < 2; ++y) {
          float* a = acc[r] + 16 * (x + y);
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), f, _mm512_load_ps(pv[y][r])));
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_row<HD>(acc[r], sums[r], out + ((i0 + r) * heads + h) * HD);
}

#endif

template <int64_t HD>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, double scale, bool amx) {
  const int64_t n = q.size(0), heads = q.size(1), L = k.size(0), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t blocks = (L + kKeys - 1) / kKeys, per_head = blocks * kKeys * HD;
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<uint16_t> kp(kv_heads * per_head), vp(kv_heads * per_head);
  at::parallel_for(0, kv_heads, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack<HD>(kd, vd, L, kv_heads, g, kp.data() + g * per_head, vp.data() + g * per_head);
  });
  // Items (row block, head), row blocks in order: threads take every T-th item, so each gets
  // early (short) and late (long) rows alike.
  const int64_t block_rows = amx ? 16 : kRows;
  const int64_t row_blocks = (n + block_rows - 1) / block_rows, items = row_blocks * heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t configured = 0;  // the row count the tiles are configured for, 0: none yet
      for (int64_t it = t; it < items; it += threads) {
        const int64_t b = it / heads, h = it % heads, i0 = b * block_rows, rows = std::min(block_rows, n - i0);
        const uint16_t *kh = kp.data() + (h / group) * per_head, *vh = vp.data() + (h / group) * per_head;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (amx) {
          if (rows != configured) {
            const duet_amx::TileConfig config = tile_config(rows);
            _tile_loadconfig(&config);
            configured = rows;
          }
          attend_rows_amx<HD>(qd, heads, h, i0, rows, L - n, kh, vh, static_cast<float>(scale), od);
          continue;
        }
#endif
        attend_rows<HD>(qd, heads, h, i0, rows, L - n, kh, vh, static_cast<float>(scale), od);
      }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
      if (configured) _tile_release();
#endif
    }
  });
}

bool amx_available() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  return duet_amx::available();
#else
  return false;
#endif
}

void bf16_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                            double scale, bool amx) {
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                "q, k, v and out must be contiguous 3-D bfloat16 CPU tensors");
  }
  TORCH_CHECK(out.sizes() == q.sizes() && k.sizes() == v.sizes() && k.size(2) == q.size(2) &&
                  q.size(1) % k.size(1) == 0 && k.size(0) >= q.size(0) && q.size(0) > 0,
              "q/out [n, heads, head_dim] and k/v [L >= n, kv_heads, head_dim] do not agree");
  TORCH_CHECK(!amx || amx_available(), "the AMX path needs AMX");
  switch (q.size(2)) {
    case 64: return attend<64>(q, k, v, out, scale, amx);
    case 128: return attend<128>(q, k, v, out, scale, amx);
    default: TORCH_CHECK(false, "bf16_prefill_attention takes head dims 64 and 128, not ", q.size(2));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duet_cpu, m) {
  m.def("bf16_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float scale, bool amx) -> ()");
}

TORCH_LIBRARY_IMPL(duet_cpu, CPU, m) { m.impl("bf16_prefill_attention", bf16_prefill_attention); }

#endif  // __AVX512BF16__
