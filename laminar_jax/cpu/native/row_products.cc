// Weight products of a decode step's rows for XLA:CPU, called through the XLA FFI (laminar_jax/native
// builds this file on first use; model/transformer.py's Linear calls it in the rollout engine's decode).
//
// y[M, N] = x[M, K] . W[N, K]^T with W as stored ([out, in], float32 or bfloat16), x and y float32.
// Why a kernel: a decode step is a chain of such products of a few to a few dozen rows, and XLA:CPU's
// GEMM packs the weight operand on every call, so at 4-16 rows it streams the weights at about half
// the speed of its own 1-row matrix-vector product, and at 32-64 rows it reaches 60% of its peak.
// The path is chosen by the CPU and the row count alone:
// - few rows: every weight row is read once, straight from its stored layout, and multiplied into
//   all M rows while it is in L1; sums run over K in 16-lane partial sums, reduced at the end;
// - from 4 rows (8 for bfloat16) on AVX-512: a GEMM micro-kernel (below, "Four rows and more"),
//   except float32 products of 4-16 rows with K a multiple of 4, which pack 4 rows x 4 k per vector
//   (below, "4 to 16 rows of float32");
// - on AVX2 without AVX-512, the first form at every row count, in 8-float vectors (below, "The
//   few-row form's vectors").
// Either way the result of a row never depends on the other rows or on how the work is split
// between threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <immintrin.h>
#include "parallel.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

// The 16 lanes' sum as a tree of halves (4 shuffle-adds, where a lane-by-lane sum is a 16-add chain).
inline float hsum(vf v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(__AVX512BF16__)
// With AVX-512 BF16 (compiled for this CPU): bfloat16 weights against the bfloat16-rounded rows, 32
// products per instruction (vdpbf16ps) summed in float32, where the path above widens each weight
// to float32 first (slower than XLA's bf16 dot; this one is faster up to 32 rows). K in 32s.
template <int MG, int NB>
inline void block_bf16(const uint16_t* xb, const uint16_t* w, int64_t k_n, int64_t n_n, int64_t m0, int64_t n0,
                       float* y) {
  __m512 acc[MG][NB];
  for (int m = 0; m < MG; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_n; k += 32) {
    // Weight rows fetched 1 KB ahead from 2 rows (4 rows: -13-16%); a 1-row product streams faster
    // on the hardware prefetcher alone (the extra requests slowed it by 20-60%).
    if constexpr (MG > 1)
      for (int b = 0; b < NB; ++b) __builtin_prefetch(w + (n0 + b) * k_n + k + 512);
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (n0 + b) * k_n + k);
    for (int m = 0; m < MG; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m0 + m) * k_n + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
    }
  }
  for (int m = 0; m < MG; ++m)
    for (int b = 0; b < NB; ++b) y[(m0 + m) * n_n + n0 + b] = _mm512_reduce_add_ps(acc[m][b]);
}
#endif

// The few-row form's vectors. 16 floats: one AVX-512 register. On AVX2 without AVX-512 that is two
// registers each and the 8 x 3 accumulators spill (slower than XLA's dot there), so 8 floats:
// one register, groups of at most 4 rows (12 accumulators), bfloat16 widened as it loads. It beats
// XLA's dot at 2-16 rows of a ~100M model's weights; the tiny demo model's products are too short
// for the call's overhead, hence native_ops.MIN_WEIGHTS_AVX2. Below 32 rows the AVX2 GEMM form
// (x packed transposed, weights broadcast, 2 x 6 accumulators) is no faster than XLA's dot.
struct Lanes16 {
  typedef vf V;
  static constexpr int64_t kN = 16, kGroup = 8;
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V fma(V a, V x, V w) { return a + x * w; }
  static float sum(V v) { return hsum(v); }
};

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf8 load8(const uint16_t* p) {  // 8 bfloat16 values widened: the bits move to the high half
  typedef uint16_t vh8 __attribute__((vector_size(16)));
  typedef uint32_t vu8 __attribute__((vector_size(32)));
  vh8 h;
  std::memcpy(&h, p, sizeof h);
  const vu8 u = __builtin_convertvector(h, vu8) << 16;
  vf8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
struct Lanes8 {
  typedef vf8 V;
  static constexpr int64_t kN = 8, kGroup = 4;
  template <typename T>
  static V load(const T* p) { return load8(p); }
  // An explicit FMA: left to the compiler, one row group's instance fused and another's did not,
  // and a row's result depended on the rows beside it.
  static V fma(V a, V x, V w) { return (vf8)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)a); }
  static float sum(V v) {  // a tree of halves, as hsum
    const vf4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
};
typedef Lanes8 FewLanes;
#else
typedef Lanes16 FewLanes;
#endif

