/* The parallel MLP: fc1 (column) -> activation -> fc2 (row), workspaces reused. */
#include <limits.h>

#include "layers_impl.h"
#include "layer_kernels.h"

struct tp_parallel_mlp {
  tp_comm_t comm;
  tp_parallel_linear_t fc1, fc2;
  tp_activation_t act;
  tp_device_t dev;
  int dev_id;
  tp_lk lk;      /* the device's kernels */
  int64_t C;     /* hidden */
  int64_t f1, f; /* fc1 output columns on this rank (2 * local when gated), activation columns */
  tp_arena_t ws; /* h, a, da, dh for the last forward's rows */
  float *h, *a, *da, *dh;
  void *bws; /* the bias + activation backward's scratch */
  size_t bws_bytes;
  int64_t last_m; /* rows of the last forward (-1: none yet) */
};

void tp_parallel_mlp_destroy(tp_parallel_mlp_t m) {
  if (!m) return;
  tp_parallel_linear_destroy(m->fc1);
  tp_parallel_linear_destroy(m->fc2);
  tp_arena_release(&m->ws);
  tp_host_free(m);
}

tp_status_t tp_parallel_mlp_create(tp_parallel_mlp_t *out, tp_comm_t comm, const tp_mlp_config_t *cfg) {
  TP_NONNULL("mlp", out, "out");
  TP_NONNULL("mlp", comm, "comm");
  TP_NONNULL("mlp", cfg, "config");
  *out = NULL;
  if (cfg->size != sizeof(tp_mlp_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp: config built for another tpcore version");
  tp_dtype_t d1 = cfg->weight_dtypes_set ? cfg->weight_dtypes[0] : cfg->weight_dtype;
  tp_dtype_t d2 = cfg->weight_dtypes_set ? cfg->weight_dtypes[1] : cfg->weight_dtype;
  TP_CHECK(tp_lk_check_wdtype("mlp", d1));
  TP_CHECK(tp_lk_check_wdtype("mlp", d2));
  if ((unsigned)cfg->activation > TP_ACT_LAST)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp: unknown activation %d", (int)cfg->activation);
  TP_CHECK(tp_layer_device("mlp", cfg->device, cfg->device_id));
  tp_parallel_mlp_t m;
  int world;
  tp_comm_size(comm, &world);
  /* the handle and an even partition in whole blocks of fc2's format (its row-parallel
   * split; fc1 takes the same columns) when the caller gave none */
  TP_CHECK(tp_host_zalloc(sizeof *m + (size_t)world * sizeof(int64_t), (void **)&m, "mlp"));
  const int64_t *part = cfg->partition;
  int64_t blk = tp_lk_block(d2);
  if (!part && blk > 1 && cfg->ffn_hidden > 0 && cfg->ffn_hidden % blk == 0) {
    int64_t *even = (int64_t *)(m + 1);
    if (tp_partition(cfg->ffn_hidden, world, NULL, blk, even, NULL) == TP_SUCCESS) part = even;
  }
  m->comm = comm;
  m->act = cfg->activation;
  m->last_m = -1;
  m->dev = cfg->device;
  m->dev_id = cfg->device_id;
  m->C = cfg->hidden;
  tp_arena_init(&m->ws, m->dev, m->dev_id);
  tp_status_t st = tp_lk_init(&m->lk, "mlp", m->dev, m->dev_id);
  if (st != TP_SUCCESS) {
    tp_parallel_mlp_destroy(m);
    return st;
  }
  tp_linear_config_t c1 = TP_LINEAR_CONFIG_INITIALIZER, c2 = TP_LINEAR_CONFIG_INITIALIZER;
  c1.kind = TP_COLUMN_PARALLEL;
  c1.in_features = cfg->hidden;
  c1.out_features = cfg->ffn_hidden;
  c1.bias = cfg->bias;
  c1.partition = part;
  c1.seed = cfg->seed;
  c1.gated = tp_act_gated(cfg->activation);
  c1.device = cfg->device;
  c1.device_id = cfg->device_id;
  c1.weight_dtype = d1;
  c2.kind = TP_ROW_PARALLEL;
  c2.in_features = cfg->ffn_hidden;
  c2.out_features = cfg->hidden;
  c2.bias = cfg->bias;
  c2.input_is_parallel = 1;
  c2.partition = part;
  c2.seed = cfg->seed + 1;
  c2.device = cfg->device;
  c2.weight_dtype = d2;
  c2.device_id = cfg->device_id;
  st = tp_parallel_linear_create(&m->fc1, comm, &c1);
  if (st == TP_SUCCESS) st = tp_parallel_linear_create(&m->fc2, comm, &c2);
  if (st == TP_SUCCESS) {
    tp_parallel_linear_set_region(m->fc1, "mlp");
    tp_parallel_linear_set_region(m->fc2, "mlp");
  }
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

/* fc1's and fc2's gradients (the first backward makes them, or this: idempotent). */
tp_status_t tp_parallel_mlp_alloc_grads(tp_parallel_mlp_t m) {
  TP_NONNULL("mlp alloc_grads", m, "mlp");
  tp_status_t st = tp_parallel_linear_alloc_grads(m->fc1);
  if (st == TP_SUCCESS) st = tp_parallel_linear_alloc_grads(m->fc2);
  if (st != TP_SUCCESS) tp_error_prefix("mlp");
  return st;
}

tp_parallel_linear_t tp_parallel_mlp_layer(tp_parallel_mlp_t m, int which) {
  return !m ? NULL : which == 0 ? m->fc1 : which == 1 ? m->fc2 : NULL; /* 0: fc1, 1: fc2 */
}

/* Workspaces for M rows (M checked by the caller): h and dh [M, f1], a and da [M, f]. */
static tp_status_t workspace(tp_parallel_mlp_t m, int64_t M) {
  size_t total = 0;
  int ok = tp_arena_add_n(&total, M * m->f1, sizeof(float)) && tp_arena_add_n(&total, M * m->f, sizeof(float)) &&
           tp_arena_add_n(&total, M * m->f, sizeof(float)) && tp_arena_add_n(&total, M * m->f1, sizeof(float));
  tp_linear_info_t i1;
  tp_parallel_linear_info(m->fc1, &i1);
  /* sized by the bias, not its gradient: that one may appear only at the first backward */
  size_t bws = i1.bias ? lk_bias_act_backward_workspace(&m->lk, M, m->f, m->act) : 0;
  ok = ok && tp_arena_add(&total, bws);
  if (!ok) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp: %lld rows overflow a workspace size", (long long)M);
  TP_CHECK(tp_arena_reserve(&m->ws, total, "mlp"));
  m->h = tp_arena_take_n(&m->ws, M * m->f1, sizeof(float));
  m->a = tp_arena_take_n(&m->ws, M * m->f, sizeof(float));
  m->da = tp_arena_take_n(&m->ws, M * m->f, sizeof(float));
  m->dh = tp_arena_take_n(&m->ws, M * m->f1, sizeof(float));
  m->bws = tp_arena_take(&m->ws, bws);
  m->bws_bytes = bws;
  return TP_SUCCESS;
}

static tp_status_t check_rows(tp_parallel_mlp_t m, int64_t M) {
  int64_t n;
  if (M < 0 || M > INT_MAX || !tp_numel2(M, m->f1 > m->f ? m->f1 : m->f, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "mlp forward: %lld rows is out of range (0 to %d, and rows x "
                        "ffn columns (%lld) at most 2^40)",
                        (long long)M, INT_MAX, (long long)m->f1);
  return TP_SUCCESS;
}

tp_status_t tp_parallel_mlp_forward_raw(tp_parallel_mlp_t m, float *y, const float *x, int64_t M, tp_stream_t stream) {
  TP_CHECK(check_rows(m, M));
  m->last_m = -1; /* a failed forward leaves no backward over freed or half-written workspaces */
  /* A workspace failure happens before any collective, on this rank only: the peers
   * would wait in fc2's all-reduce, so fail them too (through the layer's comm). */
  tp_status_t st = workspace(m, M);
  if (st != TP_SUCCESS) {
    tp_comm_abort(m->comm, tp_last_error());
    return st;
  }
  /* fc1 without its bias, then h += b1 and a = act(h) in one pass over h */
  TP_CHECK(tp_parallel_linear_forward_ex(m->fc1, m->h, x, M, TP_LIN_SKIP_BIAS, stream));
  tp_linear_info_t i1;
  tp_parallel_linear_info(m->fc1, &i1);
  TP_CHECK(lk_bias_act_forward(&m->lk, m->a, m->h, i1.bias, M, m->f, m->act, stream));
  TP_CHECK(tp_parallel_linear_forward_ex(m->fc2, y, m->a, M, TP_LIN_BORROW_INPUT, stream)); /* a lives until backward */
  m->last_m = M;
  return TP_SUCCESS;
}

tp_status_t tp_parallel_mlp_forward_nograd(tp_parallel_mlp_t m, float *y, const float *x, int64_t M, float *h, float *a,
                                           tp_stream_t stream) {
  TP_CHECK(check_rows(m, M));
  m->last_m = -1; /* nothing kept: no backward after this forward */
  int f = TP_LIN_BORROW_INPUT | TP_LIN_NO_BACKWARD;
  TP_CHECK(tp_parallel_linear_forward_ex(m->fc1, h, x, M, f | TP_LIN_SKIP_BIAS, stream));
  tp_linear_info_t i1;
  tp_parallel_linear_info(m->fc1, &i1);
  TP_CHECK(lk_bias_act_forward(&m->lk, a, h, i1.bias, M, m->f, m->act, stream));
  return tp_parallel_linear_forward_ex(m->fc2, y, a, M, f, stream);
}

void tp_parallel_mlp_widths(tp_parallel_mlp_t m, int64_t *f1, int64_t *f) {
  *f1 = m->f1;
  *f = m->f;
}

tp_status_t tp_parallel_mlp_backward_raw(tp_parallel_mlp_t m, float *dx, const float *dy, int64_t M,
                                         tp_stream_t stream) {
  if (m->last_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "mlp backward: called before forward");
  if (M != m->last_m)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mlp backward: dy has %lld rows but the last forward had %lld",
                        (long long)M, (long long)m->last_m);
  /* fc1's bias gradient is accumulated here (fused with the activation): allocate both
   * layers' gradients first; a failure on this rank only fails the peers too */
  tp_status_t gst = tp_parallel_mlp_alloc_grads(m);
  if (gst != TP_SUCCESS) {
    tp_comm_abort(m->comm, tp_last_error());
    return gst;
  }
  TP_CHECK(tp_parallel_linear_backward_ex(m->fc2, m->da, dy, M, 0, stream));
  /* dh, and fc1's bias gradient from the same pass */
  tp_linear_info_t i1;
  tp_parallel_linear_info(m->fc1, &i1);
  tp_status_t st =
      lk_bias_act_backward(&m->lk, m->dh, i1.grad_bias, m->h, m->da, M, m->f, m->act, m->bws, m->bws_bytes, stream);
  if (st != TP_SUCCESS) {
    tp_error_prefix("mlp backward");
    tp_comm_abort(m->comm, tp_last_error()); /* the peers would wait in fc1's all-reduce */
    return st;
  }
  return tp_parallel_linear_backward_ex(m->fc1, dx, m->dh, M, TP_LIN_SKIP_BIAS, stream);
}

tp_status_t tp_parallel_mlp_forward(tp_parallel_mlp_t m, const tp_tensor *y, const tp_tensor *x, tp_stream_t stream) {
  TP_NONNULL("mlp forward", m, "mlp");
  TP_CHECK(tp_check_stream("mlp forward", m->dev, stream));
  TP_NONNULL("mlp forward", x, "x");
  TP_NONNULL("mlp forward", y, "y");
  int64_t M = 0;
  TP_CHECK(tp_check_matrix("mlp forward", "x", x, TP_FLOAT32, -1, m->C, m->dev, m->dev_id, &M));
  TP_CHECK(check_rows(m, M));
  TP_CHECK(tp_check_matrix("mlp forward", "y", y, TP_FLOAT32, M, m->C, m->dev, m->dev_id, NULL));
  return tp_parallel_mlp_forward_raw(m, y->data, x->data, M, stream);
}

tp_status_t tp_parallel_mlp_backward(tp_parallel_mlp_t m, const tp_tensor *dx, const tp_tensor *dy,
                                     tp_stream_t stream) {
  TP_NONNULL("mlp backward", m, "mlp");
  TP_CHECK(tp_check_stream("mlp backward", m->dev, stream));
  TP_NONNULL("mlp backward", dx, "dx");
  TP_NONNULL("mlp backward", dy, "dy");
  int64_t M = 0;
  TP_CHECK(tp_check_matrix("mlp backward", "dy", dy, TP_FLOAT32, -1, m->C, m->dev, m->dev_id, &M));
  TP_CHECK(tp_check_matrix("mlp backward", "dx", dx, TP_FLOAT32, M, m->C, m->dev, m->dev_id, NULL));
  return tp_parallel_mlp_backward_raw(m, dx->data, dy->data, M, stream);
}

/* fc1's and fc2's memory plus the MLP's own activation arena (h, a, da, dh and the bias +
 * activation backward's scratch) under workspace. */
tp_status_t tp_parallel_mlp_memory(tp_parallel_mlp_t m, tp_layer_memory_t *mem) {
  TP_NONNULL("mlp memory", m, "mlp");
  TP_CHECK(tp_memory_begin("mlp memory", mem, m->dev, m->dev_id));
  tp_layer_memory_t sub;
  sub.size = sizeof sub;
  TP_CHECK(tp_parallel_linear_memory(m->fc1, &sub));
  tp_memory_add(mem, &sub);
  TP_CHECK(tp_parallel_linear_memory(m->fc2, &sub));
  tp_memory_add(mem, &sub);
  mem->workspace += m->ws.cap;
  return TP_SUCCESS;
}
