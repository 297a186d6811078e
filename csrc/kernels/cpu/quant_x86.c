/* The x86 kernels of quant.c (quant_impl.h): the dot products (AVX-512F, AVX2 + FMA + F16C) of
 * each format with float32 x, the row dequantized in registers, and the block dequantizers at
 * those levels, bit for bit as the scalar ones.  quant.c picks among them (and its portable
 * ones) through tp_q_x86_kernels. */
#include <string.h>

#include "../../core/core_impl.h"
#include "quant_x86.h"

#if TP_Q_X86
#include <immintrin.h>

/* ------------------------------------------------------------------ SIMD dot kernels */

/* Each format supplies, per ISA, PREP (the per-block values: scales, lookup tables) and
 * CHUNK (CE consecutive elements of the block dequantized into NVC vectors, in registers).
 * The drivers below multiply the vectors into accumulators: dot1 into four (two chunks in
 * flight when a chunk is two vectors), dot4 into two per row of x.  The order of every sum
 * depends on K only. */

#define T512 __attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) static inline
/* the loops over a chunk's vectors, rows of x, halves: unrolled at any -O (registers, not arrays) */
#define UNROLL _Pragma("GCC unroll 8")
#define T256 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Q4_K / Q5_K: the 6-bit codes of a super-block as eight bytes each (see quant.c's get_scale_min). */
static inline void unpack_k_scales(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
  uint32_t s0, s1, s2;
  memcpy(&s0, s, 4), memcpy(&s1, s + 4, 4), memcpy(&s2, s + 8, 4);
  uint32_t sc_lo = s0 & 0x3f3f3f3fu, mn_lo = s1 & 0x3f3f3f3fu;
  uint32_t sc_hi = (s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u);
  uint32_t mn_hi = ((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u);
  *sc = sc_lo | (uint64_t)sc_hi << 32, *mn = mn_lo | (uint64_t)mn_hi << 32;
}

/* D[s] = d sc_s, M[s] = dmin mn_s of a Q4_K / Q5_K super-block (as the dequantizer rounds them). */
__attribute__((target("avx2,fma,f16c"))) static inline void k_scales_256(const uint8_t *b, float D[8], float M[8]) {
  uint64_t sc, mn;
  unpack_k_scales(b + 4, &sc, &mn);
  __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
  __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
  __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(b[0] | b[1] << 8 | b[2] << 16 | (uint32_t)b[3] << 24)));
  _mm256_storeu_ps(D, _mm256_mul_ps(_mm256_broadcastss_ps(dd), fs));
  _mm256_storeu_ps(M, _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_set1_epi32(1)), fm));
}

__attribute__((target("avx2,fma,f16c"))) static inline void q6_scales_256(const uint8_t *b, float D[16], float N[16]) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[208] | b[209] << 8)));
  UNROLL for (int h = 0; h < 2; h++) {
    __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h))));
    __m256 v = _mm256_mul_ps(d, s);
    _mm256_storeu_ps(D + 8 * h, v);
    _mm256_storeu_ps(N + 8 * h, _mm256_mul_ps(v, _mm256_set1_ps(-32.0f))); /* exact */
  }
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* ---------------------------------------------- AVX-512F: 16 lanes; 4-bit codes index a
 * 16-entry table of the block's values (vpermps uses the low 4 bits of each index) */

typedef struct {
  __m512 t;
  float D[16], M[16];
  __m512i h0, h1;
} p512;

#define IOTA512 _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define LD128(p) _mm_loadu_si128((const __m128i *)(p))

T512 void q8_0_prep512(const uint8_t *b, p512 *p) { p->t = _mm512_set1_ps(_cvtsh_ss(rd16(b))); }
T512 void q8_0_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  (void)c;
  w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(b + 2))), p->t);
  w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(b + 18))), p->t);
}

