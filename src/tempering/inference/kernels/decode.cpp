// The bf16 one-token (decode) step's work around its matmuls, for CPUs with AVX512-BF16 (built at first use by
// `tempering.inference.kernels`; see its docstring for why it exists):
// - `decode_attention`: attention over the engine's slot cache;
// - `rope_attend`: a layer's rotary embedding of q and k, the cache write of k and v, and the attention;
// - `rms_norm`, `add_rms_norm`: the RMSNorm of transformers' Llama family, the residual add before it fused;
// - `silu_mul`: the gated MLP's silu(gate) * up.
// Each rounds to bf16 where transformers' bf16 ops round (after each elementwise op), so that the hidden
// states are theirs up to the order of a norm's sum and the attention's sums (fp32, not bf16, throughout).
//
// Attention: q (B, Hkv, G, D) (unit stride in D): the G query heads of each key/value head; k, v (B, Hkv, W,
// D) views of the cache (unit stride in D); lengths (B,): row b attends to its positions [0, lengths[b]).
// Scores are exact bf16 products summed in fp32 (_mm512_dpbf16_ps), the softmax and the weighted sum of
// values in fp32, the output rounded to bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

static inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void store16(uint16_t* p, __m512 x) {  // 16 fp32 -> bf16, rounded to nearest even
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(x));
}
static inline __m512 round16(__m512 x) {  // fp32 rounded to bf16 and back: a bf16 op's result
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
static inline float f32_of(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline const uint16_t* bf16_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
static inline uint16_t* bf16_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

static inline __m512 exp512(__m512 x) {  // e^x, |relative error| < 1e-7 (Taylor of 2^f, |f| <= 1/2)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.540353e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The lane sums of 16 vectors as one vector: r[i] = the sum of a[rev(i)]'s lanes, rev reversing i's four bits.
// Four levels pair two vectors' partial sums into one: at level l (h = 8 >> l), lane p keeps x[p] (or y[p], where
// p & h) and adds its partner p + h of x (or p - h of y), a blend and one permute a pairing - 15 pairings instead
// of 16 full reductions, the permutes (one port) half as many as with two a pairing.
struct Pairing {
  alignas(64) int partner[4][16];
  __mmask16 from_y[4];
  Pairing() {
    for (int level = 0; level < 4; ++level) {
      const int h = 8 >> level;
      from_y[level] = 0;
      for (int p = 0; p < 16; ++p) {
        partner[level][p] = (p & h) ? 16 + p - h : p + h;
        if (p & h) from_y[level] |= __mmask16(1u << p);
      }
    }
  }
};
static const Pairing pairing;
static constexpr int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

static inline __attribute__((always_inline)) __m512 hsum16(__m512* a) {
#pragma GCC unroll 4
  for (int level = 0, n = 16; level < 4; ++level, n /= 2) {
    const __m512i partner = _mm512_load_si512(pairing.partner[level]);
    const __mmask16 from_y = pairing.from_y[level];
#pragma GCC unroll 8
    for (int i = 0; i < n / 2; ++i)
      a[i] = _mm512_add_ps(_mm512_mask_blend_ps(from_y, a[2 * i], a[2 * i + 1]),
                           _mm512_permutex2var_ps(a[2 * i], partner, a[2 * i + 1]));
  }
  return a[0];
}

// scores[g * n + j] = scale * q_g . k_j for the G queries (D = 32 C) and the keys j in [from, to), 16 at a time;
// m[g] the max of m[g] and theirs.
template <int C>
static void score(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks, int64_t from, int64_t to, int64_t n,
                  int64_t G, float scale, float* scores, float* m) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512i qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(q + g * qs + c * 32);
    __m512 best = _mm512_set1_ps(m[g]);
    for (int64_t j0 = from; j0 < to; j0 += 16) {
      const int64_t count = std::min<int64_t>(16, to - j0);
      __m512 a[16];
      if (count == 16) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          __m512 d = _mm512_setzero_ps();
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c)
            d = _mm512_dpbf16_ps(d, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(k + (j0 + j) * ks + c * 32));
          a[rev[j]] = d;
        }
      } else {
        for (int j = 0; j < 16; ++j) {
          __m512 d = _mm512_setzero_ps();
          if (j < count)  // (past n: not read - it may lie past the buffer)
            for (int c = 0; c < C; ++c)
              d = _mm512_dpbf16_ps(d, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(k + (j0 + j) * ks + c * 32));
          a[rev[j]] = d;
        }
      }
      const __mmask16 keep = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
      const __m512 x = _mm512_mul_ps(hsum16(a), sc);
      _mm512_mask_storeu_ps(scores + g * n + j0, keep, x);
      best = _mm512_mask_max_ps(best, keep, best, x);
    }
    m[g] = _mm512_reduce_max_ps(best);
  }
}

