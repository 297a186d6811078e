/* Branch-free float math that GCC vectorizes, shared by the CPU kernels (private). */
#ifndef TPCORE_KERNELS_CPU_VMATH_H
#define TPCORE_KERNELS_CPU_VMATH_H

/* These kernels never rely on floating-point traps: let GCC turn the selects in
 * fexp/ferf into blends so that every loop vectorizes (measured: 17 loops). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <math.h>
#include <stdint.h>

/* The package is built for the baseline x86-64 (SSE2, 4 floats per instruction);
 * the hot element-wise loops are compiled again for AVX2 and AVX-512F and
 * picked at load time for the CPU at hand (GCC function multiversioning, an ifunc).  ISA names, not arch=: with
 * arch=haswell GCC 12 did not vectorize the loops that call fexp at all. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(TP_NO_CLONES) && \
    !defined(__SANITIZE_ADDRESS__)
#define TP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TP_VECTOR_CLONES
#endif

#define SQRT_2_OVER_PI 0.7978845608028654f
#define INV_SQRT_2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

/* Branch-free exp and erf that the compiler vectorizes (the libm calls it cannot
 * vectorize made GELU ~19% of an MLP step).  exp: x = k ln2 + r with |r| <= ln2/2
 * (Cody-Waite split of ln2), a degree-6 polynomial for e^r, 2^k put into the
 * exponent bits; relative error ~1e-7 on [-87, 88].  erf: Abramowitz & Stegun
 * 7.1.26, |error| <= 1.5e-7. */
static inline float fexp(float x) {
  x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
  float kf = (x * 1.44269504089f + 12582912.0f) - 12582912.0f; /* round to nearest */
  float r = x - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
  float p =
      1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  union {
    int32_t i;
    float f;
  } u;
  u.i = ((int32_t)kf + 127) << 23;
  return p * u.f;
}

static inline float ferf(float x) {
  float ax = x < 0.0f ? -x : x;
  float t = 1.0f / (1.0f + 0.3275911f * ax);
  float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  float y = 1.0f - poly * fexp(-ax * ax);
  return x < 0.0f ? -y : y;
}

static inline float ftanh(float x) { return 1.0f - 2.0f / (fexp(2.0f * x) + 1.0f); }

static inline float sigmoidf(float x) { return 1.0f / (1.0f + fexp(-x)); }

#endif