T512 void q4_0_prep512(const uint8_t *b, p512 *p) {
  p->t = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(rd16(b))), _mm512_sub_ps(IOTA512, _mm512_set1_ps(8)));
}
T512 void q4_0_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  (void)c;
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 2));
  w[0] = _mm512_permutexvar_ps(q, p->t);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), p->t);
}

T512 void q4_1_prep512(const uint8_t *b, p512 *p) {
  p->t = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(rd16(b))), IOTA512, _mm512_set1_ps(_cvtsh_ss(rd16(b + 2))));
}
T512 void q4_1_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  (void)c;
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 4));
  w[0] = _mm512_permutexvar_ps(q, p->t);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), p->t);
}

T512 void q4_k_prep512(const uint8_t *b, p512 *p) { k_scales_256(b, p->D, p->M); }
/* chunk c: sub-blocks 2c (low nibbles of qs[32c..32c+31]) and 2c+1 (high nibbles) */
T512 void q4_k_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[4]) {
  __m512 t0 = _mm512_fmsub_ps(_mm512_set1_ps(p->D[2 * c]), IOTA512, _mm512_set1_ps(p->M[2 * c]));
  __m512 t1 = _mm512_fmsub_ps(_mm512_set1_ps(p->D[2 * c + 1]), IOTA512, _mm512_set1_ps(p->M[2 * c + 1]));
  __m512i qa = _mm512_cvtepu8_epi32(LD128(b + 16 + 32 * c)), qb = _mm512_cvtepu8_epi32(LD128(b + 32 + 32 * c));
  w[0] = _mm512_permutexvar_ps(qa, t0), w[1] = _mm512_permutexvar_ps(qb, t0);
  w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(qa, 4), t1),
  w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(qb, 4), t1);
}

T512 void q5_k_prep512(const uint8_t *b, p512 *p) {
  k_scales_256(b, p->D, p->M);
  p->h0 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(LD128(b + 16)), 4); /* bit s of qh at bit 4 + s */
  p->h1 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(LD128(b + 32)), 4);
}
/* 5-bit codes: bit 4 of the index (vpermt2ps's table select) from qh, 0xD8 = (C ? B : A) */
T512 void q5_k_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[4]) {
  const __m512i bit4 = _mm512_set1_epi32(16);
  const __m512 iota16 = _mm512_add_ps(IOTA512, _mm512_set1_ps(16));
  UNROLL for (int h = 0; h < 2; h++) {
    int s = 2 * c + h;
    __m512 D = _mm512_set1_ps(p->D[s]), M = _mm512_set1_ps(p->M[s]);
    __m512 lo = _mm512_fmsub_ps(D, IOTA512, M), hi = _mm512_fmsub_ps(D, iota16, M);
    __m512i qa = _mm512_cvtepu8_epi32(LD128(b + 48 + 32 * c)), qb = _mm512_cvtepu8_epi32(LD128(b + 64 + 32 * c));
    if (h) qa = _mm512_srli_epi32(qa, 4), qb = _mm512_srli_epi32(qb, 4);
    __m128i cnt = _mm_cvtsi32_si128(s);
    __m512i ia = _mm512_ternarylogic_epi32(qa, _mm512_srl_epi32(p->h0, cnt), bit4, 0xD8);
    __m512i ib = _mm512_ternarylogic_epi32(qb, _mm512_srl_epi32(p->h1, cnt), bit4, 0xD8);
    w[2 * h] = _mm512_permutex2var_ps(lo, ia, hi), w[2 * h + 1] = _mm512_permutex2var_ps(lo, ib, hi);
  }
}

