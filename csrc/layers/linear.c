/* Column- and row-parallel linear layers: kernels (BLAS GEMMs) + collectives. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers_impl.h"
#include "tpcore/kernels.h"
#include "tpcore/layers.h"

struct tp_parallel_linear {
  tp_comm_t comm;
  tp_linear_config_t cfg;
  int rank, world;
  int64_t *part, *offs; /* split-dimension sizes and offsets, world entries */
  int64_t off, loc;     /* this rank's slice */
  float *w, *b, *dw, *db;
  int64_t wr, wc;       /* weight shard rows x cols */
  float *xsave;         /* a copy of the last forward's input (this rank's columns), M x x_local */
  const float *xin;     /* the input backward uses: xsave, or the caller's x when borrowed */
  int flags;            /* TP_LIN_* of the call in progress (layers_impl.h) */
  float *dytmp;         /* column backward with gather_output: this rank's columns of dy */
  int64_t dytmp_cap;
  /* xsave_m: rows of the last forward, -1 before the first */
  int64_t xsave_m, xsave_cap;
  reg_buf out_buf;      /* row: partial outputs to all-reduce; column: gathered blocks */
  reg_buf grad_buf;     /* column: dx partials to all-reduce; row: dx blocks to gather */
};

/* uniform in [-bound, bound) for element `index` of tensor `tensor` (0 weight, 1 bias) */
static float init_value(uint64_t seed, uint64_t tensor, uint64_t index, float bound) {
  return (float)((2.0 * tp_uniform01(seed, tensor, index) - 1.0) * bound);
}

static tp_status_t ensure_reg(tp_parallel_linear_t L, reg_buf *rb, size_t nbytes) {
  return tp_reg_ensure(L->comm, rb, nbytes);
}

static tp_status_t save_input(tp_parallel_linear_t L, const float *x, int64_t M, int64_t cols,
                              int64_t col0, int64_t stride) {
  int64_t need = M * L->wc;
  if (need == 0 || ((L->flags & TP_LIN_BORROW_INPUT) && cols == stride)) { /* nothing to keep, or x outlives the step */
    L->xin = x;
    L->xsave_m = M;
    return TP_SUCCESS;
  }
  if (need > L->xsave_cap) {
    float *p = realloc(L->xsave, (size_t)(need ? need : 1) * sizeof(float));
    if (!p) return tp_set_error(TP_ERR_NOMEM, "linear: out of memory saving the input (%lld floats)", (long long)need);
    L->xsave = p;
    L->xsave_cap = need;
  }
  if (cols == stride)
    memcpy(L->xsave, x, (size_t)need * sizeof(float));
  else
    for (int64_t m = 0; m < M; m++) memcpy(L->xsave + m * cols, x + m * stride + col0, (size_t)cols * sizeof(float));
  L->xin = L->xsave;
  L->xsave_m = M;
  return TP_SUCCESS;
}

void tp_parallel_linear_destroy(tp_parallel_linear_t L) {
  if (!L) return;
  tp_reg_release(&L->out_buf);
  tp_reg_release(&L->grad_buf);
  free(L->part);
  free(L->offs);
  free(L->w);
  free(L->b);
  free(L->dw);
  free(L->db);
  free(L->xsave);
  free(L->dytmp);
  free(L);
}

