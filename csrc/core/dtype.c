#include <string.h>

#include "core_impl.h"

static const struct {
  const char *name;
  size_t size;
} tp_dtypes[TP_NUM_DTYPES] = {
    [TP_FLOAT32] = {"float32", 4},   [TP_FLOAT64] = {"float64", 8}, [TP_FLOAT16] = {"float16", 2},
    [TP_BFLOAT16] = {"bfloat16", 2}, [TP_INT8] = {"int8", 1},       [TP_UINT8] = {"uint8", 1},
    [TP_INT32] = {"int32", 4},       [TP_INT64] = {"int64", 8},
};

/* The weight formats past the tensor dtypes (names as gguf's GGMLQuantizationType, lower case). */
static const struct {
  const char *name;
  int64_t block;
  size_t bytes;
} tp_wformats[TP_WEIGHT_FORMAT_END - TP_Q8_0] = {
    [TP_Q8_0 - TP_Q8_0] = {"q8_0", 32, 34},   [TP_Q4_0 - TP_Q8_0] = {"q4_0", 32, 18},
    [TP_Q4_1 - TP_Q8_0] = {"q4_1", 32, 20},   [TP_Q4_K - TP_Q8_0] = {"q4_k", 256, 144},
    [TP_Q5_K - TP_Q8_0] = {"q5_k", 256, 176}, [TP_Q6_K - TP_Q8_0] = {"q6_k", 256, 210},
};

static int is_block_format(tp_dtype_t d) { return d >= TP_Q8_0 && d < TP_WEIGHT_FORMAT_END; }

int tp_weight_format(tp_dtype_t f, int64_t *block, size_t *block_bytes, size_t *row_header) {
  int64_t blk = 1;
  size_t bytes, hdr = 0;
  switch (f) {
    case TP_FLOAT32: bytes = 4; break;
    case TP_BFLOAT16:
    case TP_FLOAT16: bytes = 2; break;
    case TP_INT8: bytes = 1, hdr = 4; break;
    default:
      if (!is_block_format(f)) return 0;
      blk = tp_wformats[f - TP_Q8_0].block, bytes = tp_wformats[f - TP_Q8_0].bytes;
  }
  if (block) *block = blk;
  if (block_bytes) *block_bytes = bytes;
  if (row_header) *row_header = hdr;
  return 1;
}

int tp_weight_row_bytes(tp_dtype_t f, int64_t n, size_t *bytes) {
  int64_t blk;
  size_t bb, hdr, body;
  if (!tp_weight_format(f, &blk, &bb, &hdr) || n < 0 || n % blk) return 0;
  if (!tp_mul_size((size_t)(n / blk), bb, &body) || !tp_add_size(body, hdr, &body)) return 0;
  *bytes = body;
  return 1;
}

int tp_weight_is_quantized(tp_dtype_t f) { return f == TP_INT8 || is_block_format(f); }

size_t tp_dtype_size(tp_dtype_t d) { return ((unsigned)d < TP_NUM_DTYPES) ? tp_dtypes[d].size : 0; }

const char *tp_dtype_name(tp_dtype_t d) {
  if (is_block_format(d)) return tp_wformats[d - TP_Q8_0].name;
  return ((unsigned)d < TP_NUM_DTYPES) ? tp_dtypes[d].name : "invalid";
}

int tp_dtype_from_name(const char *name, tp_dtype_t *out) {
  for (int i = 0; i < TP_NUM_DTYPES; i++) {
    if (strcmp(name, tp_dtypes[i].name) == 0) {
      *out = (tp_dtype_t)i;
      return 1;
    }
  }
  for (int i = TP_Q8_0; i < TP_WEIGHT_FORMAT_END; i++) {
    if (strcmp(name, tp_wformats[i - TP_Q8_0].name) == 0) {
      *out = (tp_dtype_t)i;
      return 1;
    }
  }
  return 0;
}

static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float tp_bf16_to_float(uint16_t b) { return u2f((uint32_t)b << 16); }

uint16_t tp_float_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);                                           /* round to nearest even */
  return (uint16_t)(u >> 16);
}

float tp_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return u2f(sign | 0x7f800000u | (man << 13)); /* inf / nan */
  if (exp == 0) {
    if (man == 0) return u2f(sign);
    /* subnormal: man * 2^-24 */
    float v = (float)man * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t tp_float_to_half(float f) {
  uint32_t u = f2u(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) /* inf or nan */
    return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or 0 */
    if (a < 0x33000000u) return sign;                      /* below 2^-25: rounds to 0 */
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)(a >> 23); /* 14..24 */
    uint32_t half = 1u << (shift - 1);
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t res = man >> shift;
    if (rem > half || (rem == half && (res & 1u))) res++;
    return (uint16_t)(sign | res);
  }
  uint32_t res = ((a >> 13) - (112u << 10));
  uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (res & 1u))) res++;
  return (uint16_t)(sign | res);
}

int64_t tp_tensor_numel(const tp_tensor *t) {
  if (t->ndim < 0 || t->ndim > TP_MAX_DIMS) return -1; /* not a tensor: shape[] has TP_MAX_DIMS entries */
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    if (!tp_mul_count(n, t->shape[i], &n)) return -1; /* a negative dimension, or past int64 */
  return n;
}

int tp_tensor_is_contiguous(const tp_tensor *t) {
  if (t->ndim < 0 || t->ndim > TP_MAX_DIMS) return 0;
  if (tp_tensor_numel(t) == 0) return 1; /* no element to place (NumPy: an empty array is contiguous) */
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->strides[i] != expect) return 0;
    if (!tp_mul_count(expect, t->shape[i], &expect)) return 0; /* no such tensor */
  }
  return 1;
}