T512 void q6_k_prep512(const uint8_t *b, p512 *p) { q6_scales_256(b, p->D, p->M); }
/* chunk c: elements 32c..32c+31 (h = c / 4, i = c % 4 of the layout), sub-blocks 2c, 2c+1 */
T512 void q6_k_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  int h = c >> 2, i = c & 3;
  const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
  __m128i cnt = _mm_cvtsi32_si128(2 * i);
  const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
  UNROLL for (int v = 0; v < 2; v++) {
    __m512i l = _mm512_cvtepu8_epi32(LD128(ql + 16 * v));
    l = (i & 2) ? _mm512_srli_epi32(l, 4) : _mm512_and_si512(l, m15);
    __m512i hb = _mm512_srl_epi32(_mm512_slli_epi32(_mm512_cvtepu8_epi32(LD128(qh + 16 * v)), 4), cnt);
    __m512 q = _mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(l, hb, m48, 0xF8)); /* A | (B & C) */
    w[v] = _mm512_fmadd_ps(_mm512_set1_ps(p->D[2 * c + v]), q, _mm512_set1_ps(p->M[2 * c + v]));
  }
}

/* ---------------------------------------------- AVX2 + FMA + F16C: 8 lanes, codes converted */

typedef struct {
  __m256 t, u;
  float D[16], M[16];
} p256;

#define LD64(p) _mm_loadl_epi64((const __m128i *)(p))
#define U8X8(p) _mm256_cvtepu8_epi32(LD64(p))

T256 void q8_0_prep256(const uint8_t *b, p256 *p) { p->t = _mm256_set1_ps(_cvtsh_ss(rd16(b))); }
T256 void q8_0_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  (void)c;
  UNROLL for (int v = 0; v < 4; v++) w[v] =
      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(b + 2 + 8 * v))), p->t);
}

/* 4-bit blocks: w = t q + u */
T256 void nib32_chunk256(const uint8_t *qs, const p256 *p, __m256 w[4]) {
  const __m256i m15 = _mm256_set1_epi32(15);
  __m256i qa = U8X8(qs), qb = U8X8(qs + 8);
  w[0] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_and_si256(qa, m15)), p->u);
  w[1] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_and_si256(qb, m15)), p->u);
  w[2] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4)), p->u);
  w[3] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4)), p->u);
}

T256 void q4_0_prep256(const uint8_t *b, p256 *p) {
  float d = _cvtsh_ss(rd16(b));
  p->t = _mm256_set1_ps(d), p->u = _mm256_set1_ps(-8.0f * d);
}
T256 void q4_0_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) { (void)c, nib32_chunk256(b + 2, p, w); }

T256 void q4_1_prep256(const uint8_t *b, p256 *p) {
  p->t = _mm256_set1_ps(_cvtsh_ss(rd16(b))), p->u = _mm256_set1_ps(_cvtsh_ss(rd16(b + 2)));
}
T256 void q4_1_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) { (void)c, nib32_chunk256(b + 4, p, w); }

T256 void q4_k_prep256(const uint8_t *b, p256 *p) { k_scales_256(b, p->D, p->M); }
/* chunk c: sub-block c (nibble c % 2 of qs[32 (c / 2) ...]) */
T256 void q4_k_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  const __m256i m15 = _mm256_set1_epi32(15);
  __m256 D = _mm256_set1_ps(p->D[c]), M = _mm256_set1_ps(p->M[c]);
  UNROLL for (int v = 0; v < 4; v++) {
    __m256i q = U8X8(b + 16 + 32 * (c >> 1) + 8 * v);
    q = (c & 1) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, m15);
    w[v] = _mm256_fmsub_ps(D, _mm256_cvtepi32_ps(q), M);
  }
}

T256 void q5_k_prep256(const uint8_t *b, p256 *p) { k_scales_256(b, p->D, p->M); }
T256 void q5_k_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  const __m256i m15 = _mm256_set1_epi32(15), bit4 = _mm256_set1_epi32(16);
  __m256 D = _mm256_set1_ps(p->D[c]), M = _mm256_set1_ps(p->M[c]);
  __m128i cnt = _mm_cvtsi32_si128(c);
  UNROLL for (int v = 0; v < 4; v++) {
    __m256i q = U8X8(b + 48 + 32 * (c >> 1) + 8 * v);
    q = (c & 1) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, m15);
    __m256i hb = _mm256_and_si256(_mm256_srl_epi32(_mm256_slli_epi32(U8X8(b + 16 + 8 * v), 4), cnt), bit4);
    w[v] = _mm256_fmsub_ps(D, _mm256_cvtepi32_ps(_mm256_or_si256(q, hb)), M);
  }
}