// out[b] = inv[b] * sum_j p[b * n + j] v_j for NB queries at once (D = 16 F), their sums in registers: v_j from
// `shared` for j < s, else from `v` (a value's position j at v + j * vs).
template <int F, int NB>
static void weigh(const float* p, int64_t n, const uint16_t* shared, int64_t s, const uint16_t* v, int64_t vs,
                  const float* inv, uint16_t* out) {
  __m512 a[NB][F];
  for (int b = 0; b < NB; ++b)
    for (int f = 0; f < F; ++f) a[b][f] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* row = (j < s ? shared : v) + j * vs;
    __m512 x[F];
    for (int f = 0; f < F; ++f) x[f] = load16(row + f * 16);
    for (int b = 0; b < NB; ++b) {
      const __m512 w = _mm512_set1_ps(p[b * n + j]);
      for (int f = 0; f < F; ++f) a[b][f] = _mm512_fmadd_ps(w, x[f], a[b][f]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int f = 0; f < F; ++f) store16(out + b * F * 16 + f * 16, _mm512_mul_ps(a[b][f], _mm512_set1_ps(inv[b])));
}

template <int F>
static void weigh_all(const float* p, int64_t n, const uint16_t* shared, int64_t s, const uint16_t* v, int64_t vs,
                      const float* inv, int64_t G, uint16_t* out) {
  constexpr int NB = F <= 4 ? 3 : 2;  // NB * F sums and F values fit the 32 registers
  int64_t g = 0;
  for (; g + NB <= G; g += NB) weigh<F, NB>(p + g * n, n, shared, s, v, vs, inv + g, out + g * F * 16);
  for (; g < G; ++g) weigh<F, 1>(p + g * n, n, shared, s, v, vs, inv + g, out + g * F * 16);
}

template <int C>
static void score_both(const uint16_t* q, int64_t qs, const uint16_t* k_shared, int64_t s, const uint16_t* k,
                       int64_t ks, int64_t n, int64_t G, float scale, float* scores, float* m) {
  score<C>(q, qs, k_shared, ks, 0, s, n, G, scale, scores, m);
  score<C>(q, qs, k, ks, s, n, n, G, scale, scores, m);
}

// One (row, key head): G queries against n keys and values of D (a multiple of 32) bf16 each, positions j at
// k + j * kvs and v + j * kvs - but those before s at k_shared, v_shared (another slot holding the same keys and
// values there: a group's shared prompt, read once for all its rows while it stays in cache).
static void attend(const uint16_t* q, int64_t qs, const uint16_t* k_shared, const uint16_t* v_shared, int64_t s,
                   const uint16_t* k, const uint16_t* v, int64_t kvs, int64_t n, int64_t G, int64_t D, float scale,
                   float* scores, uint16_t* out) {
  if (n <= 0) {  // nothing to attend to: zeros (the engine never asks; kept defined)
    std::fill(out, out + G * D, uint16_t(0));
    return;
  }
  s = std::min(s, n);
  float m[16], inv[16];
  std::fill(m, m + 16, -INFINITY);
  switch (D / 32) {
    case 1: score_both<1>(q, qs, k_shared, s, k, kvs, n, G, scale, scores, m); break;
    case 2: score_both<2>(q, qs, k_shared, s, k, kvs, n, G, scale, scores, m); break;
    case 3: score_both<3>(q, qs, k_shared, s, k, kvs, n, G, scale, scores, m); break;
    default: score_both<4>(q, qs, k_shared, s, k, kvs, n, G, scale, scores, m); break;
  }
  for (int64_t g = 0; g < G; ++g) {  // the weights e^(s - max), in place, and 1 / their sum
    float* row = scores + g * n;
    const __m512 mv = _mm512_set1_ps(m[g]);
    __m512 tv = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 r = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(r, row + j), mv));
      _mm512_mask_storeu_ps(row + j, r, e);
      tv = _mm512_add_ps(tv, _mm512_maskz_mov_ps(r, e));
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(tv);
  }
  switch (D / 16) {
    case 2: weigh_all<2>(scores, n, v_shared, s, v, kvs, inv, G, out); break;
    case 4: weigh_all<4>(scores, n, v_shared, s, v, kvs, inv, G, out); break;
    case 6: weigh_all<6>(scores, n, v_shared, s, v, kvs, inv, G, out); break;
    default: weigh_all<8>(scores, n, v_shared, s, v, kvs, inv, G, out); break;
  }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "decode_attention: q, k and v must be bf16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
              q.size(1) == k.size(1) && q.size(3) == k.size(3), "decode_attention: q (B, H, G, D), k and v (B, H, W, D)");
  TORCH_CHECK(q.stride(3) == 1 && k.strides() == v.strides() && k.stride(3) == 1, "decode_attention: unit stride in D, "
              "k and v alike");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == q.size(0),
              "decode_attention: lengths (B,) int64");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), W = k.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 128 && G <= 16, "decode_attention: D a multiple of 32 up to 128, G up to 16");
  auto out = torch::empty_like(q);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t* lp = lengths.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * W);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, n = std::min<int64_t>(lp[b], W);
      const uint16_t *kb = kp + b * k.stride(0) + h * k.stride(1), *vb = vp + b * v.stride(0) + h * v.stride(1);
      attend(qp + b * q.stride(0) + h * q.stride(1), q.stride(2), kb, vb, 0, kb, vb, k.stride(2), n, G, D, float(scale),
             scores.data(), op + bh * G * D);
    }
  });
  return out;
}

