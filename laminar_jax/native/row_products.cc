// Weight products of few rows for XLA:CPU, called through the XLA FFI (laminar_jax/native builds
// this file on first use; model/transformer.py's Linear calls it in the rollout engine's decode).
//
// y[M, N] = x[M, K] . W[N, K]^T with W as stored ([out, in], float32 or bfloat16), x and y float32.
// Why a kernel: a decode step of a few live rows is a chain of such products, and XLA:CPU's GEMM
// packs the weight operand on every call, so at 4-16 rows it streams the weights at about half
// the speed of its own 1-row matrix-vector product. This reads every weight row once, straight from
// its stored layout, and multiplies it into all M rows while it is in the L1 cache.
//
// Sums run over K in 16-lane partial sums, reduced at the end: the result of a row never depends on
// the other rows or on how the work is split between threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Rows [m0, m0 + MG) of y for weight rows [n0, n0 + NB): MG x NB accumulators in registers.
template <int MG, int NB, typename W>
inline void block(const float* x, const W* w, int64_t k_n, int64_t n_n, int64_t m0, int64_t n0, float* y) {
  vf acc[MG][NB];
  for (int m = 0; m < MG; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = vf{};
  const int64_t k_vec = k_n / kLanes * kLanes;
  for (int64_t k = 0; k < k_vec; k += kLanes) {
    vf wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load16(w + (n0 + b) * k_n + k);
    for (int m = 0; m < MG; ++m) {
      const vf xv = load16(x + (m0 + m) * k_n + k);
      for (int b = 0; b < NB; ++b) acc[m][b] += xv * wv[b];
    }
  }
  for (int m = 0; m < MG; ++m)
    for (int b = 0; b < NB; ++b) {
      float s = hsum(acc[m][b]);
      for (int64_t k = k_vec; k < k_n; ++k) s += x[(m0 + m) * k_n + k] * widen(w[(n0 + b) * k_n + k]);
      y[(m0 + m) * n_n + n0 + b] = s;
    }
}

// All M rows for weight rows [n0, n0 + NB): groups of 8 rows (then 4, 2, 1), so the NB weight rows
// come from memory once and from L1 for the other groups.
template <int NB, typename W>
inline void all_rows(const float* x, const W* w, int64_t m_n, int64_t k_n, int64_t n_n, int64_t n0, float* y) {
  int64_t m = 0;
  for (; m + 8 <= m_n; m += 8) block<8, NB>(x, w, k_n, n_n, m, n0, y);
  for (; m + 4 <= m_n; m += 4) block<4, NB>(x, w, k_n, n_n, m, n0, y);
  for (; m + 2 <= m_n; m += 2) block<2, NB>(x, w, k_n, n_n, m, n0, y);
  for (; m < m_n; ++m) block<1, NB>(x, w, k_n, n_n, m, n0, y);
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
    for (; n + 3 <= hi; n += 3) all_rows<3>(x, w, m_n, k_n, n_n, n, y);
    for (; n < hi; ++n) all_rows<1>(x, w, m_n, k_n, n_n, n, y);
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

ffi::Error row_products(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("expected x[M, K] and w[N, K]");
  const int64_t m_n = xd[0], k_n = xd[1], n_n = wd[0];
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