tp_status_t tp_parallel_linear_create(tp_parallel_linear_t *out, tp_comm_t comm, const tp_linear_config_t *cfg) {
  if (!out || !comm || !cfg) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: NULL argument");
  *out = NULL;
  if (cfg->size != sizeof(tp_linear_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: config built for another tpcore version");
  if (cfg->in_features < 1 || cfg->out_features < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: in_features and out_features must be >= 1, got %lld and %lld",
                        (long long)cfg->in_features, (long long)cfg->out_features);
  if (cfg->kind != TP_COLUMN_PARALLEL && cfg->kind != TP_ROW_PARALLEL)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: kind must be column or row parallel");
  tp_parallel_linear_t L = calloc(1, sizeof *L);
  if (!L) return tp_set_error(TP_ERR_NOMEM, "linear: out of memory");
  L->comm = comm;
  L->xsave_m = -1;
  L->cfg = *cfg;
  L->cfg.partition = NULL;
  tp_comm_rank(comm, &L->rank);
  tp_comm_size(comm, &L->world);
  int n = L->world;
  int col = cfg->kind == TP_COLUMN_PARALLEL;
  int64_t dim = col ? cfg->out_features : cfg->in_features;
  L->part = calloc((size_t)n, sizeof(int64_t));
  L->offs = calloc((size_t)n + 1, sizeof(int64_t));
  if (!L->part || !L->offs) {
    tp_parallel_linear_destroy(L);
    return tp_set_error(TP_ERR_NOMEM, "linear: out of memory");
  }
  int64_t sum = 0;
  for (int p = 0; p < n; p++) {
    int64_t v = cfg->partition ? cfg->partition[p] : dim / n + (p < dim % n);
    if (v < 0) {
      tp_parallel_linear_destroy(L);
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: partition[%d] is negative (%lld)", p, (long long)v);
    }
    L->part[p] = v;
    L->offs[p] = sum;
    if (!tp_add_count(sum, v, &sum)) {
      tp_parallel_linear_destroy(L);
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: the partition sums past 2^63 - 1 (partition[%d] = %lld)",
                          p, (long long)v);
    }
  }
  L->offs[n] = sum;
  if (sum != dim) {
    tp_parallel_linear_destroy(L);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "linear: the partition sums to %lld but the split dimension (%s_features) is %lld",
                        (long long)sum, col ? "out" : "in", (long long)dim);
  }
  L->off = L->offs[L->rank];
  L->loc = L->part[L->rank];
  int64_t K = cfg->in_features, N = cfg->out_features;
  if (cfg->gated && (!col || cfg->gather_output)) {
    tp_parallel_linear_destroy(L);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: gated is for column-parallel layers without gather_output");
  }
  int g = cfg->gated ? 2 : 1;
  /* GEMM dimensions go to BLAS as 32-bit ints; the shard must also fit in memory. */
  if (K > INT_MAX || N > INT_MAX / g) {
    tp_parallel_linear_destroy(L);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: in_features %lld and %sout_features %lld must be at most "
                        "%d (BLAS uses 32-bit dimensions)", (long long)K, g == 2 ? "2 x (gated) " : "", (long long)N,
                        INT_MAX);
  }
  L->wr = col ? g * L->loc : N;
  L->wc = col ? K : L->loc;
  int64_t blen = cfg->bias ? (col ? g * L->loc : N) : 0;
  int64_t wn64;
  if (!tp_numel2(L->wr, L->wc, &wn64)) { /* the message first: it reads the layer's fields */
    tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: a weight shard of %lld x %lld (in_features %lld, out_features "
                 "%lld) is too large: at most 2^40 elements per shard", (long long)L->wr, (long long)L->wc,
                 (long long)K, (long long)N);
    tp_parallel_linear_destroy(L);
    return TP_ERR_INVALID_ARGUMENT;
  }
  size_t wn = (size_t)wn64;
  L->w = malloc((wn ? wn : 1) * sizeof(float));
  L->dw = calloc(wn ? wn : 1, sizeof(float));
  if (cfg->bias) {
    L->b = malloc((size_t)(blen ? blen : 1) * sizeof(float));
    L->db = calloc((size_t)(blen ? blen : 1), sizeof(float));
  }
  if (!L->w || !L->dw || (cfg->bias && (!L->b || !L->db))) {
    tp_parallel_linear_destroy(L);
    return tp_set_error(TP_ERR_NOMEM, "linear: out of memory for the weight shard (%zu floats)", wn);
  }
  float bound = 1.0f / sqrtf((float)K);
  for (int64_t i = 0; i < L->wr; i++) {
    /* row of the full weight: gated shards hold gate rows then up rows (up starts at N) */
    int64_t frow = !col ? i : i < L->loc ? L->off + i : N + L->off + (i - L->loc);
    for (int64_t j = 0; j < L->wc; j++) {
      uint64_t full = col ? (uint64_t)(frow * K + j) : (uint64_t)(i * K + L->off + j);
      L->w[i * L->wc + j] = init_value(cfg->seed, 0, full, bound);
    }
  }
  for (int64_t i = 0; i < blen; i++) {
    int64_t frow = !col ? i : i < L->loc ? L->off + i : N + L->off + (i - L->loc);
    L->b[i] = init_value(cfg->seed, 1, (uint64_t)frow, bound);
  }
  *out = L;
  return TP_SUCCESS;
}