// transformers' LlamaRMSNorm in bf16: y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))); H a multiple of 16.
static void norm_row(const uint16_t* x, const uint16_t* w, int64_t H, float eps, uint16_t* y) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(H) + eps));
  for (int64_t i = 0; i < H; i += 16)
    store16(y + i, _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(x + i), r))));
}

static void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, name, ": bf16 tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) &&
              x.size(1) % 16 == 0, name, ": x (N, H) contiguous, weight (H,), H a multiple of 16");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto y = torch::empty_like(x);
  const int64_t H = x.size(1);
  const uint16_t *xp = bf16_ptr(x), *wp = bf16_ptr(weight);
  uint16_t* yp = bf16_mut(y);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * H, wp, H, float(eps), yp + r * H);
  });
  return y;
}

// hidden += delta (in place, rounded to bf16: transformers' residual add), then rms_norm(hidden).
torch::Tensor add_rms_norm(torch::Tensor hidden, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(hidden, weight, "add_rms_norm");
  TORCH_CHECK(delta.scalar_type() == at::kBFloat16 && delta.is_contiguous() && delta.sizes() == hidden.sizes(),
              "add_rms_norm: delta bf16, contiguous, of hidden's shape");
  auto y = torch::empty_like(hidden);
  const int64_t H = hidden.size(1);
  uint16_t* hp = bf16_mut(hidden);
  const uint16_t *dp = bf16_ptr(delta), *wp = bf16_ptr(weight);
  uint16_t* yp = bf16_mut(y);
  at::parallel_for(0, hidden.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* h = hp + r * H;
      for (int64_t i = 0; i < H; i += 16) store16(h + i, _mm512_add_ps(load16(h + i), load16(dp + r * H + i)));
      norm_row(h, wp, H, float(eps), yp + r * H);
    }
  });
  return y;
}

// The gated MLP's activation: gate_up (N, 2I), gate then up -> bf16(bf16(silu(gate)) * up) (N, I).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.is_contiguous() &&
              gate_up.size(1) % 32 == 0, "silu_mul: gate_up (N, 2I) bf16 contiguous, I a multiple of 16");
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({N, I}, gate_up.options());
  const uint16_t* gp = bf16_ptr(gate_up);
  uint16_t* op = bf16_mut(out);
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 g = load16(gp + r * 2 * I + i);
        const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        store16(op + r * I + i, _mm512_mul_ps(silu, load16(gp + r * 2 * I + I + i)));
      }
  });
  return out;
}

