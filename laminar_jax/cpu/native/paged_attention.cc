// Paged decode attention for XLA:CPU, called through the XLA FFI (laminar_jax/native/__init__.py
// compiles this file with the host's C++ compiler on first use; native/ops.py calls it).
//
// Why a kernel: XLA:CPU has no fused paged attention. The portable backend (rollout/attention.py,
// live_pages) gathers every live page into a copy and runs thousands of tiny batched products;
// this reads each live page once, in place, and keeps the running sums in registers and L1.
//
// Inputs (shapes as XLA hands them over, row-major):
//   q      f32[B, H, D]               the step's queries, already scaled by 1/sqrt(D)
//   k_pool f32|u16[P, Hkv, D, page]   K pool (u16: bfloat16 bits, as the engine stores 16-bit pools)
//   v_pool f32|u16[P, Hkv, page, D]   V pool
//   table  i32[B, n]                  each row's page table (logical page j -> physical page)
//   length i32[B]                     tokens each row attends (0: an inactive row, output zeros)
// Output:  out f32[B, H, D]: softmax(q . k) v over the row's first `length` tokens, per head h
//          against KV head h / (H / Hkv).
// Shapes: page and D multiples of 16, 1 to 8 query heads per KV head (rollout/attention.py checks).
// A row's result depends only on its own query, pages and length (never on other rows or on
// which physical pages it holds), so moved sequences stay output-identical.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The kernel's vectors: one register of this CPU (vec16.h's kW floats, va). On AVX2 without AVX-512
// a 16-float vector is two registers, so a pass's accumulators (kBlocks x G of them) would take twice
// the 16 registers there are and live in memory, an order of magnitude slower than 8-float ones.
// Accumulators: 12 of 16 registers, 24 of 32; the rest hold a pass's loaded rows.
constexpr int kAccumulators = kW == 8 ? 12 : 24;

struct Dims {
  int64_t b, h, d, hkv, g, page, n, pages;
};

