/*
 * Reduction kernels.  The hot loop works block by block: a block of the result
 * is accumulated in an L1-resident array and then stored once, so N sources cost
 * one pass over each source and one over the destination.  The inner loops are
 * written so that the compiler vectorizes them at -O3.
 */
#include <stdint.h>
#include <string.h>

#include "reduce_impl.h"

#define BLK 1024

/* The portable build targets x86-64's baseline (SSE2, 16-byte vectors); the hot
 * loops get AVX2 and AVX-512 clones too, picked at load time (an ifunc) by what
 * the CPU has. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef TP_CLONES
#define TP_CLONES
#endif

#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
/* NumPy's minimum/maximum: NaN propagates. */
#define OP_FMIN(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))
#define OP_FMAX(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))
#define OP_IMIN(a, b) ((a) <= (b) ? (a) : (b))
#define OP_IMAX(a, b) ((a) >= (b) ? (a) : (b))

/* Float types: T is the storage type, A the accumulator, LD/ST convert. */
#define DEFINE_FLOAT_REDUCE(NAME, T, A, LD, ST)                                                     \
  TP_CLONES static void NAME(T *dst, T *dst2, const T *const *s, int ns, size_t n, tp_redop_t op) { \
    A acc[BLK];                                                                                     \
    for (size_t o = 0; o < n; o += BLK) {                                                           \
      size_t m = n - o < BLK ? n - o : BLK;                                                         \
      const T *s0 = s[0] + o;                                                                       \
      for (size_t i = 0; i < m; i++) acc[i] = LD(s0[i]);                                            \
      for (int k = 1; k < ns; k++) {                                                                \
        const T *sk = s[k] + o;                                                                     \
        switch (op) {                                                                               \
          case TP_SUM:                                                                              \
          case TP_AVG:                                                                              \
            for (size_t i = 0; i < m; i++) acc[i] = OP_SUM(acc[i], LD(sk[i]));                      \
            break;                                                                                  \
          case TP_PROD:                                                                             \
            for (size_t i = 0; i < m; i++) acc[i] = OP_PROD(acc[i], LD(sk[i]));                     \
            break;                                                                                  \
          case TP_MIN:                                                                              \
            for (size_t i = 0; i < m; i++) {                                                        \
              A v = LD(sk[i]);                                                                      \
              acc[i] = OP_FMIN(acc[i], v);                                                          \
            }                                                                                       \
            break;                                                                                  \
          case TP_MAX:                                                                              \
            for (size_t i = 0; i < m; i++) {                                                        \
              A v = LD(sk[i]);                                                                      \
              acc[i] = OP_FMAX(acc[i], v);                                                          \
            }                                                                                       \
            break;                                                                                  \
          default: break;                                                                           \
        }                                                                                           \
      }                                                                                             \
      if (op == TP_AVG) {                                                                           \
        A d = (A)ns;                                                                                \
        for (size_t i = 0; i < m; i++) acc[i] = acc[i] / d;                                         \
      }                                                                                             \
      T *d0 = dst + o;                                                                              \
      for (size_t i = 0; i < m; i++) d0[i] = ST(acc[i]);                                            \
      if (dst2) memcpy(dst2 + o, d0, m * sizeof(T));                                                \
    }                                                                                               \
  }

#define ID(x) (x)
DEFINE_FLOAT_REDUCE(reduce_f32, float, float, ID, ID)
DEFINE_FLOAT_REDUCE(reduce_f64, double, double, ID, ID)
DEFINE_FLOAT_REDUCE(reduce_f16, uint16_t, float, tp_half_to_float, tp_float_to_half)
DEFINE_FLOAT_REDUCE(reduce_bf16, uint16_t, float, tp_bf16_to_float, tp_float_to_bf16)

/* Integer types: wrap-around arithmetic is done in the unsigned type U (no UB);
 * avg accumulates in 64-bit (128-bit for int64) and truncates toward zero. */
