/* The parallel MLP: fc1 (column) -> activation -> fc2 (row), workspaces reused. */
#include <limits.h>
#include <stdlib.h>

#include "layers_impl.h"

struct tp_parallel_mlp {
  tp_comm_t comm;
  tp_parallel_linear_t fc1, fc2;
  tp_activation_t act;
  int64_t f1, f;       /* fc1 output columns on this rank (2 * local when gated), activation columns */
  float *h, *a, *da, *dh;
  int64_t cap, last_m; /* workspace rows; rows of the last forward (-1: none yet) */
};

void tp_parallel_mlp_destroy(tp_parallel_mlp_t m) {
  if (!m) return;
  tp_parallel_linear_destroy(m->fc1);
  tp_parallel_linear_destroy(m->fc2);
  free(m->h);
  free(m->a);
  free(m->da);
  free(m->dh);
  free(m);
}

tp_status_t tp_parallel_mlp_create(tp_parallel_mlp_t *out, tp_comm_t comm, const tp_mlp_config_t *cfg) {
  if (!out || !comm || !cfg) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp: NULL argument");
  *out = NULL;
  if (cfg->size != sizeof(tp_mlp_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp: config built for another tpcore version");
  if ((unsigned)cfg->activation > TP_ACT_SWIGLU)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp: unknown activation %d", (int)cfg->activation);
  tp_parallel_mlp_t m = calloc(1, sizeof *m);
  if (!m) return tp_set_error(TP_ERR_NOMEM, "mlp: out of memory");
  m->comm = comm;
  m->act = cfg->activation;
  m->last_m = -1;
  tp_linear_config_t c1 = TP_LINEAR_CONFIG_INITIALIZER, c2 = TP_LINEAR_CONFIG_INITIALIZER;
  c1.kind = TP_COLUMN_PARALLEL;
  c1.in_features = cfg->hidden;
  c1.out_features = cfg->ffn_hidden;
  c1.bias = cfg->bias;
  c1.partition = cfg->partition;
  c1.seed = cfg->seed;
  c1.gated = cfg->activation == TP_ACT_SWIGLU;
  c2.kind = TP_ROW_PARALLEL;
  c2.in_features = cfg->ffn_hidden;
  c2.out_features = cfg->hidden;
  c2.bias = cfg->bias;
  c2.input_is_parallel = 1;
  c2.partition = cfg->partition;
  c2.seed = cfg->seed + 1;
  tp_status_t st = tp_parallel_linear_create(&m->fc1, comm, &c1);
  if (st == TP_SUCCESS) st = tp_parallel_linear_create(&m->fc2, comm, &c2);
  if (st != TP_SUCCESS) {
    tp_error_prefix("mlp");
    tp_parallel_mlp_destroy(m);
    return st;
  }
  tp_linear_info_t i1, i2;
  tp_parallel_linear_info(m->fc1, &i1);
  tp_parallel_linear_info(m->fc2, &i2);
  m->f1 = i1.y_cols;
  m->f = i2.x_cols;
  *out = m;
  return TP_SUCCESS;
}

tp_parallel_linear_t tp_parallel_mlp_layer(tp_parallel_mlp_t m, int which) {
  return !m ? NULL : which == 0 ? m->fc1 : m->fc2;
}

/* Workspaces for M rows (M checked by the caller); allocated even for M = 0, so that
 * no kernel or copy ever sees a NULL workspace. */
static tp_status_t workspace(tp_parallel_mlp_t m, int64_t M) {
  if (M <= m->cap && m->h) return TP_SUCCESS;
  float *p[4] = {NULL, NULL, NULL, NULL};
  int64_t cols[4] = {m->f1, m->f, m->f, m->f1};
  for (int i = 0; i < 4; i++) {
    int64_t n = M * cols[i];
    p[i] = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p[i]) {
      for (int j = 0; j < i; j++) free(p[j]);
      return tp_set_error(TP_ERR_NOMEM, "mlp: out of memory for %lld rows of workspace", (long long)M);
    }
  }
  free(m->h);
  free(m->a);
  free(m->da);
  free(m->dh);
  m->h = p[0];
  m->a = p[1];
  m->da = p[2];
  m->dh = p[3];
  m->cap = M;
  return TP_SUCCESS;
}

tp_status_t tp_parallel_mlp_forward(tp_parallel_mlp_t m, float *y, const float *x, int64_t M) {
  if (!m || (M && (!x || !y))) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp forward: NULL argument");
  int64_t n;
  if (M < 0 || M > INT_MAX || !tp_numel2(M, m->f1 > m->f ? m->f1 : m->f, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp forward: %lld rows is out of range (0 to %d, and rows x "
                        "ffn columns (%lld) at most 2^40)", (long long)M, INT_MAX, (long long)m->f1);
  m->last_m = -1; /* a failed forward leaves no backward over freed or half-written workspaces */
  /* A workspace failure happens before any collective, on this rank only: the peers
   * would wait in fc2's all-reduce, so fail them too (through the layer's comm). */
  tp_status_t st = workspace(m, M);
  if (st != TP_SUCCESS) {
    tp_comm_abort(m->comm, tp_last_error());
    return st;
  }
  /* fc1 without its bias, then h += b1 and a = act(h) in one pass over h */
  TP_CHECK(tp_parallel_linear_forward_ex(m->fc1, m->h, x, M, TP_LIN_SKIP_BIAS));
  tp_linear_info_t i1;
  tp_parallel_linear_info(m->fc1, &i1);
  tp_legacy_bias_act_forward(m->a, m->h, i1.bias, M, m->f, m->act);
  TP_CHECK(tp_parallel_linear_forward_ex(m->fc2, y, m->a, M, TP_LIN_BORROW_INPUT)); /* a lives until backward */
  m->last_m = M;
  return TP_SUCCESS;
}

tp_status_t tp_parallel_mlp_backward(tp_parallel_mlp_t m, float *dx, const float *dy, int64_t M) {
  if (!m || (M && (!dy || !dx))) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp backward: NULL argument");
  if (m->last_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "mlp backward: called before forward");
  if (M != m->last_m)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp backward: dy has %lld rows but the last forward had %lld",
                        (long long)M, (long long)m->last_m);
  TP_CHECK(tp_parallel_linear_backward(m->fc2, m->da, dy, M));
  /* dh, and fc1's bias gradient from the same pass */
  tp_linear_info_t i1;
  tp_parallel_linear_info(m->fc1, &i1);
  if (tp_legacy_bias_act_backward(m->dh, i1.grad_bias, m->h, m->da, M, m->f, m->act) != 0) {
    tp_set_error(TP_ERR_NOMEM, "mlp backward: out of memory");
    tp_comm_abort(m->comm, tp_last_error()); /* the peers would wait in fc1's all-reduce */
    return TP_ERR_NOMEM;
  }
  return tp_parallel_linear_backward_ex(m->fc1, dx, m->dh, M, TP_LIN_SKIP_BIAS);
}
