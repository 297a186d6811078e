/* The small CPU entries of the kernel table: bias rows and their gradients, flat
 * element-wise arithmetic, seeded initialisation, positions and the KV-cache write,
 * the cross-entropy bookkeeping of the vocab layer, and the checks that read data
 * (each writes its finding to a result the caller reads back once, as a device would). */
#include <math.h>
#include <string.h>

#include "vmath.h"
#include "cpu_impl.h"

tp_status_t tp_cpu_add_bias(tp_stream_t s, float *y, const float *x, const float *b, int64_t M, int64_t N) {
  (void)s;
  for (int64_t m = 0; m < M; m++) {
    const float *src = x + m * N;
    float *dst = y + m * N;
    for (int64_t j = 0; j < N; j++) dst[j] = src[j] + b[j];
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_bias_grad(tp_stream_t s, float *db, const float *dy, int64_t M, int64_t N) {
  (void)s;
  for (int64_t m = 0; m < M; m++) {
    const float *row = dy + m * N;
    for (int64_t n = 0; n < N; n++) db[n] += row[n];
  }
  return TP_SUCCESS;
}

/* y may alias a or b exactly (element i reads a[i], b[i] before writing y[i]). */
tp_status_t tp_cpu_add(tp_stream_t s, float *y, const float *a, const float *b, int64_t n) {
  (void)s;
  for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
  return TP_SUCCESS;
}

tp_status_t tp_cpu_sub(tp_stream_t s, float *y, const float *a, const float *b, int64_t n) {
  (void)s;
  for (int64_t i = 0; i < n; i++) y[i] = a[i] - b[i];
  return TP_SUCCESS;
}

tp_status_t tp_cpu_scale(tp_stream_t s, float *y, const float *x, float alpha, int64_t n) {
  (void)s;
  for (int64_t i = 0; i < n; i++) y[i] = alpha * x[i];
  return TP_SUCCESS;
}

tp_status_t tp_cpu_fill(tp_stream_t s, float *y, float value, int64_t n) {
  (void)s;
  for (int64_t i = 0; i < n; i++) y[i] = value;
  return TP_SUCCESS;
}

tp_status_t tp_cpu_init_uniform(tp_stream_t s, float *y, int64_t n, uint64_t seed, uint64_t tensor, uint64_t index0,
                                float bound) {
  (void)s;
  for (int64_t i = 0; i < n; i++)
    y[i] = (float)((2.0 * tp_uniform01(seed, tensor, index0 + (uint64_t)i) - 1.0) * bound);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_init_normal(tp_stream_t s, float *y, int64_t n, uint64_t seed, uint64_t tensor, uint64_t index0) {
  (void)s;
  for (int64_t i = 0; i < n;) {
    uint64_t idx = index0 + (uint64_t)i, p = idx / 2;
    double u1 = tp_uniform01(seed, tensor, 2 * p), u2 = tp_uniform01(seed, tensor, 2 * p + 1);
    double r = sqrt(-2.0 * log1p(-u1)), a = 6.283185307179586 * u2;
    if (idx % 2 == 0) { /* a whole pair: both halves from one draw */
      y[i++] = (float)(r * cos(a));
      if (i < n) y[i++] = (float)(r * sin(a));
    } else {
      y[i++] = (float)(r * sin(a));
    }
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_positions(tp_stream_t s, int64_t *pos, int64_t *klen, const int64_t *pos0, int64_t B, int64_t T) {
  (void)s;
  for (int64_t b = 0; b < B; b++) {
    if (klen) klen[b] = pos0[b] + T;
    for (int64_t t = 0; t < T; t++) pos[b * T + t] = pos0[b] + t;
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_kv_cache_write(tp_stream_t s, float *kcache, float *vcache, const float *k, const float *v,
                                  int64_t ld, const int64_t *pos0, const int64_t *slots, int64_t B, int64_t T,
                                  int64_t max_len, int64_t width, int64_t ring) {
  (void)s;
  size_t nbytes = (size_t)width * sizeof(float);
  if (!nbytes) return TP_SUCCESS;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = ring > 0 && T > ring ? T - ring : 0; t < T; t++) { /* a ring: each row once, the last wins */
      int64_t p = pos0[b] + t, r = ring > 0 ? p % ring : p;
      int64_t row = (b * T + t) * ld, at = ((slots ? slots[b] : b) * max_len + r) * width;
      memcpy(kcache + at, k + row, nbytes);
      memcpy(vcache + at, v + row, nbytes);
    }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_kv_cache_write_paged(tp_stream_t s, float *kcache, float *vcache, const float *k, const float *v,
                                        int64_t ld, const int64_t *pos0, const int64_t *table, int64_t cols, int64_t bs,
                                        int64_t B, int64_t T, int64_t width) {
  (void)s;
  size_t nbytes = (size_t)width * sizeof(float);
  if (!nbytes) return TP_SUCCESS;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++) {
      int64_t p = pos0[b] + t, e = p / bs < cols ? table[b * cols + p / bs] : -1;
      if (e < 0) continue; /* no block: a padding row or token */
      int64_t row = (b * T + t) * ld, at = (e * bs + p % bs) * width;
      memcpy(kcache + at, k + row, nbytes);
      memcpy(vcache + at, v + row, nbytes);
    }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_check_range(tp_stream_t s, int64_t *result, const int64_t *x, int64_t n, int64_t lo, int64_t hi) {
  (void)s;
  result[0] = -1;
  for (int64_t i = 0; i < n; i++)
    if (x[i] < lo || x[i] >= hi) {
      result[0] = i;
      break;
    }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_xent_targets(tp_stream_t s, int64_t *out, int64_t *result, const int64_t *targets, int64_t M,
                                int64_t ignore_index, int64_t vocab) {
  (void)s;
  int64_t valid = 0, bad = -1;
  for (int64_t m = 0; m < M; m++) {
    int64_t t = targets[m];
    if (t == ignore_index) {
      out[m] = -1;
      continue;
    }
    if (t < 0 || t >= vocab) {
      bad = m;
      break;
    }
    out[m] = t;
    valid++;
  }
  result[0] = bad;
  result[1] = valid;
  return TP_SUCCESS;
}

tp_status_t tp_cpu_xent_targets_hash(tp_stream_t s, float *fp, const int64_t *targets, int64_t M,
                                     int64_t ignore_index) {
  (void)s;
  uint64_t h = (0xcbf29ce484222325ULL ^ (uint64_t)M) * 0x100000001b3ULL ^ (uint64_t)ignore_index;
  for (int64_t m = 0; m < M; m++) h = (h ^ (uint64_t)targets[m]) * 0x100000001b3ULL;
  h ^= h >> 29;
  float f = (float)(h & 0xFFFFFF); /* 24 bits: exact in float32 */
  fp[0] = f;
  fp[1] = -f;
  return TP_SUCCESS;
}

tp_status_t tp_cpu_xent_loss(tp_stream_t s, float *losses, const float *sumexp, const float *gmax,
                             const float *target_logit, const int64_t *targets, int64_t M) {
  (void)s;
  for (int64_t m = 0; m < M; m++)
    losses[m] = targets[m] < 0 ? 0.0f : (float)(log((double)sumexp[m]) + (double)gmax[m] - (double)target_logit[m]);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_xent_row_scale(tp_stream_t s, float *row_scale, const int64_t *targets, const float *dloss,
                                  int64_t M) {
  (void)s;
  for (int64_t m = 0; m < M; m++) row_scale[m] = targets[m] < 0 ? 0.0f : dloss ? dloss[m] : 1.0f;
  return TP_SUCCESS;
}
