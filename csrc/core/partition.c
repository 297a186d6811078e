/* The shard split (see tpcore/partition.h for the exact semantics). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "core_impl.h"
#include "tpcore/partition.h"

/* v as Python's repr(float) writes it: the shortest digits that read back as v, fixed
 * notation for decimal exponents -4 < e <= 16, else d.ddde+XX. */
static void py_float_repr(char *out, size_t cap, double v) {
  if (isnan(v)) {
    snprintf(out, cap, "nan");
    return;
  }
  if (isinf(v)) {
    snprintf(out, cap, v < 0 ? "-inf" : "inf");
    return;
  }
  char buf[64];
  for (int p = 0; p < 17; p++) {
    snprintf(buf, sizeof buf, "%.*e", p, v);
    if (strtod(buf, NULL) == v) break;
  }
  /* buf: [-]d[.ddd]e[+-]XX */
  const char *s = buf;
  int neg = *s == '-';
  if (neg) s++;
  char digits[32];
  int nd = 0;
  for (; *s && *s != 'e'; s++)
    if (*s != '.') digits[nd++] = *s;
  int e10 = atoi(s + 1);
  while (nd > 1 && digits[nd - 1] == '0') nd--;
  digits[nd] = 0;
  int decpt = e10 + 1;
  char res[64];
  size_t k = 0;
  if (neg) res[k++] = '-';
  if (v == 0) {
    snprintf(out, cap, "%s0.0", neg ? "-" : "");
    return;
  }
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      res[k++] = '0', res[k++] = '.';
      for (int i = 0; i < -decpt; i++) res[k++] = '0';
      for (int i = 0; i < nd; i++) res[k++] = digits[i];
    } else {
      for (int i = 0; i < decpt; i++) res[k++] = i < nd ? digits[i] : '0';
      res[k++] = '.';
      if (nd > decpt)
        for (int i = decpt; i < nd; i++) res[k++] = digits[i];
      else res[k++] = '0';
    }
    res[k] = 0;
  } else {
    res[k++] = digits[0];
    if (nd > 1) {
      res[k++] = '.';
      for (int i = 1; i < nd; i++) res[k++] = digits[i];
    }
    snprintf(res + k, sizeof res - k, "e%c%02d", e10 < 0 ? '-' : '+', e10 < 0 ? -e10 : e10);
  }
  snprintf(out, cap, "%s", res);
}

static tp_status_t bad_weights(int world, const double *w) {
  /* the sentence, with the list cut at a bounded length */
  char list[768];
  size_t k = 0;
  list[k++] = '[';
  for (int r = 0; r < world; r++) {
    char one[40];
    py_float_repr(one, sizeof one, w[r]);
    size_t need = strlen(one) + 2;
    if (k + need + 6 >= sizeof list) {
      memcpy(list + k, "...", 3);
      k += 3;
      break;
    }
    if (r) list[k++] = ',', list[k++] = ' ';
    memcpy(list + k, one, strlen(one));
    k += strlen(one);
  }
  list[k++] = ']';
  list[k] = 0;
  return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                      "partition: weights must be %d finite non-negative numbers with a "
                      "positive sum, got %s",
                      world, list);
}

typedef struct {
  double rem;
  int rank;
} rem_rank;

/* Python's key (-(exact - count), rank): larger remainders first, then lower ranks. */
static int by_remainder(const void *a, const void *b) {
  const rem_rank *x = a, *y = b;
  double kx = -x->rem, ky = -y->rem;
  if (kx < ky) return -1;
  if (kx > ky) return 1;
  return (x->rank > y->rank) - (x->rank < y->rank);
}

