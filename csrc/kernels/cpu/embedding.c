/* Vocab-parallel embedding and softmax cross-entropy pieces on a vocabulary
 * shard [lo, lo + V) of a larger vocabulary.  Tokens outside the shard give
 * zero rows (the all-reduce adds the owning rank's row). */
#include <math.h>
#include <string.h>

#include "tpcore/kernels.h"

void tp_embedding_forward(float *out, const int64_t *tokens, const float *table, int64_t M, int64_t lo, int64_t V,
                          int64_t C) {
  for (int64_t m = 0; m < M; m++) {
    int64_t t = tokens[m] - lo;
    if (t >= 0 && t < V) memcpy(out + m * C, table + t * C, (size_t)C * sizeof(float));
    else memset(out + m * C, 0, (size_t)C * sizeof(float));
  }
}

void tp_embedding_backward(float *dtable, const int64_t *tokens, const float *dout, int64_t M, int64_t lo, int64_t V,
                           int64_t C) {
  for (int64_t m = 0; m < M; m++) {
    int64_t t = tokens[m] - lo;
    if (t < 0 || t >= V) continue;
    float *row = dtable + t * C;
    const float *d = dout + m * C;
    for (int64_t c = 0; c < C; c++) row[c] += d[c];
  }
}

void tp_xent_row_max(float *rowmax, const float *logits, int64_t M, int64_t V) {
  for (int64_t m = 0; m < M; m++) {
    const float *l = logits + m * V;
    float mx = -INFINITY;
    for (int64_t j = 0; j < V; j++) mx = l[j] > mx ? l[j] : mx;
    rowmax[m] = mx;
  }
}

void tp_xent_row_sums(float *sums, const float *logits, const float *gmax, const int64_t *targets, int64_t M,
                      int64_t lo, int64_t V) {
  for (int64_t m = 0; m < M; m++) {
    const float *l = logits + m * V;
    double s = 0.0;
    for (int64_t j = 0; j < V; j++) s += exp((double)l[j] - (double)gmax[m]);
    int64_t t = targets[m] - lo;
    sums[m] = (float)s;
    sums[M + m] = (t >= 0 && t < V) ? l[t] : 0.0f;
  }
}

void tp_xent_backward(float *dlogits, const float *logits, const float *gmax, const float *sumexp,
                      const int64_t *targets, int64_t M, int64_t lo, int64_t V, float scale) {
  for (int64_t m = 0; m < M; m++) {
    const float *l = logits + m * V;
    float *d = dlogits + m * V;
    double inv = 1.0 / (double)sumexp[m];
    for (int64_t j = 0; j < V; j++) d[j] = (float)(exp((double)l[j] - (double)gmax[m]) * inv) * scale;
    int64_t t = targets[m] - lo;
    if (t >= 0 && t < V) d[t] -= scale;
  }
}