T256 void q6_k_prep256(const uint8_t *b, p256 *p) { q6_scales_256(b, p->D, p->M); }
T256 void q6_k_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  int h = c >> 2, i = c & 3;
  const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
  __m128i cnt = _mm_cvtsi32_si128(2 * i);
  const __m256i m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
  UNROLL for (int v = 0; v < 4; v++) {
    __m256i l = U8X8(ql + 8 * v);
    l = (i & 2) ? _mm256_srli_epi32(l, 4) : _mm256_and_si256(l, m15);
    __m256i hb = _mm256_and_si256(_mm256_srl_epi32(_mm256_slli_epi32(U8X8(qh + 8 * v), 4), cnt), m48);
    __m256 q = _mm256_cvtepi32_ps(_mm256_or_si256(l, hb));
    w[v] = _mm256_fmadd_ps(_mm256_set1_ps(p->D[2 * c + v / 2]), q, _mm256_set1_ps(p->M[2 * c + v / 2]));
  }
}

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

/* The drivers: BLK elements and BB bytes a block, CE elements (NVC vectors) a chunk. */
#define TP_Q_DRIVERS_(NAME, ISA, TARGET, VEC, PT, LANES, ZERO, FMA, ADD, LOADX, HSUM, BLK, BB, CE)                \
  __attribute__((target(TARGET))) static float dot1_##NAME##_##ISA(const void *row, const float *x, int64_t K) {  \
    enum { NVC = (CE) / (LANES), CPB = (BLK) / (CE) };                                                            \
    const uint8_t *r = row;                                                                                       \
    VEC acc[4] = {ZERO, ZERO, ZERO, ZERO}, w[NVC];                                                                \
    PT p;                                                                                                         \
    int64_t nch = K / (CE), g = 0;                                                                                \
    for (; g + 2 <= nch; g += 2) {                                                                                \
      const uint8_t *b = r + (size_t)(g / CPB) * (BB);                                                            \
      const float *xg = x + g * (CE);                                                                             \
      if (g % CPB == 0) NAME##_prep##ISA(b, &p);                                                                  \
      NAME##_chunk##ISA(b, &p, (int)(g % CPB), w);                                                                \
      UNROLL for (int v = 0; v < NVC; v++) acc[v & 3] = FMA(w[v], LOADX(xg + v * (LANES)), acc[v & 3]);           \
      if (CPB == 1) b += (BB), NAME##_prep##ISA(b, &p);                                                           \
      NAME##_chunk##ISA(b, &p, (int)((g + 1) % CPB), w);                                                          \
      UNROLL for (int v = 0; v < NVC; v++) acc[(v + NVC) & 3] =                                                   \
          FMA(w[v], LOADX(xg + (CE) + v * (LANES)), acc[(v + NVC) & 3]);                                          \
    }                                                                                                             \
    if (g < nch) {                                                                                                \
      const uint8_t *b = r + (size_t)(g / CPB) * (BB);                                                            \
      if (g % CPB == 0) NAME##_prep##ISA(b, &p);                                                                  \
      NAME##_chunk##ISA(b, &p, (int)(g % CPB), w);                                                                \
      UNROLL for (int v = 0; v < NVC; v++) acc[v & 3] = FMA(w[v], LOADX(x + g * (CE) + v * (LANES)), acc[v & 3]); \
    }                                                                                                             \
    return HSUM(ADD(ADD(acc[0], acc[1]), ADD(acc[2], acc[3])));                                                   \
  }                                                                                                               \
  __attribute__((target(TARGET))) static void dot4_##NAME##_##ISA(float out[4], const void *row,                  \
                                                                  const float *const x[4], int64_t K) {           \
    enum { NVC = (CE) / (LANES), CPB = (BLK) / (CE) };                                                            \
    const uint8_t *r = row;                                                                                       \
    VEC acc[4][2] = {{ZERO, ZERO}, {ZERO, ZERO}, {ZERO, ZERO}, {ZERO, ZERO}}, w[NVC];                             \
    PT p;                                                                                                         \
    int64_t nch = K / (CE);                                                                                       \
    for (int64_t g = 0; g < nch; g++) {                                                                           \
      const uint8_t *b = r + (size_t)(g / CPB) * (BB);                                                            \
      if (g % CPB == 0) NAME##_prep##ISA(b, &p);                                                                  \
      NAME##_chunk##ISA(b, &p, (int)(g % CPB), w);                                                                \
      UNROLL for (int v = 0; v < NVC; v++) UNROLL for (int j = 0; j < 4; j++) acc[j][v & 1] =                     \
          FMA(w[v], LOADX(x[j] + g * (CE) + v * (LANES)), acc[j][v & 1]);                                         \
    }                                                                                                             \
    UNROLL for (int j = 0; j < 4; j++) out[j] = HSUM(ADD(acc[j][0], acc[j][1]));                                  \
  }