tp_status_t tp_partition(int64_t n, int world, const double *weights, int64_t align, int64_t *sizes, int64_t *offsets) {
  if (n < 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "partition: n must be an integer >= 0, got %lld", (long long)n);
  if (world < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "partition: world must be an integer >= 1, got %d", world);
  if (align < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "partition: align must be an integer >= 1, got %lld",
                        (long long)align);
  if (n % align)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "partition: n=%lld is not a multiple of align=%lld", (long long)n,
                        (long long)align);
  int64_t units = n / align;
  if (!weights) {
    int64_t off = 0;
    for (int r = 0; r < world; r++) {
      int64_t s = (units / world + (r < units % world)) * align;
      if (sizes) sizes[r] = s;
      if (offsets) offsets[r] = off;
      off += s;
    }
    if (offsets) offsets[world] = off;
    return TP_SUCCESS;
  }
  double total = 0.0;
  int ok = 1;
  for (int r = 0; r < world; r++) {
    if (!isfinite(weights[r]) || weights[r] < 0) ok = 0;
    total += weights[r];
  }
  if (!ok || !(total > 0)) return bad_weights(world, weights);
  /* Weights so large that their sum or units x weight overflow a double (both finite
   * otherwise) are scaled by the largest first: the same shares, no inf/NaN to convert. */
  double wmax = 0.0, scale = 1.0;
  for (int r = 0; r < world; r++) wmax = weights[r] > wmax ? weights[r] : wmax;
  if (!isfinite(total) || !isfinite((double)units * wmax)) {
    scale = 1.0 / wmax;
    total = 0.0;
    for (int r = 0; r < world; r++) total += weights[r] * scale;
  }
  rem_rank *order = malloc(sizeof(rem_rank) * (size_t)world);
  int64_t *counts = malloc(sizeof(int64_t) * (size_t)world);
  if (!order || !counts) {
    free(order), free(counts);
    return tp_set_error(TP_ERR_NOMEM, "partition: out of memory for %d ranks", world);
  }
  int64_t left = units; /* units - the floors so far: never below minus their rounding excess (no overflow) */
  for (int r = 0; r < world; r++) {
    double exact = (double)units * (scale == 1.0 ? weights[r] : weights[r] * scale) / total;
    counts[r] = exact >= (double)units ? units : (int64_t)floor(exact); /* 2^63 - 1 rounds up to 2^63 */
    order[r].rem = exact - (double)counts[r];
    order[r].rank = r;
    left -= counts[r];
  }
  qsort(order, (size_t)world, sizeof *order, by_remainder);
  /* Hand out what the floors left: one unit each to the largest remainders (0 <= left <
   * world whenever units x weight is exact in a double, i.e. units < 2^53).  Past that the
   * floors may miss by more than world in either direction: go round again (or take back
   * from the smallest remainders) until the sizes sum to units. */
  for (int64_t i = 0; left > 0; i = (i + 1) % world, left--) counts[order[i].rank]++;
  for (int64_t i = world - 1; left < 0; i = (i + world - 1) % world)
    if (counts[order[i].rank] > 0) counts[order[i].rank]--, left++;
  int64_t off = 0;
  for (int r = 0; r < world; r++) {
    if (sizes) sizes[r] = counts[r] * align;
    if (offsets) offsets[r] = off;
    off += counts[r] * align;
  }
  if (offsets) offsets[world] = off;
  free(order);
  free(counts);
  return TP_SUCCESS;
}

tp_status_t tp_partition_sizes(int64_t dim, int world, const int64_t *sizes, int64_t *parts, int64_t *offsets,
                               const char *what, const char *dim_name) {
  if (!what) what = "partition";
  if (!dim_name) dim_name = "the dimension";
  if (dim < 0 || world < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: dim must be >= 0 and world >= 1, got %lld and %d", what,
                        (long long)dim, world);
  int64_t sum = 0;
  for (int p = 0; p < world; p++) {
    int64_t v = sizes ? sizes[p] : dim / world + (p < dim % world);
    if (v < 0) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s[%d] is negative (%lld)", what, p, (long long)v);
    if (parts) parts[p] = v;
    if (offsets) offsets[p] = sum;
    if (!tp_add_count(sum, v, &sum))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s sums past 2^63 - 1 (entry %d = %lld)", what, p, (long long)v);
  }
  if (offsets) offsets[world] = sum;
  if (sum != dim)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s sums to %lld but %s is %lld", what, (long long)sum, dim_name,
                        (long long)dim);
  return TP_SUCCESS;
}