// transformers' rotary embedding of one head in bf16: y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)).
static void rotate(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t D, uint16_t* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
    const __m512 lo = _mm512_sub_ps(round16(_mm512_mul_ps(x1, load16(c + i))), round16(_mm512_mul_ps(x2, load16(s + i))));
    const __m512 hi =
        _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(c + half + i))), round16(_mm512_mul_ps(x1, load16(s + half + i))));
    store16(y + i, lo);
    store16(y + half + i, hi);
  }
}

// One layer of a one-token step after its qkv projection: qkv (B, (G + 2) * Hkv * D), the query heads then the
// key heads then the value heads; cos, sin (B, D). Rotates q and k, writes k and v at position positions[b] of
// cache slot lo + b (k_cache, v_cache (S, Hkv, L, D), contiguous), and returns the attention of each row's
// rotated query heads over its positions [0, positions[b]] (B, G * Hkv * D), query head i on key head i / G.
//
// Row b reads its first shared[b] positions from row leader[b]'s slot, which holds the same keys and values
// there (the engine's rows of a group, copies of one prompt's cache), and the rows are visited in `order`
// (a permutation of [0, B), a group's rows together): a group's prompt then comes from memory once, not once
// per row, and from the core's own cache for the rest.
torch::Tensor rope_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor positions, int64_t lo, double scale, int64_t G,
                          torch::Tensor leader, torch::Tensor shared, torch::Tensor order) {
  for (const auto* t : {&qkv, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous(), "rope_attend: contiguous bf16 tensors");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "rope_attend: caches (S, Hkv, L, D)");
  const int64_t B = qkv.size(0), Hkv = k_cache.size(1), L = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(D % 32 == 0 && D <= 128 && G >= 1 && G <= 16, "rope_attend: D a multiple of 32 up to 128, G up to 16");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (G + 2) * Hkv * D, "rope_attend: qkv (B, (G + 2) * Hkv * D)");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rope_attend: cos, sin (B, D)");
  for (const auto* t : {&positions, &leader, &shared, &order})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B,
                "rope_attend: positions, leader, shared and order (B,) int64");
  TORCH_CHECK(lo >= 0 && lo + B <= k_cache.size(0), "rope_attend: slots [lo, lo + B) outside the cache");
  const int64_t *pp = positions.data_ptr<int64_t>(), *lp = leader.data_ptr<int64_t>();
  const int64_t *sp_ = shared.data_ptr<int64_t>(), *order_ = order.data_ptr<int64_t>();
  std::vector<char> seen(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pp[b] >= 0 && pp[b] < L, "rope_attend: a position outside the cache");
    TORCH_CHECK(lp[b] >= 0 && lp[b] < B && sp_[b] >= 0 && sp_[b] <= pp[b] && sp_[b] <= pp[lp[b]],
                "rope_attend: a row shares positions it or its leader does not hold");
    TORCH_CHECK(order_[b] >= 0 && order_[b] < B && !seen[order_[b]], "rope_attend: order is not a permutation");
    seen[order_[b]] = 1;
  }
  auto out = torch::empty({B, G * Hkv * D}, qkv.options());
  const uint16_t *xp = bf16_ptr(qkv), *cp = bf16_ptr(cos), *sp = bf16_ptr(sin);
  uint16_t *kp = bf16_mut(k_cache), *vp = bf16_mut(v_cache), *op = bf16_mut(out);
  const int64_t row = (G + 2) * Hkv * D, slot = Hkv * L * D;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * (L + 1));
    std::vector<uint16_t> q(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = order_[i / Hkv], h = i % Hkv, pos = pp[b], head = h * L * D;
      const uint16_t *x = xp + b * row, *c = cp + b * D, *s = sp + b * D;
      uint16_t *k = kp + (lo + b) * slot + head, *v = vp + (lo + b) * slot + head;
      const uint16_t *ks = kp + (lo + lp[b]) * slot + head, *vs = vp + (lo + lp[b]) * slot + head;
      for (int64_t g = 0; g < G; ++g) rotate(x + (h * G + g) * D, c, s, D, q.data() + g * D);
      rotate(x + (G * Hkv + h) * D, c, s, D, k + pos * D);
      std::copy(x + ((G + 1) * Hkv + h) * D, x + ((G + 1) * Hkv + h + 1) * D, v + pos * D);
      attend(q.data(), D, ks, vs, sp_[b], k, v, D, pos + 1, G, D, float(scale), scores.data(),
             op + b * G * Hkv * D + h * G * D);
    }
  });
  return out;
}