#define TP_Q512_(NAME, BLK, BB, CE)                                                                         \
  TP_Q_DRIVERS_(NAME, 512, "avx512f,avx2,fma,f16c", __m512, p512, 16, _mm512_setzero_ps(), _mm512_fmadd_ps, \
                _mm512_add_ps, _mm512_loadu_ps, _mm512_reduce_add_ps, BLK, BB, CE)
#define TP_Q256_(NAME, BLK, BB, CE)                                                                               \
  TP_Q_DRIVERS_(NAME, 256, "avx2,fma,f16c", __m256, p256, 8, _mm256_setzero_ps(), _mm256_fmadd_ps, _mm256_add_ps, \
                _mm256_loadu_ps, hsum256, BLK, BB, CE)
TP_Q512_(q8_0, 32, 34, 32)
TP_Q512_(q4_0, 32, 18, 32)
TP_Q512_(q4_1, 32, 20, 32)
TP_Q512_(q4_k, 256, 144, 64)
TP_Q512_(q5_k, 256, 176, 64)
TP_Q512_(q6_k, 256, 210, 32)
TP_Q256_(q8_0, 32, 34, 32)
TP_Q256_(q4_0, 32, 18, 32)
TP_Q256_(q4_1, 32, 20, 32)
TP_Q256_(q4_k, 256, 144, 32)
TP_Q256_(q5_k, 256, 176, 32)
TP_Q256_(q6_k, 256, 210, 32)
#undef TP_Q512_
#undef TP_Q256_
#undef TP_Q_DRIVERS_

/* int8 rows: any K; 64 elements per step into four accumulators, then 16 (8) at a time, then
 * one at a time; the row's scale multiplies the sum. */
__attribute__((target("avx512f,avx2,fma,f16c"))) static float dot1_int8_512(const void *row, const float *x,
                                                                            int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    UNROLL for (int v = 0; v < 4; v++) a[v] = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k + 16 * v))), _mm512_loadu_ps(x + k + 16 * v), a[v]);
  for (; k + 16 <= K; k += 16)
    a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k))), _mm512_loadu_ps(x + k), a[0]);
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  for (; k < K; k++) s += x[k] * (float)q[k];
  return s * int8_row_scale(row);
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void dot4_int8_512(float out[4], const void *row,
                                                                           const float *const x[4], int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m512 a[4][2];
  UNROLL for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) UNROLL for (int v = 0; v < 2; v++) {
      __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k + 16 * v)));
      UNROLL for (int j = 0; j < 4; j++) a[j][v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[j] + k + 16 * v), a[j][v]);
    }
  for (; k + 16 <= K; k += 16) {
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k)));
    UNROLL for (int j = 0; j < 4; j++) a[j][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[j] + k), a[j][0]);
  }
  float s[4];
  UNROLL for (int j = 0; j < 4; j++) s[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j][0], a[j][1]));
  for (; k < K; k++) UNROLL for (int j = 0; j < 4; j++) s[j] += x[j][k] * (float)q[k];
  UNROLL for (int j = 0; j < 4; j++) out[j] = s[j] * int8_row_scale(row);
}