#define DEFINE_INT_REDUCE(NAME, T, U, W)                                                            \
  TP_CLONES static void NAME(T *dst, T *dst2, const T *const *s, int ns, size_t n, tp_redop_t op) { \
    T acc[BLK];                                                                                     \
    for (size_t o = 0; o < n; o += BLK) {                                                           \
      size_t m = n - o < BLK ? n - o : BLK;                                                         \
      if (op == TP_AVG) {                                                                           \
        for (size_t i = 0; i < m; i++) {                                                            \
          W sum = 0;                                                                                \
          for (int k = 0; k < ns; k++) sum += (W)s[k][o + i];                                       \
          acc[i] = (T)(sum / (W)ns);                                                                \
        }                                                                                           \
      } else {                                                                                      \
        memcpy(acc, s[0] + o, m * sizeof(T));                                                       \
        for (int k = 1; k < ns; k++) {                                                              \
          const T *sk = s[k] + o;                                                                   \
          switch (op) {                                                                             \
            case TP_SUM:                                                                            \
              for (size_t i = 0; i < m; i++) acc[i] = (T)((U)acc[i] + (U)sk[i]);                    \
              break;                                                                                \
            case TP_PROD:                                                                           \
              for (size_t i = 0; i < m; i++) acc[i] = (T)((U)acc[i] * (U)sk[i]);                    \
              break;                                                                                \
            case TP_MIN:                                                                            \
              for (size_t i = 0; i < m; i++) acc[i] = OP_IMIN(acc[i], sk[i]);                       \
              break;                                                                                \
            case TP_MAX:                                                                            \
              for (size_t i = 0; i < m; i++) acc[i] = OP_IMAX(acc[i], sk[i]);                       \
              break;                                                                                \
            default: break;                                                                         \
          }                                                                                         \
        }                                                                                           \
      }                                                                                             \
      memcpy(dst + o, acc, m * sizeof(T));                                                          \
      if (dst2) memcpy(dst2 + o, acc, m * sizeof(T));                                               \
    }                                                                                               \
  }

DEFINE_INT_REDUCE(reduce_i8, int8_t, uint8_t, int64_t)
DEFINE_INT_REDUCE(reduce_u8, uint8_t, uint8_t, int64_t)
DEFINE_INT_REDUCE(reduce_i32, int32_t, uint32_t, int64_t)
DEFINE_INT_REDUCE(reduce_i64, int64_t, uint64_t, __int128)

void tp_reduce_n(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n, tp_dtype_t dtype, tp_redop_t op) {
  if (n == 0) return;
  switch (dtype) {
#define CASE(D, FN, T) \
  case D: FN((T *)dst, (T *)dst2, (const T *const *)srcs, nsrc, n, op); break;
    CASE(TP_FLOAT32, reduce_f32, float)
    CASE(TP_FLOAT64, reduce_f64, double)
    CASE(TP_FLOAT16, reduce_f16, uint16_t)
    CASE(TP_BFLOAT16, reduce_bf16, uint16_t)
    CASE(TP_INT8, reduce_i8, int8_t)
    CASE(TP_UINT8, reduce_u8, uint8_t)
    CASE(TP_INT32, reduce_i32, int32_t)
    CASE(TP_INT64, reduce_i64, int64_t)
#undef CASE
    default: break;
  }
}

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
static void copy_nt(void *dst, const void *src, size_t nbytes) {
  char *d = (char *)dst;
  const char *s = (const char *)src;
  size_t head = (16 - ((uintptr_t)d & 15)) & 15;
  if (head > nbytes) head = nbytes;
  memcpy(d, s, head);
  d += head;
  s += head;
  nbytes -= head;
  size_t n64 = nbytes / 64;
  for (size_t i = 0; i < n64; i++) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)(d + 0), a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
    d += 64;
    s += 64;
  }
  _mm_sfence();
  memcpy(d, s, nbytes - n64 * 64);
}
#endif

void tp_copy(void *dst, const void *src, size_t nbytes, int nt) {
  if (nbytes == 0 || dst == src) return;
#if defined(__x86_64__) && defined(__SSE2__)
  if (nt && nbytes >= 4096) {
    copy_nt(dst, src, nbytes);
    return;
  }
#else
  (void)nt;
#endif
  memcpy(dst, src, nbytes);
}
