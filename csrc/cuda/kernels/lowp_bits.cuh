/* The 16-bit float conversions of the low-precision entries (lowp.cu, quant.cu), private:
 * written out on uint16_t (no cuda_fp16.h / cuda_bf16.h types) and __host__ __device__, so
 * csrc/tests/cuda_emu runs this very code on the host and the results match core/dtype.c's
 * tp_float_to_half / tp_float_to_bf16 (and so the CPU table) bit for bit: round to nearest
 * even, NaN kept quiet with its sign, past the largest finite value infinity, float16
 * subnormals kept.  No float arithmetic is used, so flush-to-zero settings cannot touch a
 * subnormal. */
#ifndef TPCORE_KERNELS_CUDA_LOWP_BITS_CUH
#define TPCORE_KERNELS_CUDA_LOWP_BITS_CUH

#include <stdint.h>
#include <string.h>

#include "common.cuh"

static __host__ __device__ inline uint32_t tpk_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static __host__ __device__ inline float tpk_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* bfloat16 is the top half of a float32: widening is exact. */
static __host__ __device__ inline float tpk_bf16_to_f32(uint16_t h) { return tpk_float((uint32_t)h << 16); }

static __host__ __device__ inline uint16_t tpk_f32_to_bf16(float f) {
  uint32_t u = tpk_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN: set the quiet bit */
  /* Round to nearest even on the 16 bits dropped: a carry out of the mantissa bumps the
   * exponent, and out of the largest finite value gives infinity's bits. */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static __host__ __device__ inline float tpk_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return tpk_float(sign | 0x7f800000u | (man << 13)); /* inf, NaN (payload kept) */
  if (exp == 0) {
    if (man == 0) return tpk_float(sign);
    /* subnormal man 2^-24: normalise it into a float32 normal, by bits */
    uint32_t e = 113u; /* 127 - 14: the exponent once bit 10 is reached */
    while (!(man & 0x400u)) {
      man <<= 1;
      e--;
    }
    return tpk_float(sign | (e << 23) | ((man & 0x3ffu) << 13));
  }
  return tpk_float(sign | ((exp + 112u) << 23) | (man << 13)); /* rebias 15 -> 127 */
}

static __host__ __device__ inline uint16_t tpk_f32_to_f16(float f) {
  uint32_t u = tpk_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN: quiet, top payload */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* |f| >= 65520 (or inf): rounds to infinity */
  if (a >= 0x38800000u) {                                  /* a float16 normal: |f| >= 2^-14 */
    a += 0x0fffu + ((a >> 13) & 1u);                       /* nearest even on the 13 dropped bits */
    return (uint16_t)(sign | ((a - (112u << 23)) >> 13));  /* rebias 127 -> 15 */
  }
  if (a < 0x33000000u) return sign; /* |f| <= 2^-25 rounds to zero (2^-25 itself: the even one) */
  /* a float16 subnormal, in units of 2^-24: the full mantissa shifted right by 14..24 */
  uint32_t man = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - (a >> 23);
  uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  q += rem > half || (rem == half && (q & 1u)); /* may reach 0x400, the smallest normal: right */
  return (uint16_t)(sign | q);
}

#endif
