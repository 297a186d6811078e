/* The kernel parity harness (test_kernels.c, test_kernels_nn.c): shared helpers.
 * Every entry of every available kernel table runs against a plain double-precision
 * reference written here, on random inputs of odd sizes (0, 1, and sizes that are not
 * multiples of the vector widths 4/8/16 or of the blocks the kernels use: 64 query rows
 * in attention, 256 logits in the cross-entropy sums, the thread split's chunks).
 *
 * Tolerances.  u = 2^-24 is float32's unit roundoff.  A result of one float operation on
 * exact inputs is within u |ref|.  A sum of n float terms (a dot product, a column sum,
 * an accumulation into a gradient) is within gamma_n = n u / (1 - n u) of the sum of the
 * absolute terms (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so those
 * checks compare |got - ref| with c (n + 2) u mag, where mag is that absolute sum,
 * computed by the reference, and c = 2 leaves room for BLAS's blocked orders and FMA.
 * Kernels that use the vectorized exp/erf approximations (vmath.h: exp relative error
 * ~1e-7, erf absolute error <= 1.5e-7) get tolerances a few times those errors, scaled
 * by the factors the formula multiplies them with; each case says which.  Any formula
 * slip (a wrong sign, index, mask or scale) shows as an error of 1e-3 or more. */
#ifndef TPCORE_TEST_KERNELS_H
#define TPCORE_TEST_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/kernels_impl.h"
#include "tpcore/device.h"

#define U (1.0 / 16777216.0) /* float32 unit roundoff 2^-24 */

extern const tp_kernel_ops *K; /* the table under test */
extern tp_device_t DEV;

/* The case of an entry failed (prints why; the entry's line says FAIL). */
void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* |got[i] - ref[i]| <= atol * (mag ? mag[i] : 1) + rtol * |ref[i]| for every i. */
void expect(const char *what, const float *got, const double *ref, int64_t n, double atol, double rtol,
            const double *mag);
void expect_i64(const char *what, const int64_t *got, const int64_t *ref, int64_t n);
/* The status of an entry: TP_SUCCESS expected. */
void ok(const char *what, tp_status_t st);

/* Host memory freed after each entry; uniform random floats in [lo, hi). */
void *hmem(size_t nbytes);
float *rnd(int64_t n, double lo, double hi);
double *dz(int64_t n); /* zeroed doubles */
uint64_t rnd_u64(void);
int64_t rnd_int(int64_t lo, int64_t hi); /* in [lo, hi) */
/* Device memory of the table's device, freed after each entry: a copy of host data,
 * and a copy back. */
void *dput(const void *host, size_t nbytes);
void *dmem(size_t nbytes);
void dget(void *host, const void *dev, size_t nbytes);
#define DPUTF(p, n) ((float *)dput((p), (size_t)(n) * sizeof(float)))
#define DPUTI(p, n) ((int64_t *)dput((p), (size_t)(n) * sizeof(int64_t)))
#define GETF(h, d, n) dget((h), (d), (size_t)(n) * sizeof(float))
#define GETI(h, d, n) dget((h), (d), (size_t)(n) * sizeof(int64_t))

/* The neural-network entries' cases (test_kernels_nn.c). */
void case_linear_forward(void);
void case_linear_backward(void);
void case_act_forward(void);
void case_act_backward(void);
void case_bias_act_forward(void);
void case_bias_act_backward_workspace(void);
void case_bias_act_backward(void);
void case_layernorm_forward(void);
void case_layernorm_backward(void);
void case_rmsnorm_forward(void);
void case_rmsnorm_backward(void);
void case_rope(void);
void case_attention_workspace(void);
void case_attention_forward(void);
void case_attention_backward(void);

/* The low-precision weight entries' cases (test_kernels_lowp.c). */
void case_convert(void);
void case_linear_lp_workspace(void);
void case_linear_forward_lp(void);
void case_linear_backward_lp(void);
void case_embedding_forward_lp(void);

/* The same entries with quantized weight formats (test_kernels_qlp.c), run on the tables
 * quant_table() names, each case under its entry's name with a "quant_" prefix. */
int quant_table(const tp_kernel_ops *k);
void case_quant_linear_lp_workspace(void);
void case_quant_linear_forward_lp(void);
void case_quant_linear_backward_lp(void);
void case_quant_embedding_forward_lp(void);

#endif