tp_status_t tp_parallel_linear_info(tp_parallel_linear_t L, tp_linear_info_t *info) {
  if (!L || !info) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: NULL argument");
  int col = L->cfg.kind == TP_COLUMN_PARALLEL;
  info->weight = L->w;
  info->bias = L->b;
  info->grad_weight = L->dw;
  info->grad_bias = L->db;
  info->weight_rows = L->wr;
  info->weight_cols = L->wc;
  info->bias_len = L->cfg.bias ? (col ? L->wr : L->cfg.out_features) : 0;
  info->offset = L->off;
  info->local = L->loc;
  info->x_cols = col ? L->cfg.in_features : (L->cfg.input_is_parallel ? L->loc : L->cfg.in_features);
  info->y_cols = col ? (L->cfg.gather_output ? L->cfg.out_features : L->wr) : L->cfg.out_features;
  return TP_SUCCESS;
}

/* out[M, total] from rank-major blocks blk[p] = [M, part[p]] (the all-gather layout). */
static void blocks_to_columns(float *out, const float *blocks, const int64_t *part, const int64_t *offs, int n,
                              int64_t M, int64_t total) {
  for (int p = 0; p < n; p++) {
    const float *src = blocks + offs[p] * M;
    for (int64_t m = 0; m < M; m++)
      memcpy(out + m * total + offs[p], src + m * part[p], (size_t)part[p] * sizeof(float));
  }
}

/* The registered buffer g holds this rank's [M, local] block at its rank-major place:
 * all-gather the blocks in place (zero-copy), then lay them out as out[M, total]. */
static tp_status_t gather_columns(tp_parallel_linear_t L, float *out, float *g, int64_t M, int64_t total) {
  size_t *counts = malloc(sizeof(size_t) * (size_t)L->world);
  if (!counts) return tp_set_error(TP_ERR_NOMEM, "linear: out of memory");
  for (int p = 0; p < L->world; p++) counts[p] = (size_t)(L->part[p] * M);
  tp_status_t st = tp_all_gather_v(g + L->off * M, g, counts, TP_FLOAT32, L->comm, NULL);
  free(counts);
  TP_CHECK(st);
  blocks_to_columns(out, g, L->part, L->offs, L->world, M, total);
  return TP_SUCCESS;
}