// Rows [m0, m0 + MG) of y for weight rows [n0, n0 + NB): MG x NB accumulators in registers.
template <typename L, int MG, int NB, typename W>
inline void block(const float* x, const W* w, int64_t k_n, int64_t n_n, int64_t m0, int64_t n0, float* y) {
  typename L::V acc[MG][NB];
  for (int m = 0; m < MG; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = typename L::V{};
  const int64_t k_vec = k_n / L::kN * L::kN;
  for (int64_t k = 0; k < k_vec; k += L::kN) {
    typename L::V wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = L::load(w + (n0 + b) * k_n + k);
    for (int m = 0; m < MG; ++m) {
      const typename L::V xv = L::load(x + (m0 + m) * k_n + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = L::fma(acc[m][b], xv, wv[b]);
    }
  }
  for (int m = 0; m < MG; ++m)
    for (int b = 0; b < NB; ++b) {
      float s = L::sum(acc[m][b]);
      for (int64_t k = k_vec; k < k_n; ++k) s += x[(m0 + m) * k_n + k] * widen(w[(n0 + b) * k_n + k]);
      y[(m0 + m) * n_n + n0 + b] = s;
    }
}

// All M rows for weight rows [n0, n0 + NB): groups of L::kGroup rows (then 4, 2, 1), so the NB
// weight rows come from memory once and from L1 for the other groups.
template <typename L, int NB, typename W>
inline void all_rows(const float* x, const W* w, int64_t m_n, int64_t k_n, int64_t n_n, int64_t n0, float* y) {
  int64_t m = 0;
  if constexpr (L::kGroup >= 8)
    for (; m + 8 <= m_n; m += 8) block<L, 8, NB>(x, w, k_n, n_n, m, n0, y);
  for (; m + 4 <= m_n; m += 4) block<L, 4, NB>(x, w, k_n, n_n, m, n0, y);
  for (; m + 2 <= m_n; m += 2) block<L, 2, NB>(x, w, k_n, n_n, m, n0, y);
  for (; m < m_n; ++m) block<L, 1, NB>(x, w, k_n, n_n, m, n0, y);
}

constexpr int64_t kRowsPerUnit = 48;  // weight rows per work unit (a multiple of 3)
constexpr int64_t kSpreadMinWeights = 1 << 16;  // weight elements below which one thread does the call

template <typename W>
void run(ffi::ThreadPool& pool, const float* x, const W* w, int64_t m_n, int64_t k_n, int64_t n_n, float* y) {
  // Few rows are bound by the weight read, which two threads stream faster than one: spread by the
  // weight's size (a 1-row product of a 768 x 768 weight on one thread made a 1-row decode step slower).
  for_units(pool, (n_n + kRowsPerUnit - 1) / kRowsPerUnit, n_n * k_n >= kSpreadMinWeights, [=](int64_t u) {
    const int64_t lo = u * kRowsPerUnit, hi = std::min(n_n, lo + kRowsPerUnit);
    int64_t n = lo;
    for (; n + 3 <= hi; n += 3) all_rows<FewLanes, 3>(x, w, m_n, k_n, n_n, n, y);
    for (; n < hi; ++n) all_rows<FewLanes, 1>(x, w, m_n, k_n, n_n, n, y);
  });
}

#if defined(__AVX512BF16__)
template <int NB>
inline void all_rows_bf16(const uint16_t* xb, const uint16_t* w, int64_t m_n, int64_t k_n, int64_t n_n, int64_t n0,
                          float* y) {
  int64_t m = 0;
  for (; m + 4 <= m_n; m += 4) block_bf16<4, NB>(xb, w, k_n, n_n, m, n0, y);
  for (; m + 2 <= m_n; m += 2) block_bf16<2, NB>(xb, w, k_n, n_n, m, n0, y);
  for (; m < m_n; ++m) block_bf16<1, NB>(xb, w, k_n, n_n, m, n0, y);
}
// y = x . w^T for bfloat16 w, 4 weight rows x up to 4 rows per block.
void run_bf16(ffi::ThreadPool& pool, const float* x, const uint16_t* w, int64_t m_n, int64_t k_n, int64_t n_n,
              float* y) {
  // The rows as bfloat16 (their high halves: exact, the caller rounded them to bfloat16 already).
  std::vector<uint16_t> xb(m_n * k_n);
  for (int64_t i = 0; i < m_n * k_n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    xb[i] = uint16_t(u >> 16);
  }
  const uint16_t* xp = xb.data();
  for_units(pool, (n_n + kRowsPerUnit - 1) / kRowsPerUnit, n_n * k_n >= kSpreadMinWeights, [=](int64_t u) {
    const int64_t lo = u * kRowsPerUnit, hi = std::min(n_n, lo + kRowsPerUnit);
    int64_t n = lo;
    for (; n + 4 <= hi; n += 4) all_rows_bf16<4>(xp, w, m_n, k_n, n_n, n, y);
    for (; n < hi; ++n) all_rows_bf16<1>(xp, w, m_n, k_n, n_n, n, y);
  });
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LAMINAR_GEMM 1
#endif

#if LAMINAR_GEMM
// Four rows and more: the paths above waste arithmetic here (their 16-lane partial sums need a
// shuffle-add reduction per output, and all rows of x come again from L2 for every few weight rows).
// This is a GEMM micro-kernel instead: x is packed transposed, x^T[k][Mp] (Mp: M padded with zero
// rows to a multiple of 16), so one vector holds 16 rows at one k; each weight element is broadcast
// from its row and multiplied into MV such vectors, for NB weight rows at a time (MV x NB
// accumulators in registers, nothing to reduce). Every output is one float32 sum in k order: a row's
// result depends neither on the other rows nor on the split between threads.
// With AVX-512 it beats XLA's dot from 4 float32 rows to 64 (XLA packs the weight operand on every
// call), and bfloat16 from 8 rows (below that the vdpbf16ps path above is faster); at 128 rows XLA's
// dot is as fast.
// On AVX2 (no AVX-512) the same micro-kernel runs in 8-float registers, for float32 from
// kPackMinRowsAvx2 rows (at 8-24 rows neither it nor the few-row form is ahead): 2 row vectors x 6
// weight rows (12 of the 16 registers accumulate), or 1 x 12 for the last 8 rows. There it is ahead
// of XLA's dot at 32 rows and even at 64, behind on the K = 2048 down projection.
constexpr int64_t kPackMinRowsF32 = 4, kPackMinRowsBf16 = 8, kPackMinRowsAvx2 = 32;
constexpr int64_t kPackUnitRows = 48;  // weight rows per work unit: a multiple of every NB below
// Prefetch. A tile's NB weight rows are NB short streams that the hardware prefetcher follows late.
// Fetching each row kPrefetch elements ahead hides part of that (further ahead in the same rows
// gains nothing). Fetching the next tile's rows while this tile runs (a whole tile ahead, so DRAM
// latency is hidden) is faster again where a tile does more than one weight read's worth of work
// (bfloat16 from 8 rows, float32 from 32); float32 tiles of one row vector (up to 16 rows) have too
// little work to hide it, so those keep the row-ahead form. Prefetches change no result.
constexpr int64_t kPrefetch = 32;

// One float in every lane of a register (va: kW floats): a broadcast load (va{} + w adds first).
inline va broadcast(const float* p) {
#if defined(__AVX512F__)
  return (va)_mm512_set1_ps(*p);
#else
  return (va)_mm256_set1_ps(*p);  // not _mm256_broadcast_ss(p): GCC takes that builtin for a read of
                                  // any memory and stored every accumulator back before each one
#endif
}

// acc + x * w, one rounding: an explicit FMA on AVX2, as the few-row form's (Lanes8::fma).
inline va fma(va acc, va x, va w) {
#if defined(__AVX512F__)
  return acc + x * w;
#else
  return (va)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#endif
}

// float32 weights: acc[v][b] += x^T[k][kW rows of vector v] * w_b[k], k by k.
struct F32Step {
  template <int MV, int NB>
  static inline void run(const float* xt, int64_t mp, const float* const* wp, const float* const* wn, int64_t k_n,
                         va (&acc)[MV][NB]) {
    for (int64_t k = 0; k < k_n; ++k) {
      if ((k & 15) == 0)
        for (int b = 0; b < NB; ++b) __builtin_prefetch(MV == 1 ? wp[b] + k + kPrefetch : wn[b] + k);
      va xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = loadv(xt + k * mp + v * kW);
      for (int b = 0; b < NB; ++b) {
        const va wb = broadcast(wp[b] + k);
        for (int v = 0; v < MV; ++v) acc[v][b] = fma(acc[v][b], xv[v], wb);
      }
    }
  }
};

#if defined(__AVX512BF16__)
// bfloat16 weights, k in pairs: x^T holds each row's pair (x[2k], x[2k+1]) as one 32-bit lane, the
// weight pair is broadcast as one, and vdpbf16ps adds both products to the lane's float32 sum.
struct Bf16Step {
  template <int MV, int NB>
  static inline void run(const uint32_t* xt, int64_t mp, const uint32_t* const* wp, const uint32_t* const* wn,
                         int64_t k_n, vf (&acc)[MV][NB]) {
    for (int64_t k = 0; k < k_n; ++k) {
      if ((k & 15) == 0)
        for (int b = 0; b < NB; ++b) __builtin_prefetch(wn[b] + k);
      __m512bh xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(xt + k * mp + v * kLanes);
      for (int b = 0; b < NB; ++b) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(int(wp[b][k]));
        for (int v = 0; v < MV; ++v) acc[v][b] = (vf)_mm512_dpbf16_ps((__m512)acc[v][b], xv[v], wb);
      }
    }
  }
};
#endif

// A tile's NB weight rows from n0 (rows past `last` repeat row `last`) in wp, and the next tile's
// (clamped to `last_all`, the weight's last row) in wn: those are prefetched while this one runs.
template <int NB, typename T>
inline void tile_rows(const T* w, int64_t k_n, int64_t n0, int64_t last, int64_t last_all, const T* (&wp)[NB],
                      const T* (&wn)[NB]) {
  for (int b = 0; b < NB; ++b) wp[b] = w + std::min(n0 + b, last) * k_n;
  for (int b = 0; b < NB; ++b) wn[b] = w + std::min(n0 + NB + b, last_all) * k_n;
}

// Weight rows [n0, n0 + NB) (rows past `last` repeat row `last`: computed twice, stored to one place)
// against row vectors [v0, v0 + MV) of x^T: sums into yt[(n - lo) * mp + m]. k_n counts k steps.
// `last_all`: the weight's last row, which clamps the next tile's rows (prefetched, tile_rows).
template <typename S, int MV, int NB, typename T>
inline void tile(const T* xt, int64_t mp, int64_t v0, const T* w, int64_t k_n, int64_t n0, int64_t last,
                 int64_t lo, float* yt, int64_t last_all) {
  const T *wp[NB], *wn[NB];
  tile_rows(w, k_n, n0, last, last_all, wp, wn);
  va acc[MV][NB];
  for (int b = 0; b < NB; ++b)
    for (int v = 0; v < MV; ++v) acc[v][b] = va{};
  S::template run<MV, NB>(xt + v0 * kW, mp, wp, wn, k_n, acc);
  for (int b = 0; b < NB; ++b)
    for (int v = 0; v < MV; ++v) storev(yt + (std::min(n0 + b, last) - lo) * mp + (v0 + v) * kW, acc[v][b]);
}

template <typename S, int MV, int NB, typename T>
inline void tiles(const T* xt, int64_t mp, int64_t v0, const T* w, int64_t k_n, int64_t lo, int64_t hi, float* yt,
                  int64_t n_all) {
  for (int64_t n0 = lo; n0 < hi; n0 += NB) tile<S, MV, NB>(xt, mp, v0, w, k_n, n0, hi - 1, lo, yt, n_all - 1);
}

// y's columns [lo, hi) (weight rows): row vectors in groups of up to 4 (24 of AVX-512's 32
// registers accumulate; on AVX2 up to 2, 12 of 16), then the sums copied into y. k_n counts k steps
// (elements, or bfloat16 pairs).
template <typename S, typename T>
void packed_unit(const T* xt, int64_t m_n, int64_t mp, int64_t k_n, const T* w, int64_t n_n, int64_t lo,
                 int64_t hi, float* y) {
  std::vector<float> yt((hi - lo) * mp);
#if defined(__AVX512F__)
  for (int64_t v0 = 0; v0 < mp / kW; v0 += 4) {
    switch (std::min<int64_t>(4, mp / kW - v0)) {
      case 1: tiles<S, 1, 12>(xt, mp, v0, w, k_n, lo, hi, yt.data(), n_n); break;
      case 2: tiles<S, 2, 12>(xt, mp, v0, w, k_n, lo, hi, yt.data(), n_n); break;
      case 3: tiles<S, 3, 8>(xt, mp, v0, w, k_n, lo, hi, yt.data(), n_n); break;
      default: tiles<S, 4, 6>(xt, mp, v0, w, k_n, lo, hi, yt.data(), n_n); break;
    }
  }
#else
  // 2 x 6 tiles: faster than 3 x 4 and 4 x 3 (12 accumulators each) at 64 rows.
  for (int64_t v0 = 0; v0 < mp / kW; v0 += 2) {
    if (mp / kW - v0 == 1)
      tiles<S, 1, 12>(xt, mp, v0, w, k_n, lo, hi, yt.data(), n_n);
    else
      tiles<S, 2, 6>(xt, mp, v0, w, k_n, lo, hi, yt.data(), n_n);
  }
#endif
  // Row by row of y, where a unit's outputs are contiguous: y's rows lie far apart, and column by
  // column each store would touch another line of one cache set.
  for (int64_t m = 0; m < m_n; ++m)
    for (int64_t n = lo; n < hi; ++n) y[m * n_n + n] = yt[(n - lo) * mp + m];
}

template <typename S, typename T>
void run_packed(ffi::ThreadPool& pool, const T* xp, int64_t m_n, int64_t mp, int64_t k_n, const T* w,
                int64_t n_n, float* y) {
  for_units(pool, (n_n + kPackUnitRows - 1) / kPackUnitRows, n_n * k_n >= kSpreadMinWeights, [=](int64_t u) {
    const int64_t lo = u * kPackUnitRows, hi = std::min(n_n, lo + kPackUnitRows);
    packed_unit<S>(xp, m_n, mp, k_n, w, n_n, lo, hi, y);
  });
}

// The first two steps of a register transpose, for 8 x 8 (AVX2) and 16 x 16 (AVX-512) floats:
// unpack pairs of rows, then quads; each 128-bit lane of r then holds its 4 x 4 block transposed.
inline __m256 unpack_lo(__m256 a, __m256 b) { return _mm256_unpacklo_ps(a, b); }
inline __m256 unpack_hi(__m256 a, __m256 b) { return _mm256_unpackhi_ps(a, b); }
template <int Imm>
inline __m256 shuffle(__m256 a, __m256 b) { return _mm256_shuffle_ps(a, b, Imm); }
#if defined(__AVX512F__)
inline __m512 unpack_lo(__m512 a, __m512 b) { return _mm512_unpacklo_ps(a, b); }
inline __m512 unpack_hi(__m512 a, __m512 b) { return _mm512_unpackhi_ps(a, b); }
template <int Imm>
inline __m512 shuffle(__m512 a, __m512 b) { return _mm512_shuffle_ps(a, b, Imm); }
#endif

template <typename R, int N>
inline void transpose_quads(R (&r)[N], R (&t)[N]) {
  for (int i = 0; i < N; i += 2) {
    t[i] = unpack_lo(r[i], r[i + 1]);
    t[i + 1] = unpack_hi(r[i], r[i + 1]);
  }
  for (int i = 0; i < N; i += 4) {
    r[i] = shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[i], t[i + 2]);
    r[i + 1] = shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[i], t[i + 2]);
    r[i + 2] = shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[i + 1], t[i + 3]);
    r[i + 3] = shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[i + 1], t[i + 3]);
  }
}