// exp(x) for x <= 0 on kW lanes (Cephes' expf polynomial, relative error ~1e-7; -87 and below
// give ~1e-38); floor through integer conversion.
inline va expv(va x) {
  x = x < -87.0f ? va{} - 87.0f : x;
  const va fx = x * 1.44269504088896341f + 0.5f;
  va fl = __builtin_convertvector(__builtin_convertvector(fx, vai), va);
  fl = fl > fx ? fl - 1.0f : fl;
  const va r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  va y = va{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vai bits = (__builtin_convertvector(fl, vai) + 127) << 23;
  va scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Independent accumulators per pass: NB blocks of kW lanes x G heads, at most kAccumulators
// registers. With only G chains the FMAs would wait on each other's latency.
template <int G>
constexpr int kBlocks = kAccumulators / G < 1 ? 1 : kAccumulators / G < 4 ? kAccumulators / G : 4;

// out[g, NB blocks of kW lanes] (+)= sum_i a[g * a_g + i] * rows[i * row_stride + those lanes].
template <int G, int NB, typename KV>
inline void accumulate_blocks(const float* a, int64_t a_g, const KV* rows, int64_t row_stride, int64_t n_i,
                              float* out, int64_t out_g, bool add) {
  va acc[NB][G];
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < G; ++g) acc[b][g] = add ? loadv(out + g * out_g + b * kW) : va{};
  for (int64_t i = 0; i < n_i; ++i) {
    va r[NB];
    for (int b = 0; b < NB; ++b) r[b] = loadv(rows + i * row_stride + b * kW);
    for (int g = 0; g < G; ++g) {
      const float x = a[g * a_g + i];
      for (int b = 0; b < NB; ++b) acc[b][g] += x * r[b];
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < G; ++g) storev(out + g * out_g + b * kW, acc[b][g]);
}

// accumulate_blocks over n_blocks blocks: passes of kBlocks<G>, then single blocks. Both products of
// a page have this form: scores (a = q, rows = K's D rows of keys) and values (a = the exps, rows =
// V's tokens).
template <int G, typename KV>
inline void products(const float* a, int64_t a_g, const KV* rows, int64_t row_stride, int64_t n_i, float* out,
                     int64_t out_g, int64_t n_blocks, bool add) {
  int64_t b = 0;
  for (; b + kBlocks<G> <= n_blocks; b += kBlocks<G>)
    accumulate_blocks<G, kBlocks<G>>(a, a_g, rows + b * kW, row_stride, n_i, out + b * kW, out_g, add);
  for (; b < n_blocks; ++b)
    accumulate_blocks<G, 1>(a, a_g, rows + b * kW, row_stride, n_i, out + b * kW, out_g, add);
}

// One head's scores of a page (s[0, ntok), padded to `blocks` x kW) become exp(s - m') in place, with
// m' the running max; l and m are updated and the factor for the old accumulator is returned.
inline float softmax_page(float* s, int64_t ntok, int64_t blocks, float& m, float& l) {
  for (int64_t t = ntok; t < blocks * kW; ++t) s[t] = -3.0e38f;  // the last page's unwritten tail
  va mv = va{} + m;
  for (int64_t b = 0; b < blocks; ++b) {
    const va x = loadv(s + b * kW);
    mv = x > mv ? x : mv;
  }
  float mx = mv[0];
  for (int i = 1; i < kW; ++i) mx = std::max(mx, mv[i]);
  va sum{};
  for (int64_t b = 0; b < blocks; ++b) {
    const va e = expv(loadv(s + b * kW) - mx);
    storev(s + b * kW, e);
    sum += e;
  }
  float total = 0.0f;
  for (int i = 0; i < kW; ++i) total += sum[i];
  const float rescale = expv(va{} + (m - mx))[0];
  l = l * rescale + total;
  m = mx;
  return rescale;
}

// Asks for one KV head's K and V block of page p ahead of its use, line by line: each block is a
// short stream (8-16 KB) that the hardware prefetcher picks up late (-9% at 64 rows of 128 tokens).
// Blocks under 4 KB (small models' pages, likely in L2 already) are left alone: there the prefetches
// would be as many instructions as the block's products.
template <typename KV>
inline void prefetch_block(const Dims& s, const KV* kp, const KV* vp, int64_t p, int64_t kvh) {
  const int64_t bytes = s.d * s.page * int64_t(sizeof(KV));
  if (bytes < 4096) return;
  const char* kb = reinterpret_cast<const char*>(kp + (p * s.hkv + kvh) * s.d * s.page);
  const char* vb = reinterpret_cast<const char*>(vp + (p * s.hkv + kvh) * s.page * s.d);
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(kb + o);
    __builtin_prefetch(vb + o);
  }
}

// One (row, KV head): online softmax over the row's live pages for its G query heads.
// scratch: G * page scores, then G * D accumulators.
template <int G, typename KV>
void attend(const Dims& s, const float* q, const KV* kp, const KV* vp, const int32_t* table, int32_t length,
            int64_t row, int64_t kvh, bool next_head, float* out, float* scratch) {
  const int64_t page = s.page, d_n = s.d;
  float* o = out + (row * s.h + kvh * G) * d_n;
  const float* qr = q + (row * s.h + kvh * G) * d_n;
  float *sc = scratch, *acc = scratch + G * page;
  std::fill(acc, acc + G * d_n, 0.0f);
  float m[G], l[G];
  std::fill(m, m + G, -3.0e38f);
  std::fill(l, l + G, 0.0f);
  const int64_t n_pages = (length + page - 1) / page;
  for (int64_t j = 0; j < n_pages; ++j) {
    const int64_t p = table[row * s.n + j], ntok = std::min<int64_t>(page, length - j * page);
    if (j + 1 < n_pages)
      prefetch_block(s, kp, vp, table[row * s.n + j + 1], kvh);
    else if (next_head)  // the unit's next KV head starts on the row's first page
      prefetch_block(s, kp, vp, table[row * s.n], kvh + 1);
    const int64_t blocks = (ntok + kW - 1) / kW;
    products<G>(qr, d_n, kp + (p * s.hkv + kvh) * d_n * page, page, d_n, sc, page, blocks, false);
    for (int g = 0; g < G; ++g) {
      const float r = softmax_page(sc + g * page, ntok, blocks, m[g], l[g]);
      for (int64_t dd = 0; dd < d_n; ++dd) acc[g * d_n + dd] *= r;
    }
    products<G>(sc, page, vp + (p * s.hkv + kvh) * page * d_n, d_n, ntok, acc, d_n, d_n / kW, true);
  }
  for (int g = 0; g < G; ++g)  // length 0 (an inactive row): l = 0 and acc = 0 give 0 * inf; write zeros
    for (int64_t dd = 0; dd < d_n; ++dd) o[g * d_n + dd] = length > 0 ? acc[g * d_n + dd] / l[g] : 0.0f;
}

template <int G, typename KV>
void run(ffi::ThreadPool& pool, const Dims& s, const float* q, const KV* kp, const KV* vp, const int32_t* table,
         const int32_t* length, float* out) {
  int64_t work = 0;  // multiply-adds
  for (int64_t r = 0; r < s.b; ++r) work += int64_t(std::max(length[r], 0)) * s.h * s.d * 2;
  // A unit is a whole row (its KV heads one after another, each prefetching the next's first page:
  // -15-20% at 64 rows against a unit per KV head, whose first page always came cold), or, for a
  // few rows, one KV head of a row, so that every thread has work.
  const int64_t hpu = s.b >= 4 ? s.hkv : 1, per_row = s.hkv / hpu;
  for_units(pool, s.b * per_row, work >= kSpreadMin, [=](int64_t u) {
    thread_local std::vector<float> scratch;
    scratch.resize(G * (s.page + s.d));
    const int64_t row = u / per_row, h0 = (u % per_row) * hpu, h1 = std::min(s.hkv, h0 + hpu);
    for (int64_t kvh = h0; kvh < h1; ++kvh)
      attend<G>(s, q, kp, vp, table, length[row], row, kvh, kvh + 1 < h1, out, scratch.data());
  });
}

template <typename KV>
ffi::Error dispatch(ffi::ThreadPool& pool, const Dims& s, const float* q, const KV* kp, const KV* vp,
                    const int32_t* table, const int32_t* length, float* out) {
  for (int64_t r = 0; r < s.b; ++r) {
    if (length[r] > s.n * s.page) return ffi::Error::InvalidArgument("length exceeds the page table");
    for (int64_t j = 0; j < (length[r] + s.page - 1) / s.page; ++j)
      if (table[r * s.n + j] < 0 || table[r * s.n + j] >= s.pages)
        return ffi::Error::InvalidArgument("page id outside the pool");
  }
  switch (s.g) {
    case 1: run<1>(pool, s, q, kp, vp, table, length, out); break;
    case 2: run<2>(pool, s, q, kp, vp, table, length, out); break;
    case 3: run<3>(pool, s, q, kp, vp, table, length, out); break;
    case 4: run<4>(pool, s, q, kp, vp, table, length, out); break;
    case 5: run<5>(pool, s, q, kp, vp, table, length, out); break;
    case 6: run<6>(pool, s, q, kp, vp, table, length, out); break;
    case 7: run<7>(pool, s, q, kp, vp, table, length, out); break;
    case 8: run<8>(pool, s, q, kp, vp, table, length, out); break;
    default: return ffi::Error::InvalidArgument("1 to 8 query heads per KV head");
  }
  return ffi::Error::Success();
}

ffi::Error paged_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                           ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> length,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), vd = v_pool.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q[B,H,D], pools[P,Hkv,*,*], table[B,n]");
  Dims s{qd[0], qd[1], qd[2], kd[1], 0, kd[3], td[1], kd[0]};
  if (kd[2] != s.d || vd[0] != s.pages || vd[1] != s.hkv || vd[2] != s.page || vd[3] != s.d || td[0] != s.b ||
      s.hkv <= 0 || s.h % s.hkv != 0)
    return ffi::Error::InvalidArgument("pool, query and table shapes disagree");
  if (s.page % 16 != 0 || s.d % 16 != 0)
    return ffi::Error::InvalidArgument("page size and head dim must be multiples of 16");
  s.g = s.h / s.hkv;
  if (k_pool.element_type() != v_pool.element_type())
    return ffi::Error::InvalidArgument("K and V pools differ in dtype");
  if (k_pool.element_type() == ffi::DataType::F32)
    return dispatch(pool, s, q.typed_data(), k_pool.typed_data<float>(), v_pool.typed_data<float>(),
                    table.typed_data(), length.typed_data(), out->typed_data());
  if (k_pool.element_type() == ffi::DataType::U16)
    return dispatch(pool, s, q.typed_data(), k_pool.typed_data<uint16_t>(), v_pool.typed_data<uint16_t>(),
                    table.typed_data(), length.typed_data(), out->typed_data());
  return ffi::Error::InvalidArgument("pools must be float32 or uint16 (bfloat16 bits)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LaminarPagedAttention, paged_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