__attribute__((target("avx2,fma,f16c"))) static float dot1_int8_256(const void *row, const float *x, int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    UNROLL for (int v = 0; v < 4; v++) a[v] = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k + 8 * v))), _mm256_loadu_ps(x + k + 8 * v), a[v]);
  for (; k + 8 <= K; k += 8)
    a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k))), _mm256_loadu_ps(x + k), a[0]);
  float s = hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
  for (; k < K; k++) s += x[k] * (float)q[k];
  return s * int8_row_scale(row);
}

__attribute__((target("avx2,fma,f16c"))) static void dot4_int8_256(float out[4], const void *row,
                                                                   const float *const x[4], int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m256 a[4][2];
  UNROLL for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) UNROLL for (int v = 0; v < 2; v++) {
      __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k + 8 * v)));
      UNROLL for (int j = 0; j < 4; j++) a[j][v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + k + 8 * v), a[j][v]);
    }
  for (; k + 8 <= K; k += 8) {
    __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k)));
    UNROLL for (int j = 0; j < 4; j++) a[j][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + k), a[j][0]);
  }
  float s[4];
  UNROLL for (int j = 0; j < 4; j++) s[j] = hsum256(_mm256_add_ps(a[j][0], a[j][1]));
  for (; k < K; k++) UNROLL for (int j = 0; j < 4; j++) s[j] += x[j][k] * (float)q[k];
  UNROLL for (int j = 0; j < 4; j++) out[j] = s[j] * int8_row_scale(row);
}
/* ------------------------------------------------------------------ SIMD dequantization */

/* The dequantizers again, 16 / 8 elements at a time: the same float32 products and sums as
 * the scalar ones (each product rounded before its sum: NOFUSEV), so bit for bit equal to
 * them and to gguf-py (test_kernels_quant.c checks every level against the scalar one). */
#define NOFUSEV(v) __asm__("" : "+v"(v))

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q8_0(float *y, const uint8_t *b) {
  __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
  UNROLL for (int v = 0; v < 2; v++)
      _mm512_storeu_ps(y + 16 * v, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(b + 2 + 16 * v))), d));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q4_0(float *y, const uint8_t *b) {
  __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 2)), eight = _mm512_set1_epi32(8);
  __m512i lo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(15)), eight);
  __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
  _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q4_1(float *y, const uint8_t *b) {
  __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b))), m = _mm512_set1_ps(_cvtsh_ss(rd16(b + 2)));
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 4));
  __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))));
  __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)));
  NOFUSEV(lo);
  NOFUSEV(hi);
  _mm512_storeu_ps(y, _mm512_add_ps(lo, m));
  _mm512_storeu_ps(y + 16, _mm512_add_ps(hi, m));
}