#if defined(__AVX512F__)
// The 16 x 16 floats in r transposed in registers (unpack pairs, then quads, then 128-bit lanes twice).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  transpose_quads(r, t);
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// xt[k][m] = at(m, k) for m < m_n, zeros for the padding rows up to mp; `row16(m, k)` returns
// at(m, k .. k + 15) as one vector. Whole 16 x 16 blocks are transposed in registers (the packing runs
// before the threads share out the work, so element by element it is a serial share of every product);
// the edges go element by element.
template <typename T, typename At, typename Row16>
void pack_transposed(int64_t k_n, int64_t m_n, int64_t mp, T* xt, const At& at, const Row16& row16) {
  const int64_t m_blocks = m_n / 16 * 16, k_blocks = k_n / 16 * 16;
  for (int64_t k0 = 0; k0 < k_blocks; k0 += 16)
    for (int64_t m0 = 0; m0 < m_blocks; m0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = row16(m0 + i, k0);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(xt + (k0 + j) * mp + m0), r[j]);
    }
  for (int64_t k0 = 0; k0 < k_n; k0 += 16) {
    const int64_t k1 = std::min(k_n, k0 + 16);
    for (int64_t m = k0 < k_blocks ? m_blocks : 0; m < m_n; ++m)
      for (int64_t k = k0; k < k1; ++k) xt[k * mp + m] = at(m, k);
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t m = m_n; m < mp; ++m) xt[k * mp + m] = T(0);
  }
}

