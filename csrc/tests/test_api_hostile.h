/* Shared by the hostile-argument tests (test_api_hostile*.c): the expectation
 * helpers, hostile views of tensors and the variant runner. */
#ifndef TEST_API_HOSTILE_H
#define TEST_API_HOSTILE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tpcore/layers.h"

#define ANY_ERR ((tp_status_t) - 1)

/* st must be `want` (ANY_ERR: any failure) and the sentence must hold a and b (NULL: skip). */
void expect(tp_status_t st, tp_status_t want, const char *a, const char *b, const char *src, int line);
void expect_ok(tp_status_t st, const char *src, int line);
#define BAD(call, want, a, b) expect((call), (want), (a), (b), __FILE__ ": " #call, __LINE__)
#define ARG(call, a, b) BAD(call, TP_ERR_INVALID_ARGUMENT, a, b)
#define OK(call) expect_ok((call), __FILE__ ": " #call, __LINE__)
#define TRUE(cond) expect_ok((cond) ? TP_SUCCESS : TP_ERR_INTERNAL, __FILE__ ": " #cond, __LINE__)

/* Views of host arrays and hostile variants. */
static inline tp_tensor T2(void *p, int64_t r, int64_t c) { return tp_tensor_2d(p, TP_FLOAT32, r, c); }
static inline tp_tensor T1(void *p, int64_t n) { return tp_tensor_1d(p, TP_FLOAT32, n); }
static inline tp_tensor I1(void *p, int64_t n) { return tp_tensor_1d(p, TP_INT64, n); }
static inline tp_tensor with_dtype(tp_tensor t, tp_dtype_t d) {
  t.dtype = d;
  return t;
}
static inline tp_tensor with_ndim(tp_tensor t, int nd) {
  t.ndim = nd;
  return t;
}
static inline tp_tensor with_dev(tp_tensor t, tp_device_t d, int id) {
  t.device = d;
  t.device_id = id;
  return t;
}
static inline tp_tensor with_data(tp_tensor t, void *p) {
  t.data = p;
  return t;
}
static inline tp_tensor with_stride(tp_tensor t, int i, int64_t s) {
  t.strides[i] = s;
  return t;
}
static inline tp_tensor with_shape(tp_tensor t, int i, int64_t s) {
  t.shape[i] = s;
  return t;
}
/* 3-D view of a 2-D tensor (an extra leading 1) */
static inline tp_tensor as3d(tp_tensor t) {
  int64_t shape[3] = {1, t.shape[0], t.shape[1]};
  return tp_tensor_nd(t.data, t.dtype, 3, shape);
}
#define P(t) ((tp_tensor[]){t})

/* a fake stream: any non-NULL value (the CPU has only the NULL stream) */
static inline tp_stream_t fake_stream(void) { return (tp_stream_t)(uintptr_t)0x1000; }

extern const int64_t HUGE_DIMS[3]; /* 2^31, 2^62, INT64_MAX */

enum { M = 3, K = 5, N = 4 };
extern float xa[64 * 64], ya[64 * 64], wa[64 * 64], ba[64 * 64], ga[64 * 64];
extern int64_t tok[64];

/* The hostile variants of an argument of a call: run(t') must fail naming op and arg
 * (null_ok: the argument is optional, NULL is not tried). */
typedef tp_status_t (*call1)(const tp_tensor *t, void *ctx);
void hostile_variants_opt(const char *op, const char *arg, tp_tensor good, call1 run, void *ctx, int line, int null_ok);
void hostile_variants(const char *op, const char *arg, tp_tensor good, call1 run, void *ctx, int line);

void test_kernels(void);
void test_linear(tp_comm_t comm, tp_parallel_kind_t kind);
void test_mlp(tp_comm_t comm);
void test_vocab(tp_comm_t comm);
void test_block(tp_comm_t comm);

#endif
