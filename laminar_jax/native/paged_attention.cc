// Paged decode attention for XLA:CPU, called through the XLA FFI (laminar_jax/native/__init__.py
// compiles this file with the host's C++ compiler on first use; native/ops.py calls it).
//
// Why a kernel: XLA:CPU has no fused paged attention. The portable backend (rollout/attention.py,
// live_pages) gathers every live page into a copy and runs thousands of tiny batched products;
// this reads each live page once, in place, and keeps the scores in registers/L1.
//
// Inputs (shapes as XLA hands them over, row-major):
//   q      f32[B, H, D]          the step's queries, already scaled by 1/sqrt(D)
//   k_pool f32|u16[P, Hkv, D, page]  K pool (u16 = bfloat16 bits; the engine stores 16-bit pools so)
//   v_pool f32|u16[P, Hkv, page, D]  V pool
//   table  i32[B, n]             each row's page table (logical page j -> physical page)
//   length i32[B]                tokens each row attends (0: an inactive row, output zeros)
// Output:  out f32[B, H, D]: softmax(q . k) v over the row's first `length` tokens, per head h
//          against KV head h / (H / Hkv).
// A row's result depends only on its own query, pages and length (never on other rows or on
// which physical pages it holds), so moved sequences stay output-identical.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 (a score minus its running max), written so the compiler vectorises it
// (Cephes' expf polynomial; relative error ~1e-7). exp(-88 and below) -> 0.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (int32_t(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

struct Dims {
  int64_t b, h, d, hkv, g, page, n, pages;
};

// ---- fast path: page and D multiples of 16, at most 8 query heads per KV head. Written with GCC
// vector extensions (16 floats: one AVX-512 register, two AVX2 ones) so that each product's
// accumulators stay in registers: per 16 keys, G score vectors over D; per 16 value columns, G
// accumulators over the page's tokens.
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr int kLanes = 16;

inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline void store16(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

// exp_nonpos on 16 lanes (same polynomial); floor through integer conversion.
inline vf exp16(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  fl = fl > fx ? fl - 1.0f : fl;
  vf r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  vi bits = (__builtin_convertvector(fl, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Independent accumulators per pass: NB blocks of 16 lanes x G heads, at most 24 registers. One
// chain per accumulator would stall on the FMA's latency (4 cycles) with only G of them.
template <int G>
constexpr int kBlocks = 24 / G < 4 ? 24 / G : 4;

// Scores of NB blocks of 16 keys (from block tb) for G heads: sc[g, t] = q[g] . k[:, t].
template <int G, int NB, typename KV>
inline void score_blocks(const float* qr, const KV* k, int64_t d_n, int64_t page, int64_t tb, float* sc) {
  vf sv[NB][G];
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < G; ++g) sv[b][g] = vf{};
  for (int64_t dd = 0; dd < d_n; ++dd) {
    vf kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = load16(k + dd * page + (tb + b) * kLanes);
    for (int g = 0; g < G; ++g) {
      const float qv = qr[g * d_n + dd];
      for (int b = 0; b < NB; ++b) sv[b][g] += qv * kv[b];
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < G; ++g) store16(sc + g * page + (tb + b) * kLanes, sv[b][g]);
}

// acc[g, columns of blocks db..db+NB) += sum_t p[g, t] v[t, those columns], over the page's ntok tokens.
template <int G, int NB, typename KV>
inline void value_blocks(const float* sc, const KV* v, int64_t d_n, int64_t page, int64_t ntok, int64_t db,
                         float* acc) {
  vf av[NB][G];
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < G; ++g) av[b][g] = load16(acc + g * d_n + (db + b) * kLanes);
  for (int64_t t = 0; t < ntok; ++t) {
    vf vv[NB];
    for (int b = 0; b < NB; ++b) vv[b] = load16(v + t * d_n + (db + b) * kLanes);
    for (int g = 0; g < G; ++g) {
      const float e = sc[g * page + t];
      for (int b = 0; b < NB; ++b) av[b][g] += e * vv[b];
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < G; ++g) store16(acc + g * d_n + (db + b) * kLanes, av[b][g]);
}

template <int G, typename KV>
void attend_unit_fast(const Dims& s, const float* q, const KV* kp, const KV* vp, const int32_t* table,
                      int32_t length, int64_t row, int64_t kvh, float* out, float* scratch) {
  const int64_t page = s.page, d_n = s.d;
  float* sc = scratch;                // [G, page]: scores, then their exps
  float* acc = scratch + G * page;    // [G, D]
  float* o = out + (row * s.h + kvh * G) * d_n;
  const float* qr = q + (row * s.h + kvh * G) * d_n;
  if (length <= 0) {
    std::fill(o, o + G * d_n, 0.0f);
    return;
  }
  std::fill(acc, acc + G * d_n, 0.0f);
  float m[G], l[G];
  for (int g = 0; g < G; ++g) m[g] = -3.0e38f, l[g] = 0.0f;
  const int64_t live = (length + page - 1) / page;
  for (int64_t j = 0; j < live; ++j) {
    const int64_t p = table[row * s.n + j];
    const int64_t ntok = std::min<int64_t>(page, length - j * page);
    const KV* k = kp + (p * s.hkv + kvh) * d_n * page;  // [D, page]
    const KV* v = vp + (p * s.hkv + kvh) * page * d_n;  // [page, D]
    if (j + 1 < live) {  // the next page's K and V toward the cache while this one computes
      const int64_t pn = table[row * s.n + j + 1];
      const char* kn = reinterpret_cast<const char*>(kp + (pn * s.hkv + kvh) * d_n * page);
      const char* vn = reinterpret_cast<const char*>(vp + (pn * s.hkv + kvh) * page * d_n);
      const int64_t bytes = d_n * page * int64_t(sizeof(KV));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }
    }
    const int64_t tblocks = (ntok + kLanes - 1) / kLanes;
    int64_t tb = 0;
    for (; tb + kBlocks<G> <= tblocks; tb += kBlocks<G>) score_blocks<G, kBlocks<G>>(qr, k, d_n, page, tb, sc);
    for (; tb < tblocks; ++tb) score_blocks<G, 1>(qr, k, d_n, page, tb, sc);
    const int64_t padded = tblocks * kLanes;
    for (int g = 0; g < G; ++g) {
      float* sg = sc + g * page;
      for (int64_t t = ntok; t < padded; ++t) sg[t] = -3.0e38f;  // the last page's unwritten tail
      vf mv = splat(m[g]);
      for (int64_t tb = 0; tb < tblocks; ++tb) {
        const vf x = load16(sg + tb * kLanes);
        mv = x > mv ? x : mv;
      }
      float mx = mv[0];
      for (int i = 1; i < kLanes; ++i) mx = std::max(mx, mv[i]);
      vf sum = vf{};
      for (int64_t tb = 0; tb < tblocks; ++tb) {
        const vf e = exp16(load16(sg + tb * kLanes) - mx);
        store16(sg + tb * kLanes, e);
        sum += e;
      }
      float total = 0.0f;
      for (int i = 0; i < kLanes; ++i) total += sum[i];
      const float rescale = exp_nonpos(m[g] - mx);
      l[g] = l[g] * rescale + total;
      m[g] = mx;
      for (int64_t dd = 0; dd < d_n; ++dd) acc[g * d_n + dd] *= rescale;
    }
    const int64_t dblocks = d_n / kLanes;
    int64_t db = 0;
    for (; db + kBlocks<G> <= dblocks; db += kBlocks<G>) value_blocks<G, kBlocks<G>>(sc, v, d_n, page, ntok, db, acc);
    for (; db < dblocks; ++db) value_blocks<G, 1>(sc, v, d_n, page, ntok, db, acc);
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t dd = 0; dd < d_n; ++dd) o[g * d_n + dd] = acc[g * d_n + dd] * inv;
  }
}

// ---- general path: any page size, D and group size.
// One (row, KV head) unit: online softmax over the row's live pages, G query heads at once.
// scratch holds G * page scores and G * D accumulators.
template <typename KV>
void attend_unit(const Dims& s, const float* q, const KV* kp, const KV* vp, const int32_t* table,
                 int32_t length, int64_t row, int64_t kvh, float* out, float* scratch) {
  const int64_t g_n = s.g, page = s.page, d_n = s.d;
  float* sc = scratch;              // [G, page]
  float* acc = scratch + g_n * page;  // [G, D]
  float m[64], l[64];               // G <= 64 (checked by the caller)
  float* o = out + (row * s.h + kvh * g_n) * d_n;
  const float* qr = q + (row * s.h + kvh * g_n) * d_n;
  if (length <= 0) {
    std::fill(o, o + g_n * d_n, 0.0f);
    return;
  }
  std::fill(acc, acc + g_n * d_n, 0.0f);
  for (int64_t g = 0; g < g_n; ++g) m[g] = -3.0e38f, l[g] = 0.0f;
  const int64_t live = (length + page - 1) / page;
  for (int64_t j = 0; j < live; ++j) {
    const int64_t p = table[row * s.n + j];
    const int64_t ntok = std::min<int64_t>(page, length - j * page);
    const KV* k = kp + (p * s.hkv + kvh) * d_n * page;  // [D, page]
    const KV* v = vp + (p * s.hkv + kvh) * page * d_n;  // [page, D]
    std::fill(sc, sc + g_n * page, 0.0f);
    for (int64_t dd = 0; dd < d_n; ++dd) {
      const KV* krow = k + dd * page;
      for (int64_t g = 0; g < g_n; ++g) {
        const float qv = qr[g * d_n + dd];
        float* sg = sc + g * page;
        for (int64_t t = 0; t < ntok; ++t) sg[t] += qv * load(krow, t);
      }
    }
    for (int64_t g = 0; g < g_n; ++g) {
      float* sg = sc + g * page;
      float mx = m[g];
      for (int64_t t = 0; t < ntok; ++t) mx = std::max(mx, sg[t]);
      const float rescale = exp_nonpos(m[g] - mx);
      float sum = 0.0f;
      for (int64_t t = 0; t < ntok; ++t) {
        sg[t] = exp_nonpos(sg[t] - mx);
        sum += sg[t];
      }
      l[g] = l[g] * rescale + sum;
      m[g] = mx;
      float* ag = acc + g * d_n;
      for (int64_t dd = 0; dd < d_n; ++dd) ag[dd] *= rescale;
    }
    for (int64_t t = 0; t < ntok; ++t) {
      const KV* vrow = v + t * d_n;
      for (int64_t g = 0; g < g_n; ++g) {
        const float e = sc[g * page + t];
        float* ag = acc + g * d_n;
        for (int64_t dd = 0; dd < d_n; ++dd) ag[dd] += e * load(vrow, dd);
      }
    }
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t dd = 0; dd < d_n; ++dd) o[g * d_n + dd] = acc[g * d_n + dd] * inv;
  }
}

template <typename KV>
void attend(const Dims& s, const float* q, const KV* kp, const KV* vp, const int32_t* table, int32_t length,
            int64_t row, int64_t kvh, float* out, float* scratch) {
  if (s.page % kLanes == 0 && s.d % kLanes == 0) {
    switch (s.g) {
      case 1: return attend_unit_fast<1>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 2: return attend_unit_fast<2>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 3: return attend_unit_fast<3>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 4: return attend_unit_fast<4>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 5: return attend_unit_fast<5>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 6: return attend_unit_fast<6>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 7: return attend_unit_fast<7>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      case 8: return attend_unit_fast<8>(s, q, kp, vp, table, length, row, kvh, out, scratch);
      default: break;
    }
  }
  attend_unit(s, q, kp, vp, table, length, row, kvh, out, scratch);
}

// Units (row, KV head) handed out from an atomic counter. The calling thread works too and waits
// only for units other threads have already claimed (running, never queued), so the call cannot
// deadlock whether or not XLA's pool ever runs the helper tasks; a helper that starts after the
// call finished claims nothing and touches no buffer.
constexpr int64_t kParallelMin = 1 << 20;  // multiply-adds below which one thread does the whole call

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

template <typename KV>
ffi::Error run(ffi::ThreadPool pool, const Dims& s, const float* q, const KV* kp, const KV* vp,
               const int32_t* table, const int32_t* length, float* out) {
  for (int64_t r = 0; r < s.b; ++r) {
    if (length[r] > s.n * s.page) return ffi::Error::InvalidArgument("length exceeds the page table");
    for (int64_t j = 0; j < (length[r] + s.page - 1) / s.page; ++j) {
      const int32_t p = table[r * s.n + j];
      if (p < 0 || p >= s.pages) return ffi::Error::InvalidArgument("page id outside the pool");
    }
  }
  auto work = std::make_shared<Work>();
  work->total = s.b * s.hkv;
  const int64_t scratch_n = s.g * (s.page + s.d);
  auto body = [=](Work* w) {
    std::vector<float> scratch(scratch_n);
    for (int64_t u; (u = w->next.fetch_add(1)) < w->total;) {
      attend(s, q, kp, vp, table, length[u / s.hkv], u / s.hkv, u % s.hkv, out, scratch.data());
      w->done.fetch_add(1, std::memory_order_release);
    }
  };
  // Waking a pool thread costs microseconds: below ~1M multiply-adds (a small model's step) the
  // caller does it all.
  int64_t lanes = 0;
  for (int64_t r = 0; r < s.b; ++r) lanes += int64_t(std::max(length[r], 0)) * s.h * s.d * 2;
  const int64_t helpers = lanes < kParallelMin ? 0 : std::min<int64_t>(pool.num_threads(), work->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work, body] { body(work.get()); });
  body(work.get());
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
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
  s.g = s.h / s.hkv;
  if (s.g > 64) return ffi::Error::InvalidArgument("more than 64 query heads per KV head");
  if (k_pool.element_type() != v_pool.element_type())
    return ffi::Error::InvalidArgument("K and V pools differ in dtype");
  float* o = out->typed_data();
  if (k_pool.element_type() == ffi::DataType::F32)
    return run(pool, s, q.typed_data(), k_pool.typed_data<float>(), v_pool.typed_data<float>(), table.typed_data(),
               length.typed_data(), o);
  if (k_pool.element_type() == ffi::DataType::U16)
    return run(pool, s, q.typed_data(), k_pool.typed_data<uint16_t>(), v_pool.typed_data<uint16_t>(),
               table.typed_data(), length.typed_data(), o);
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