void run_packed_f32(ffi::ThreadPool& pool, const float* x, const float* w, int64_t m_n, int64_t k_n, int64_t n_n,
                    float* y) {
  const int64_t mp = (m_n + kLanes - 1) / kLanes * kLanes;
  std::unique_ptr<float[]> xt(new float[k_n * mp]);  // every element written by pack_transposed
  pack_transposed(k_n, m_n, mp, xt.get(), [=](int64_t m, int64_t k) { return x[m * k_n + k]; },
                  [=](int64_t m, int64_t k) { return _mm512_loadu_ps(x + m * k_n + k); });
  run_packed<F32Step>(pool, xt.get(), m_n, mp, k_n, w, n_n, y);
}
#else
// The 8 x 8 floats in r transposed in registers (unpack pairs, then quads, then 128-bit halves).
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  transpose_quads(r, t);
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// xt[k][m] = x[m][k] for m < m_n, zeros for the padding rows up to mp (a multiple of 8): whole 8 x 8
// blocks transposed in registers, the edges element by element.
void pack_transposed8(const float* x, int64_t m_n, int64_t mp, int64_t k_n, float* xt) {
  const int64_t m_blocks = m_n / 8 * 8, k_blocks = k_n / 8 * 8;
  for (int64_t k0 = 0; k0 < k_blocks; k0 += 8)
    for (int64_t m0 = 0; m0 < m_blocks; m0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(x + (m0 + i) * k_n + k0);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(xt + (k0 + j) * mp + m0, r[j]);
    }
  for (int64_t k = 0; k < k_n; ++k) {
    for (int64_t m = k < k_blocks ? m_blocks : 0; m < m_n; ++m) xt[k * mp + m] = x[m * k_n + k];
    for (int64_t m = m_n; m < mp; ++m) xt[k * mp + m] = 0.0f;
  }
}