static tp_status_t check_rows(tp_parallel_linear_t L, int64_t M, const char *op) {
  int64_t widest = L->cfg.in_features > L->cfg.out_features ? L->cfg.in_features : L->cfg.out_features, n;
  if (M < 0 || M > INT_MAX || !tp_numel2(M, 2 * widest, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear %s: %lld rows is out of range (at most %d, and rows x "
                        "features must fit in memory)", op, (long long)M, INT_MAX);
  return TP_SUCCESS;
}

/* A failure on this rank before a collective would leave the peers waiting for it:
 * abort the communicator so that they fail at once, naming this rank. */
static tp_status_t fail_local(tp_parallel_linear_t L, tp_status_t st) {
  if (st == TP_ERR_NOMEM || st == TP_ERR_INTERNAL) tp_comm_abort(L->comm, tp_last_error());
  return st;
}

static tp_status_t forward_impl(tp_parallel_linear_t L, float *y, const float *x, int64_t M);
static tp_status_t backward_impl(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M);

tp_status_t tp_parallel_linear_forward(tp_parallel_linear_t L, float *y, const float *x, int64_t M) {
  if (!L || (M && (!x || !y))) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear forward: NULL argument");
  TP_CHECK(check_rows(L, M, "forward"));
  return fail_local(L, forward_impl(L, y, x, M));
}

tp_status_t tp_parallel_linear_forward_ex(tp_parallel_linear_t L, float *y, const float *x, int64_t M, int flags) {
  L->flags = flags;
  tp_status_t st = tp_parallel_linear_forward(L, y, x, M);
  L->flags = 0;
  return st;
}

tp_status_t tp_parallel_linear_backward_ex(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M, int flags) {
  L->flags = flags;
  tp_status_t st = tp_parallel_linear_backward(L, dx, dy, M);
  L->flags = 0;
  return st;
}

tp_status_t tp_parallel_linear_backward(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M) {
  if (!L || (M && (!dy || !dx))) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear backward: NULL argument");
  TP_CHECK(check_rows(L, M, "backward"));
  return fail_local(L, backward_impl(L, dx, dy, M));
}

static tp_status_t forward_impl(tp_parallel_linear_t L, float *y, const float *x, int64_t M) {
  L->xsave_m = -1; /* set again once this forward's input is kept (copied or borrowed) */
  int64_t K = L->cfg.in_features, N = L->cfg.out_features;
  const float *b = (L->flags & TP_LIN_SKIP_BIAS) ? NULL : L->b;
  if (L->cfg.kind == TP_COLUMN_PARALLEL) {
    TP_CHECK(save_input(L, x, M, K, 0, K));
    if (!L->cfg.gather_output || L->world == 1) {
      tp_legacy_linear_forward(y, x, L->w, b, M, K, L->wr);
      return TP_SUCCESS;
    }
    /* GEMM straight into my block of the registered gather buffer: the all-gather is in place. */
    TP_CHECK(ensure_reg(L, &L->out_buf, (size_t)(M * N) * sizeof(float)));
    float *g = L->out_buf.ptr;
    tp_legacy_linear_forward(g + L->off * M, x, L->w, b, M, K, L->loc);
    return gather_columns(L, y, g, M, N);
  }
  /* Row parallel. */
  int64_t xcols = L->cfg.input_is_parallel ? L->loc : K;
  TP_CHECK(save_input(L, x, M, L->loc, L->cfg.input_is_parallel ? 0 : L->off, xcols));
  if (L->world == 1) {
    tp_legacy_linear_forward(y, L->xin, L->w, b, M, L->loc, N);
    return TP_SUCCESS;
  }
  TP_CHECK(ensure_reg(L, &L->out_buf, (size_t)(M * N) * sizeof(float)));
  float *r = L->out_buf.ptr;
  tp_legacy_linear_forward(r, L->xin, L->w, NULL, M, L->loc, N);
  TP_CHECK(tp_all_reduce(r, r, (size_t)(M * N), TP_FLOAT32, TP_SUM, L->comm, NULL));
  if (b) {
    for (int64_t m = 0; m < M; m++) {
      const float *src = r + m * N;
      float *dst = y + m * N;
      for (int64_t j = 0; j < N; j++) dst[j] = src[j] + b[j];
    }
  } else {
    TP_COPY(y, r, (size_t)(M * N) * sizeof(float));
  }
  return TP_SUCCESS;
}

static tp_status_t backward_impl(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M) {
  if (L->xsave_m < 0)
    return tp_set_error(TP_ERR_INVALID_USAGE, "linear backward: called before forward");
  if (M != L->xsave_m)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear backward: dy has %lld rows but the last forward had %lld",
                        (long long)M, (long long)L->xsave_m);
  int64_t K = L->cfg.in_features, N = L->cfg.out_features;
  float *db = (L->flags & TP_LIN_SKIP_BIAS) ? NULL : L->db;
  if (L->cfg.kind == TP_COLUMN_PARALLEL) {
    const float *dyr = dy;
    if (L->cfg.gather_output && L->world > 1) { /* my columns of the full dy */
      TP_CHECK(tp_grow((void **)&L->dytmp, &L->dytmp_cap, M * L->loc, sizeof(float), "linear backward"));
      for (int64_t m = 0; m < M; m++) memcpy(L->dytmp + m * L->loc, dy + m * N + L->off, (size_t)L->loc * sizeof(float));
      dyr = L->dytmp;
    }
    if (L->world == 1) {
      tp_legacy_linear_backward(dx, L->dw, db, dyr, L->xin, L->w, M, K, L->wr, 0);
      return TP_SUCCESS;
    }
    TP_CHECK(ensure_reg(L, &L->grad_buf, (size_t)(M * K) * sizeof(float)));
    float *d = L->grad_buf.ptr;
    tp_legacy_linear_backward(d, L->dw, db, dyr, L->xin, L->w, M, K, L->wr, 0);
    TP_CHECK(tp_all_reduce(d, d, (size_t)(M * K), TP_FLOAT32, TP_SUM, L->comm, NULL));
    TP_COPY(dx, d, (size_t)(M * K) * sizeof(float));
    return TP_SUCCESS;
  }
  /* Row parallel: dy is the full gradient on every rank. */
  if (L->cfg.input_is_parallel || L->world == 1) {
    tp_legacy_linear_backward(dx, L->dw, db, dy, L->xin, L->w, M, L->loc, N, 0);
    return TP_SUCCESS;
  }
  TP_CHECK(ensure_reg(L, &L->grad_buf, (size_t)(M * K) * sizeof(float)));
  float *g = L->grad_buf.ptr;
  tp_legacy_linear_backward(g + L->off * M, L->dw, db, dy, L->xin, L->w, M, L->loc, N, 0);
  return gather_columns(L, dx, g, M, K);
}