/* Q4_K / Q5_K: 16 elements of sub-block s from their codes */
__attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) static inline void kstore512(float *y, __m512i q,
                                                                                             float D, float DM) {
  __m512 v = _mm512_mul_ps(_mm512_set1_ps(D), _mm512_cvtepi32_ps(q));
  NOFUSEV(v);
  _mm512_storeu_ps(y, _mm512_sub_ps(v, _mm512_set1_ps(DM)));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q4_k(float *y, const uint8_t *b) {
  float D[8], M[8];
  k_scales_256(b, D, M);
  const __m512i m15 = _mm512_set1_epi32(15);
  UNROLL for (int i = 0; i < 4; i++) {
    __m512i qa = _mm512_cvtepu8_epi32(LD128(b + 16 + 32 * i)), qb = _mm512_cvtepu8_epi32(LD128(b + 32 + 32 * i));
    kstore512(y + 64 * i, _mm512_and_si512(qa, m15), D[2 * i], M[2 * i]);
    kstore512(y + 64 * i + 16, _mm512_and_si512(qb, m15), D[2 * i], M[2 * i]);
    kstore512(y + 64 * i + 32, _mm512_srli_epi32(qa, 4), D[2 * i + 1], M[2 * i + 1]);
    kstore512(y + 64 * i + 48, _mm512_srli_epi32(qb, 4), D[2 * i + 1], M[2 * i + 1]);
  }
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q5_k(float *y, const uint8_t *b) {
  float D[8], M[8];
  k_scales_256(b, D, M);
  const __m512i m15 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
  __m512i h[2] = {_mm512_cvtepu8_epi32(LD128(b + 16)), _mm512_cvtepu8_epi32(LD128(b + 32))};
  for (int s = 0; s < 8; s++) {
    __m128i cnt = _mm_cvtsi32_si128(s);
    UNROLL for (int v = 0; v < 2; v++) {
      __m512i q = _mm512_cvtepu8_epi32(LD128(b + 48 + 32 * (s / 2) + 16 * v));
      q = (s & 1) ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, m15);
      q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h[v], cnt), one), 4));
      kstore512(y + 32 * s + 16 * v, q, D[s], M[s]);
    }
  }
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q6_k(float *y, const uint8_t *b) {
  float D[16], N[16];
  q6_scales_256(b, D, N);
  const __m512i m15 = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), k32 = _mm512_set1_epi32(32);
  UNROLL for (int h = 0; h < 2; h++) UNROLL for (int v = 0; v < 2; v++) {
    __m512i qh = _mm512_cvtepu8_epi32(LD128(b + 128 + 32 * h + 16 * v));
    __m512i la = _mm512_cvtepu8_epi32(LD128(b + 64 * h + 16 * v));      /* i = 0, 2 */
    __m512i lb = _mm512_cvtepu8_epi32(LD128(b + 64 * h + 32 + 16 * v)); /* i = 1, 3 */
    UNROLL for (int i = 0; i < 4; i++) {
      __m512i l = (i & 1) ? lb : la;
      l = (i & 2) ? _mm512_srli_epi32(l, 4) : _mm512_and_si512(l, m15);
      __m512i hb = _mm512_and_si512(_mm512_srl_epi32(qh, _mm_cvtsi32_si128(2 * i)), three);
      __m512i q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(hb, 4)), k32);
      int n = 128 * h + 32 * i + 16 * v;
      _mm512_storeu_ps(y + n, _mm512_mul_ps(_mm512_set1_ps(D[n / 16]), _mm512_cvtepi32_ps(q)));
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q8_0(float *y, const uint8_t *b) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b)));
  UNROLL for (int v = 0; v < 4; v++)
      _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(b + 2 + 8 * v))), d));
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q4_0(float *y, const uint8_t *b) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b)));
  const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  UNROLL for (int v = 0; v < 2; v++) {
    __m256i q = U8X8(b + 2 + 8 * v);
    __m256i lo = _mm256_sub_epi32(_mm256_and_si256(q, m15), eight),
            hi = _mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight);
    _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
    _mm256_storeu_ps(y + 16 + 8 * v, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
  }
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q4_1(float *y, const uint8_t *b) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b))), m = _mm256_set1_ps(_cvtsh_ss(rd16(b + 2)));
  const __m256i m15 = _mm256_set1_epi32(15);
  UNROLL for (int v = 0; v < 2; v++) {
    __m256i q = U8X8(b + 4 + 8 * v);
    __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, m15)));
    __m256 hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)));
    NOFUSEV(lo);
    NOFUSEV(hi);
    _mm256_storeu_ps(y + 8 * v, _mm256_add_ps(lo, m));
    _mm256_storeu_ps(y + 16 + 8 * v, _mm256_add_ps(hi, m));
  }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void kstore256(float *y, __m256i q, float D,
                                                                                     float DM) {
  __m256 v = _mm256_mul_ps(_mm256_set1_ps(D), _mm256_cvtepi32_ps(q));
  NOFUSEV(v);
  _mm256_storeu_ps(y, _mm256_sub_ps(v, _mm256_set1_ps(DM)));
}