void run_packed_f32(ffi::ThreadPool& pool, const float* x, const float* w, int64_t m_n, int64_t k_n, int64_t n_n,
                    float* y) {
  const int64_t mp = (m_n + kW - 1) / kW * kW;
  // 64-byte aligned: a tile's two row vectors at one k are then one cache line, not two.
  std::vector<float> buffer(k_n * mp + 16);
  float* xt = buffer.data() + (16 - (reinterpret_cast<uintptr_t>(buffer.data()) / 4) % 16) % 16;
  pack_transposed8(x, m_n, mp, k_n, xt);  // writes every element
  // A unit's weight rows are read once per 16 rows of x, so they should stay in L2 beside x^T's
  // 16-row slice: at most ~128 KB of them (12-48 rows). At K = 2048, 48 rows are 384 KB, which on a
  // CPU with 512 KB of L2 come from L3 for every slice.
  const int64_t unit = std::clamp<int64_t>((32768 / std::max<int64_t>(k_n, 1)) / 12 * 12, 12, kPackUnitRows);
  for_units(pool, (n_n + unit - 1) / unit, n_n * k_n >= kSpreadMinWeights, [=](int64_t u) {
    packed_unit<F32Step>(xt, m_n, mp, k_n, w, n_n, u * unit, std::min(n_n, (u + 1) * unit), y);
  });
}
#endif  // __AVX512F__