// One token per row of bf16 logits (B, V): inverse-CDF sampling of softmax(logits / t) with the row's uniform
// number u in [0, 1), or, where t <= 0, the first most likely token; and its log-prob under softmax(logits / t)
// (t = 1 for greedy rows). The weights e^(z - max) are summed 16 at a time, and the cumulative sum that u * total
// is found in walks those sums in double, then one block's weights: the total and the walk agree, so a draw
// always lands on a token of nonzero weight. -> tokens (B,) int64, log-probs (B,) fp32.
std::vector<torch::Tensor> sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor uniforms) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 && logits.is_contiguous(),
              "sample_rows: logits (B, V) bf16 contiguous");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "sample_rows: no tokens to sample from");
  for (const auto* t : {&temperature, &uniforms})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == B,
                "sample_rows: temperature and uniforms (B,) fp32");
  auto tokens = torch::empty({B}, logits.options().dtype(at::kLong));
  auto logprobs = torch::empty({B}, logits.options().dtype(at::kFloat));
  const uint16_t* xp = bf16_ptr(logits);
  const float *tp = temperature.data_ptr<float>(), *up = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  const int64_t blocks = (V + 15) / 16;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(blocks * 16, 0.f), sums(blocks);
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* x = xp + b * V;
      const bool greedy = tp[b] <= 0.f;
      const float inv = greedy ? 1.f : 1.f / tp[b];
      __m512 best = _mm512_set1_ps(-INFINITY);
      for (int64_t k = 0; k < blocks; ++k) {
        const __mmask16 r = V - k * 16 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - k * 16)) - 1);
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(r, x + k * 16)), 16));
        best = _mm512_mask_max_ps(best, r, best, v);
      }
      const float top = _mm512_reduce_max_ps(best) * inv;  // the largest z = logit / t (t > 0: order kept)
      const __m512 iv = _mm512_set1_ps(inv), tv = _mm512_set1_ps(top);
      double total = 0.0;
      for (int64_t k = 0; k < blocks; ++k) {
        const __mmask16 r = V - k * 16 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - k * 16)) - 1);
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(r, x + k * 16)), 16));
        const __m512 e = _mm512_maskz_mov_ps(r, exp512(_mm512_fmsub_ps(v, iv, tv)));
        _mm512_storeu_ps(w.data() + k * 16, e);
        sums[k] = _mm512_reduce_add_ps(e);
        total += sums[k];
      }
      int64_t token = 0;
      auto z = [&](int64_t i) { return f32_of(x[i]) * inv; };
      if (greedy) {
        while (token < V - 1 && z(token) < top) ++token;  // the first of the largest
      } else {
        const double goal = double(up[b]) * total;
        double cum = 0.0;
        int64_t k = 0;
        while (k < blocks - 1 && cum + sums[k] <= goal) cum += sums[k++];
        token = k * 16;
        int64_t last = -1;  // the block's last token of nonzero weight: where rounding leaves the walk short
        for (int64_t i = k * 16; i < std::min(V, k * 16 + 16); ++i) {
          if (w[i] > 0.f) last = i;
          cum += w[i];
          if (cum > goal && w[i] > 0.f) { last = i; break; }
        }
        token = last >= 0 ? last : token;
      }
      out[b] = token;
      lp[b] = float((z(token) - top) - std::log(total));
    }
  });
  return {tokens, logprobs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "One-token attention over the slot cache (bf16, AVX512-BF16)");
  m.def("rope_attend", &rope_attend, "Rotary embedding, cache write and attention of a one-token step (bf16)");
  m.def("rms_norm", &rms_norm, "transformers' Llama RMSNorm (bf16)");
  m.def("add_rms_norm", &add_rms_norm, "The residual add in place, then RMSNorm (bf16)");
  m.def("sample_rows", &sample_rows, "One token per row from bf16 logits: softmax(logits / t), or greedy");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a gated MLP (bf16)");
}
