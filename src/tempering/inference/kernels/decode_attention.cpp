// One-token (decode) attention over the engine's slot cache, in bf16 with fp32 accumulation, for CPUs with
// AVX512-BF16 (built at first use by `tempering.inference.kernels`; see its docstring for why it exists).
//
// q (B, Hkv, G, D) (unit stride in D): the G query heads of each key/value head; k, v (B, Hkv, W, D) views of the cache
// (unit stride in D); lengths (B,): row b attends to its positions [0, lengths[b]). Scores are exact bf16
// products summed in fp32 (_mm512_dpbf16_ps), the softmax and the weighted sum of values in fp32, the output
// rounded to bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

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

// One (row, key head): G queries against n keys and values of D (a multiple of 32) bf16 each.
static void attend(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs,
                   int64_t n, int64_t G, int64_t D, float scale, float* scores, uint16_t* out) {
  if (n <= 0) {  // nothing to attend to: zeros (the engine never asks; kept defined)
    std::fill(out, out + G * D, uint16_t(0));
    return;
  }
  const int64_t C = D / 32;  // 512-bit chunks of bf16
  __m512i qv[16 * 4];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) qv[g * C + c] = _mm512_loadu_si512(q + g * qs + c * 32);
  float m[16];
  for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* kr = k + j * ks;
    __m512i kv[4];
    for (int64_t c = 0; c < C; ++c) kv[c] = _mm512_loadu_si512(kr + c * 32);
    for (int64_t g = 0; g < G; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) s = _mm512_dpbf16_ps(s, (__m512bh)qv[g * C + c], (__m512bh)kv[c]);
      const float x = _mm512_reduce_add_ps(s) * scale;
      scores[g * n + j] = x;
      m[g] = std::max(m[g], x);
    }
  }
  float inv[16];
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    const __m512 mv = _mm512_set1_ps(m[g]);
    __m512 tv = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
      _mm512_storeu_ps(s + j, e); tv = _mm512_add_ps(tv, e);
    }
    if (j < n) {
      const __mmask16 r = (__mmask16)((1u << (n - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(r, s + j), mv));
      _mm512_mask_storeu_ps(s + j, r, e); tv = _mm512_add_ps(tv, _mm512_maskz_mov_ps(r, e));
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(tv);
  }
  const int64_t F = D / 16;  // 512-bit chunks of fp32
  __m512 a[16 * 8];
  for (int64_t i = 0; i < G * F; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* vr = v + j * vs;
    for (int64_t f = 0; f < F; ++f) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + f * 16));
      __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      for (int64_t g = 0; g < G; ++g) a[g * F + f] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + j]), x, a[g * F + f]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t f = 0; f < F; ++f) {
      __m512 x = _mm512_mul_ps(a[g * F + f], _mm512_set1_ps(inv[g]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + f * 16), (__m256i)_mm512_cvtneps_pbh(x));
    }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "decode_attention: q, k and v must be bf16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
              q.size(1) == k.size(1) && q.size(3) == k.size(3), "decode_attention: q (B, H, G, D), k and v (B, H, W, D)");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: unit stride in D");
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
      attend(qp + b * q.stride(0) + h * q.stride(1), q.stride(2), kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
             vp + b * v.stride(0) + h * v.stride(1), v.stride(2), n, G, D, float(scale), scores.data(), op + bh * G * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "One-token attention over the slot cache (bf16, AVX512-BF16)");
}