#if defined(__AVX512F__)
// 4 to 16 rows of float32: groups of 4 rows x 4 consecutive k per vector, xq[q][g] = (x[4g + r][4q + j])
// for r, j < 4, and each weight row's 4 elements at 4q broadcast to the 4 groups of lanes
// (vbroadcastf32x4). Every lane does useful work at 4 rows, where the GEMM tile above uses 4 of its
// 16, and a weight element costs a quarter of a load instead of a whole one: the GEMM form streams
// the weights at 4-16 rows well below a 1-row product's bandwidth, and this form closes part of that.
// Each output is the sum of its 4 lanes' k-strided partial sums, ((p0 + p1) + (p2 + p3)), the same
// for a row whichever group and lanes hold it: a row's result depends on the row count's path (this
// one, or the GEMM from 17 rows), not on the other rows.
constexpr int64_t kQuadMaxRows = 16;

template <int MG, int NB>
inline void quad_tile(const float* xq, int64_t groups, const float* w, int64_t k_n, int64_t n0, int64_t last,
                      int64_t last_all, int64_t m_n, int64_t n_n, float* y) {
  const float *wp[NB], *wn[NB];
  tile_rows(w, k_n, n0, last, last_all, wp, wn);
  vf acc[MG][NB];
  for (int g = 0; g < MG; ++g)
    for (int b = 0; b < NB; ++b) acc[g][b] = vf{};
  for (int64_t q = 0; q < k_n / 4; ++q) {
    if ((q & 3) == 0)
      for (int b = 0; b < NB; ++b) __builtin_prefetch(wn[b] + 4 * q);
    vf xv[MG];
    for (int g = 0; g < MG; ++g) xv[g] = load16(xq + (q * groups + g) * kLanes);
    for (int b = 0; b < NB; ++b) {
      const vf wb = (vf)_mm512_broadcast_f32x4(_mm_loadu_ps(wp[b] + 4 * q));
      for (int g = 0; g < MG; ++g) acc[g][b] += xv[g] * wb;
    }
  }
  for (int b = 0; b < NB; ++b) {
    if (n0 + b > last) break;
    for (int g = 0; g < MG; ++g)
      for (int r = 0; r < 4 && 4 * g + r < m_n; ++r) {
        const vf a = acc[g][b];
        y[(4 * g + r) * n_n + n0 + b] = (a[4 * r] + a[4 * r + 1]) + (a[4 * r + 2] + a[4 * r + 3]);
      }
  }
}