/* Q4_K (qh NULL) and Q5_K: sub-block s, 8 elements at a time */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void deq256_k(float *y, const uint8_t *b,
                                                                                    const uint8_t *qs,
                                                                                    const uint8_t *qh) {
  float D[8], M[8];
  k_scales_256(b, D, M);
  const __m256i m15 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  for (int s = 0; s < 8; s++) {
    __m128i cnt = _mm_cvtsi32_si128(s);
    UNROLL for (int v = 0; v < 4; v++) {
      __m256i q = U8X8(qs + 32 * (s / 2) + 8 * v);
      q = (s & 1) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, m15);
      if (qh)
        q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(U8X8(qh + 8 * v), cnt), one), 4));
      kstore256(y + 32 * s + 8 * v, q, D[s], M[s]);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q4_k(float *y, const uint8_t *b) {
  deq256_k(y, b, b + 16, NULL);
}
__attribute__((target("avx2,fma,f16c"))) static void deq256_q5_k(float *y, const uint8_t *b) {
  deq256_k(y, b, b + 48, b + 16);
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q6_k(float *y, const uint8_t *b) {
  float D[16], N[16];
  q6_scales_256(b, D, N);
  const __m256i m15 = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
  UNROLL for (int h = 0; h < 2; h++) UNROLL for (int v = 0; v < 4; v++) {
    __m256i qh = U8X8(b + 128 + 32 * h + 8 * v), la = U8X8(b + 64 * h + 8 * v), lb = U8X8(b + 64 * h + 32 + 8 * v);
    UNROLL for (int i = 0; i < 4; i++) {
      __m256i l = (i & 1) ? lb : la;
      l = (i & 2) ? _mm256_srli_epi32(l, 4) : _mm256_and_si256(l, m15);
      __m256i hb = _mm256_and_si256(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(2 * i)), three);
      __m256i q = _mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(hb, 4)), k32);
      int n = 128 * h + 32 * i + 8 * v;
      _mm256_storeu_ps(y + n, _mm256_mul_ps(_mm256_set1_ps(D[n / 16]), _mm256_cvtepi32_ps(q)));
    }
  }
}
#undef NOFUSEV

/* [format][level - 1] of this file's kernels: level 1 AVX2 + FMA + F16C, 2 AVX-512F. */
#define KERNELS_(N)                                                                              \
  {                                                                                              \
    {dot1_##N##_256, dot4_##N##_256, deq256_##N}, { dot1_##N##_512, dot4_##N##_512, deq512_##N } \
  }
#define KERNELS_INT8_                                                            \
  {                                                                              \
    {dot1_int8_256, dot4_int8_256, NULL}, { dot1_int8_512, dot4_int8_512, NULL } \
  }
static const tp_q_x86 X86[TP_WEIGHT_FORMAT_END][2] = {
    [TP_INT8] = KERNELS_INT8_,  [TP_Q8_0] = KERNELS_(q8_0), [TP_Q4_0] = KERNELS_(q4_0), [TP_Q4_1] = KERNELS_(q4_1),
    [TP_Q4_K] = KERNELS_(q4_k), [TP_Q5_K] = KERNELS_(q5_k), [TP_Q6_K] = KERNELS_(q6_k),
};
#undef KERNELS_
#undef KERNELS_INT8_

const tp_q_x86 *tp_q_x86_kernels(tp_dtype_t f, int isa) {
  return f >= 0 && f < TP_WEIGHT_FORMAT_END && isa >= 1 && isa <= 2 ? &X86[f][isa - 1] : NULL;
}
#endif