template <int MG, int NB>
void quad_unit(const float* xq, int64_t groups, const float* w, int64_t k_n, int64_t lo, int64_t hi, int64_t m_n,
               int64_t n_n, float* y) {
  for (int64_t n0 = lo; n0 < hi; n0 += NB) quad_tile<MG, NB>(xq, groups, w, k_n, n0, hi - 1, n_n - 1, m_n, n_n, y);
}

void run_quad_f32(ffi::ThreadPool& pool, const float* x, const float* w, int64_t m_n, int64_t k_n, int64_t n_n,
                  float* y) {
  const int64_t groups = (m_n + 3) / 4, quads = k_n / 4;
  std::unique_ptr<float[]> xq(new float[quads * groups * kLanes]);
  for (int64_t q = 0; q < quads; ++q)
    for (int64_t g = 0; g < groups; ++g)
      for (int r = 0; r < 4; ++r)
        for (int j = 0; j < 4; ++j) {
          const int64_t m = 4 * g + r;
          xq[(q * groups + g) * kLanes + 4 * r + j] = m < m_n ? x[m * k_n + 4 * q + j] : 0.0f;
        }
  const float* xp = xq.get();
  for_units(pool, (n_n + kPackUnitRows - 1) / kPackUnitRows, n_n * k_n >= kSpreadMinWeights, [=](int64_t u) {
    const int64_t lo = u * kPackUnitRows, hi = std::min(n_n, lo + kPackUnitRows);
    switch (groups) {
      case 1: quad_unit<1, 12>(xp, groups, w, k_n, lo, hi, m_n, n_n, y); break;
      case 2: quad_unit<2, 12>(xp, groups, w, k_n, lo, hi, m_n, n_n, y); break;
      case 3: quad_unit<3, 8>(xp, groups, w, k_n, lo, hi, m_n, n_n, y); break;
      default: quad_unit<4, 6>(xp, groups, w, k_n, lo, hi, m_n, n_n, y); break;
    }
  });
}

#if defined(__AVX512BF16__)
// k_n even. x's float32 values are bfloat16 already (the caller rounded them): their high halves.
void run_packed_bf16(ffi::ThreadPool& pool, const float* x, const uint16_t* w, int64_t m_n, int64_t k_n,
                     int64_t n_n, float* y) {
  const int64_t mp = (m_n + kLanes - 1) / kLanes * kLanes, pairs = k_n / 2;
  std::unique_ptr<uint32_t[]> xt(new uint32_t[pairs * mp]);
  pack_transposed(pairs, m_n, mp, xt.get(), [=](int64_t m, int64_t k) {
    uint32_t lo, hi;
    std::memcpy(&lo, x + m * k_n + 2 * k, sizeof lo);
    std::memcpy(&hi, x + m * k_n + 2 * k + 1, sizeof hi);
    return (hi & 0xffff0000u) | (lo >> 16);
  }, [=](int64_t m, int64_t k) {  // 32 floats (bf16 values already: exact) -> 16 pairs, in order
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * k_n + 2 * k + 16),
                                           _mm512_loadu_ps(x + m * k_n + 2 * k));
    return (__m512)b;
  });
  run_packed<Bf16Step>(pool, xt.get(), m_n, mp, pairs, reinterpret_cast<const uint32_t*>(w), n_n, y);
}
#endif
#endif  // __AVX512F__
#endif  // LAMINAR_GEMM


ffi::Error row_products(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("expected x[M, K] and w[N, K]");
  const int64_t m_n = xd[0], k_n = xd[1], n_n = wd[0];
#if defined(__AVX512F__)
  if (m_n >= kPackMinRowsF32 && m_n <= kQuadMaxRows && k_n % 4 == 0 && w.element_type() == ffi::DataType::F32) {
    run_quad_f32(pool, x.typed_data(), w.typed_data<float>(), m_n, k_n, n_n, y->typed_data());
    return ffi::Error::Success();
  }
  if (m_n >= kPackMinRowsF32 && w.element_type() == ffi::DataType::F32) {
    run_packed_f32(pool, x.typed_data(), w.typed_data<float>(), m_n, k_n, n_n, y->typed_data());
    return ffi::Error::Success();
  }
#if defined(__AVX512BF16__)
  if (m_n >= kPackMinRowsBf16 && w.element_type() == ffi::DataType::BF16 && k_n % 2 == 0) {
    run_packed_bf16(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), m_n, k_n, n_n,
                    y->typed_data());
    return ffi::Error::Success();
  }
#endif
#elif LAMINAR_GEMM
  if (m_n >= kPackMinRowsAvx2 && w.element_type() == ffi::DataType::F32) {
    run_packed_f32(pool, x.typed_data(), w.typed_data<float>(), m_n, k_n, n_n, y->typed_data());
    return ffi::Error::Success();
  }
#endif
  if (w.element_type() == ffi::DataType::F32)
    run(pool, x.typed_data(), w.typed_data<float>(), m_n, k_n, n_n, y->typed_data());
#if defined(__AVX512BF16__)
  else if (w.element_type() == ffi::DataType::BF16 && k_n % 32 == 0)
    run_bf16(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), m_n, k_n, n_n, y->typed_data());
#endif
  else if (w.element_type() == ffi::DataType::BF16)  // read as their bits
    run(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), m_n, k_n, n_n, y->typed_data());
  else
    return ffi::Error::InvalidArgument("weights must be float32 or bfloat16");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LaminarRowProducts, row_products,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
