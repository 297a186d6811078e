/* Column- and row-parallel linear layers: kernels (BLAS GEMMs) + collectives. */
#include <limits.h>
#include <math.h>

#include "block_impl.h"
#include "layer_kernels.h"

struct tp_parallel_linear {
  tp_comm_t comm;
  tp_linear_config_t cfg;
  int rank, world;
  tp_device_t dev;
  int dev_id;
  tp_lk lk;             /* the device's kernels */
  int64_t *part, *offs; /* split-dimension sizes and offsets (world, world + 1 entries; in the handle) */
  size_t *counts;       /* all-gather counts of the current call (world entries; in the handle) */
  int64_t off, loc;     /* this rank's slice */
  float *b, *dw, *db;   /* bias, weight and bias gradients: float32 (dw, db NULL until ensure_grads) */
  tp_lk_w W;            /* the weight shard: float32, bfloat16 or float16 (W.lpws = &lpws) */
  tp_arena_t lpws;      /* the low-precision entries' workspace */
  int64_t wr, wc;       /* weight shard rows x cols */
  int64_t wn, blen;     /* elements of dw and of b / db (0: no bias) */
  int frozen;           /* a quantized weight: no dw */
  tp_arena_t params;    /* w, b: one allocation */
  tp_arena_t grads;     /* dw (not for a quantized weight), db: allocated on demand (ensure_grads) */
  tp_arena_t ws;        /* xsave and dytmp, carved per forward */
  float *xsave;         /* a copy of the last forward's input (this rank's columns), M x x_local */
  const float *xin;     /* the input backward uses: xsave, or the caller's x when borrowed */
  float *dytmp;         /* column backward with gather_output: this rank's columns of dy */
  int flags;            /* TP_LIN_* of the call in progress (layers_impl.h) */
  int64_t xsave_m;      /* rows of the last forward, -1 before the first */
  reg_buf out_buf;      /* row: partial outputs to all-reduce; column: gathered blocks */
  reg_buf *ext_out;     /* a borrowed out_buf (a block's shared inference buffer; NULL: its own) */
  reg_buf grad_buf;     /* column: dx partials to all-reduce; row: dx blocks to gather */
  const char *region;   /* the tag of its collectives (NULL: the communicator's current one) */
};

void tp_parallel_linear_set_region(tp_parallel_linear_t L, const char *region) { L->region = region; }

void tp_parallel_linear_borrow_out(tp_parallel_linear_t L, reg_buf *rb) { L->ext_out = rb; }

/* The collective output buffer of this call: the borrowed one, or the layer's own. */
static reg_buf *outbuf(tp_parallel_linear_t L) { return L->ext_out ? L->ext_out : &L->out_buf; }

static tp_status_t ensure_reg(tp_parallel_linear_t L, reg_buf *rb, size_t nbytes) {
  return tp_reg_ensure(L->comm, rb, nbytes, L->dev, L->dev_id);
}

/* This forward's workspaces: the saved input (unless borrowed) and backward's dy columns. */
static tp_status_t workspace(tp_parallel_linear_t L, int64_t M, int borrow) {
  int col = L->cfg.kind == TP_COLUMN_PARALLEL;
  int64_t nx = borrow ? 0 : M * L->wc, nd = col && L->cfg.gather_output && L->world > 1 ? M * L->loc : 0;
  size_t total = 0;
  if (!tp_arena_add_n(&total, nx, sizeof(float)) || !tp_arena_add_n(&total, nd, sizeof(float)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: %lld rows overflow a workspace size", (long long)M);
  TP_CHECK(tp_arena_reserve(&L->ws, total, "linear"));
  L->xsave = tp_arena_take_n(&L->ws, nx, sizeof(float));
  L->dytmp = tp_arena_take_n(&L->ws, nd, sizeof(float));
  return TP_SUCCESS;
}

static tp_status_t save_input(tp_parallel_linear_t L, const float *x, int64_t M, int64_t cols, int64_t col0,
                              int64_t stride, tp_stream_t stream) {
  int borrow = M * L->wc == 0 || ((L->flags & TP_LIN_BORROW_INPUT) && cols == stride);
  TP_CHECK(workspace(L, M, borrow));
  if (borrow) { /* nothing to keep, or x outlives the step */
    L->xin = x;
    L->xsave_m = (L->flags & TP_LIN_NO_BACKWARD) ? -1 : M; /* no backward: x dies with the call */
    return TP_SUCCESS;
  }
  TP_CHECK(lk_copy_rows(&L->lk, L->xsave, cols, x + col0, stride, M, cols, stream));
  L->xin = L->xsave;
  L->xsave_m = M;
  return TP_SUCCESS;
}

/* W and b ~ U(-1/sqrt(in), 1/sqrt(in)) from (seed, tensor id, index of the
 * full tensor), drawn on the device in runs of consecutive full-tensor elements. */
static tp_status_t init_params(tp_parallel_linear_t L, uint64_t weight_id, uint64_t bias_id) {
  int col = L->cfg.kind == TP_COLUMN_PARALLEL, g = L->cfg.gated ? 2 : 1;
  int64_t K = L->cfg.in_features, N = L->cfg.out_features;
  uint64_t seed = L->cfg.seed;
  float bound = 1.0f / sqrtf((float)K);
  if (col) { /* whole rows: the gate rows [off, off + loc), then (gated) the up rows from N + off */
    for (int h = 0; h < g; h++) {
      int64_t frow = h * N + L->off;
      TP_CHECK(lk_init_w(&L->lk, &L->W, h * L->loc * K, L->loc * K, K, 0, seed, weight_id, (uint64_t)(frow * K), bound,
                         NULL));
      if (L->b)
        TP_CHECK(lk_init_uniform(&L->lk, L->b + h * L->loc, L->loc, seed, bias_id, (uint64_t)frow, bound, NULL));
    }
  } else { /* columns [off, off + loc) of every row */
    for (int64_t i = 0; i < N; i++)
      TP_CHECK(lk_init_w(&L->lk, &L->W, i * L->loc, L->loc, L->loc, 0, seed, weight_id, (uint64_t)(i * K + L->off),
                         bound, NULL));
    if (L->b) TP_CHECK(lk_init_uniform(&L->lk, L->b, N, seed, bias_id, 0, bound, NULL));
  }
  TP_CHECK(tp_device_sync(L->dev, L->dev_id, NULL));
  tp_arena_release(&L->lpws); /* the init scratch of a 16-bit weight; forward takes its own */
  return TP_SUCCESS;
}

void tp_parallel_linear_destroy(tp_parallel_linear_t L) {
  if (!L) return;
  tp_reg_release(&L->out_buf);
  tp_reg_release(&L->grad_buf);
  tp_arena_release(&L->params);
  tp_arena_release(&L->grads);
  tp_arena_release(&L->ws);
  tp_arena_release(&L->lpws);
  tp_host_free(L);
}

tp_status_t tp_parallel_linear_create(tp_parallel_linear_t *out, tp_comm_t comm, const tp_linear_config_t *cfg) {
  return tp_parallel_linear_create_ids(out, comm, cfg, 0, 1);
}

tp_status_t tp_parallel_linear_create_ids(tp_parallel_linear_t *out, tp_comm_t comm, const tp_linear_config_t *cfg,
                                          uint64_t weight_id, uint64_t bias_id) {
  TP_NONNULL("linear", out, "out");
  TP_NONNULL("linear", comm, "comm");
  TP_NONNULL("linear", cfg, "config");
  *out = NULL;
  if (cfg->size != sizeof(tp_linear_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: config built for another tpcore version");
  TP_CHECK(tp_lk_check_wdtype("linear", cfg->weight_dtype));
  if (cfg->in_features < 1 || cfg->out_features < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: in_features and out_features must be >= 1, got %lld and %lld",
                        (long long)cfg->in_features, (long long)cfg->out_features);
  if (cfg->kind != TP_COLUMN_PARALLEL && cfg->kind != TP_ROW_PARALLEL)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: kind must be column or row parallel");
  TP_CHECK(tp_layer_device("linear", cfg->device, cfg->device_id));
  int rank, n;
  tp_comm_rank(comm, &rank);
  tp_comm_size(comm, &n);
  /* the handle and its per-rank arrays: one host allocation */
  size_t hbytes =
      sizeof(struct tp_parallel_linear) + (size_t)(2 * n + 1) * sizeof(int64_t) + (size_t)n * sizeof(size_t);
  tp_parallel_linear_t L;
  TP_CHECK(tp_host_zalloc(hbytes, (void **)&L, "linear"));
  L->part = (int64_t *)(L + 1);
  L->offs = L->part + n;
  L->counts = (size_t *)(L->offs + n + 1);
  L->comm = comm;
  L->xsave_m = -1;
  L->cfg = *cfg;
  L->cfg.partition = NULL;
  L->rank = rank;
  L->world = n;
  L->dev = cfg->device;
  L->dev_id = cfg->device_id;
  tp_arena_init(&L->params, L->dev, L->dev_id);
  tp_arena_init(&L->grads, L->dev, L->dev_id);
  tp_arena_init(&L->ws, L->dev, L->dev_id);
  tp_arena_init(&L->lpws, L->dev, L->dev_id);
  L->W.dt = cfg->weight_dtype;
  L->W.lpws = &L->lpws;
  int col = cfg->kind == TP_COLUMN_PARALLEL;
  int64_t dim = col ? cfg->out_features : cfg->in_features;
  tp_status_t st = tp_lk_init(&L->lk, "linear", L->dev, L->dev_id);
  if (st == TP_SUCCESS)
    st = tp_partition_sizes(dim, n, cfg->partition, L->part, L->offs, "linear: partition",
                            col ? "the split dimension (out_features)" : "the split dimension (in_features)");
  if (st != TP_SUCCESS) {
    tp_parallel_linear_destroy(L);
    return st;
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
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "linear: in_features %lld and %sout_features %lld must be at most "
                        "%d (BLAS uses 32-bit dimensions)",
                        (long long)K, g == 2 ? "2 x (gated) " : "", (long long)N, INT_MAX);
  }
  L->wr = col ? g * L->loc : N;
  L->wc = col ? K : L->loc;
  /* A block format splits rows into blocks of 32 or 256 along in_features: a column-parallel
   * shard holds whole rows, a row-parallel one whole blocks of each row (partition in whole
   * blocks: tpcore.partition(..., align=)). */
  int64_t blk = tp_lk_block(cfg->weight_dtype);
  if (blk > 1 && (col ? K % blk != 0 : 0)) {
    tp_parallel_linear_destroy(L);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "linear: in_features %lld is not a multiple of %s's block of %lld "
                        "elements",
                        (long long)K, tp_dtype_name(cfg->weight_dtype), (long long)blk);
  }
  if (blk > 1 && !col) {
    for (int p = 0; p < n; p++)
      if (L->part[p] % blk || L->offs[p] % blk) {
        tp_set_error(TP_ERR_INVALID_ARGUMENT,
                     "linear: rank %d's slice of in_features (%lld at %lld) is not whole "
                     "blocks of %lld elements (%s weights split on block boundaries: partition(n, world, align=%lld))",
                     p, (long long)L->part[p], (long long)L->offs[p], (long long)blk, tp_dtype_name(cfg->weight_dtype),
                     (long long)blk);
        tp_parallel_linear_destroy(L);
        return TP_ERR_INVALID_ARGUMENT;
      }
  }
  int quant = tp_weight_is_quantized(cfg->weight_dtype); /* frozen: no weight gradient */
  int64_t blen = cfg->bias ? (col ? g * L->loc : N) : 0;
  int64_t wn;
  if (!tp_numel2(L->wr, L->wc, &wn)) { /* the message first: it reads the layer's fields */
    tp_set_error(TP_ERR_INVALID_ARGUMENT,
                 "linear: a weight shard of %lld x %lld (in_features %lld, out_features "
                 "%lld) is too large: at most 2^40 elements per shard",
                 (long long)L->wr, (long long)L->wc, (long long)K, (long long)N);
    tp_parallel_linear_destroy(L);
    return TP_ERR_INVALID_ARGUMENT;
  }
  /* w, b: one allocation (sizes bounded by 2^40 elements above); the gradients come later */
  size_t total = 0, wbytes = 0;
  st = tp_lk_wbytes("linear", "the weight shard", L->W.dt, L->wr, L->wc, &wbytes);
  if (st != TP_SUCCESS) {
    tp_parallel_linear_destroy(L);
    return st;
  }
  L->blen = blen;
  L->wn = wn;
  L->frozen = quant; /* no weight gradient */
  tp_arena_add_n(&total, (int64_t)wbytes, 1);
  tp_arena_add_n(&total, blen, sizeof(float));
  st = tp_arena_reserve(&L->params, total, "linear: parameters");
  if (st == TP_SUCCESS) {
    L->W.p = tp_arena_take_n(&L->params, (int64_t)wbytes, 1);
    L->b = cfg->bias ? tp_arena_take_n(&L->params, blen, sizeof(float)) : NULL;
    st = lk_zero(&L->lk, L->params.base, L->params.cap, NULL);
    if (st == TP_SUCCESS) st = init_params(L, weight_id, bias_id);
  }
  if (st != TP_SUCCESS) {
    tp_parallel_linear_destroy(L);
    return st;
  }
  *out = L;
  return TP_SUCCESS;
}

/* dw (unless the weight is quantized) and db, zeroed: one allocation, made by the first
 * backward or tp_parallel_linear_alloc_grads; a layer used only forward never holds them. */
static tp_status_t ensure_grads(tp_parallel_linear_t L) {
  if (L->grads.base || (L->frozen && !L->cfg.bias)) return TP_SUCCESS;
  size_t total = 0;
  if ((!L->frozen && !tp_arena_add_n(&total, L->wn, sizeof(float))) ||
      (L->cfg.bias && !tp_arena_add_n(&total, L->blen, sizeof(float))))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear: the gradients of a %lld x %lld shard overflow a size",
                        (long long)L->wr, (long long)L->wc);
  tp_status_t st = tp_arena_reserve(&L->grads, total, "gradients");
  if (st == TP_SUCCESS) st = lk_zero(&L->lk, L->grads.base, L->grads.cap, NULL);
  if (st == TP_SUCCESS) st = tp_device_sync(L->dev, L->dev_id, NULL);
  if (st != TP_SUCCESS) {
    tp_arena_release(&L->grads);
    if (st != TP_ERR_NOMEM) return st;
    return tp_set_error(TP_ERR_NOMEM,
                        "linear: out of memory for the gradients of a %lld x %lld weight shard%s (%zu "
                        "bytes of %s memory)",
                        (long long)L->wr, (long long)L->wc, L->cfg.bias ? " and its bias" : "", total,
                        tp_device_name(L->dev));
  }
  L->dw = L->frozen ? NULL : tp_arena_take_n(&L->grads, L->wn, sizeof(float));
  L->db = L->cfg.bias ? tp_arena_take_n(&L->grads, L->blen, sizeof(float)) : NULL;
  return TP_SUCCESS;
}

tp_status_t tp_parallel_linear_alloc_grads(tp_parallel_linear_t L) {
  TP_NONNULL("linear alloc_grads", L, "layer");
  return ensure_grads(L);
}

tp_status_t tp_parallel_linear_info(tp_parallel_linear_t L, tp_linear_info_t *info) {
  TP_NONNULL("linear", L, "layer");
  TP_NONNULL("linear", info, "info");
  int col = L->cfg.kind == TP_COLUMN_PARALLEL;
  info->weight = L->W.p;
  info->weight_dtype = L->W.dt;
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

/* The registered buffer g holds this rank's [M, local] block at its rank-major place:
 * all-gather the blocks in place (zero-copy), then lay them out as out[M, total]
 * (block p = [M, part[p]] goes to columns [offs[p], offs[p] + part[p]): one 2-D copy each). */
static tp_status_t gather_columns(tp_parallel_linear_t L, float *out, float *g, int64_t M, int64_t total,
                                  tp_stream_t stream) {
  for (int p = 0; p < L->world; p++) L->counts[p] = (size_t)(L->part[p] * M);
  TP_CHECK(tp_layer_all_gather_v(g + L->off * M, g, L->counts, L->comm, L->region, stream));
  for (int p = 0; p < L->world; p++)
    TP_CHECK(lk_copy_rows(&L->lk, out + L->offs[p], total, g + L->offs[p] * M, L->part[p], M, L->part[p], stream));
  return TP_SUCCESS;
}

static tp_status_t check_rows(tp_parallel_linear_t L, int64_t M, const char *op) {
  int64_t widest = L->cfg.in_features > L->cfg.out_features ? L->cfg.in_features : L->cfg.out_features, n;
  if (M < 0 || M > INT_MAX || !tp_numel2(M, 2 * widest, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "linear %s: %lld rows is out of range (at most %d, and rows x "
                        "features must fit in memory)",
                        op, (long long)M, INT_MAX);
  return TP_SUCCESS;
}

/* A failure on this rank before a collective would leave the peers waiting for it:
 * abort the communicator so that they fail at once, naming this rank. */
static tp_status_t fail_local(tp_parallel_linear_t L, tp_status_t st) {
  if (st == TP_ERR_NOMEM || st == TP_ERR_INTERNAL) tp_comm_abort(L->comm, tp_last_error());
  return st;
}

static tp_status_t forward_impl(tp_parallel_linear_t L, float *y, const float *x, int64_t M, tp_stream_t stream);
static tp_status_t backward_impl(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M, tp_stream_t stream);

tp_status_t tp_parallel_linear_forward(tp_parallel_linear_t L, const tp_tensor *y, const tp_tensor *x,
                                       tp_stream_t stream) {
  TP_NONNULL("linear forward", L, "layer");
  TP_CHECK(tp_check_stream("linear forward", L->dev, stream));
  TP_NONNULL("linear forward", x, "x");
  TP_NONNULL("linear forward", y, "y");
  tp_linear_info_t i;
  tp_parallel_linear_info(L, &i);
  int64_t M = 0;
  TP_CHECK(tp_check_matrix("linear forward", "x", x, TP_FLOAT32, -1, i.x_cols, L->dev, L->dev_id, &M));
  TP_CHECK(check_rows(L, M, "forward"));
  TP_CHECK(tp_check_matrix("linear forward", "y", y, TP_FLOAT32, M, i.y_cols, L->dev, L->dev_id, NULL));
  return fail_local(L, forward_impl(L, y->data, x->data, M, stream));
}

tp_status_t tp_parallel_linear_backward(tp_parallel_linear_t L, const tp_tensor *dx, const tp_tensor *dy,
                                        tp_stream_t stream) {
  TP_NONNULL("linear backward", L, "layer");
  TP_CHECK(tp_check_stream("linear backward", L->dev, stream));
  TP_NONNULL("linear backward", dx, "dx");
  TP_NONNULL("linear backward", dy, "dy");
  tp_linear_info_t i;
  tp_parallel_linear_info(L, &i);
  int64_t M = 0;
  TP_CHECK(tp_check_matrix("linear backward", "dy", dy, TP_FLOAT32, -1, i.y_cols, L->dev, L->dev_id, &M));
  TP_CHECK(check_rows(L, M, "backward"));
  TP_CHECK(tp_check_matrix("linear backward", "dx", dx, TP_FLOAT32, M, i.x_cols, L->dev, L->dev_id, NULL));
  return fail_local(L, backward_impl(L, dx->data, dy->data, M, stream));
}

tp_status_t tp_parallel_linear_forward_ex(tp_parallel_linear_t L, float *y, const float *x, int64_t M, int flags,
                                          tp_stream_t stream) {
  TP_CHECK(check_rows(L, M, "forward"));
  L->flags = flags;
  tp_status_t st = fail_local(L, forward_impl(L, y, x, M, stream));
  L->flags = 0;
  return st;
}

tp_status_t tp_parallel_linear_backward_ex(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M, int flags,
                                           tp_stream_t stream) {
  TP_CHECK(check_rows(L, M, "backward"));
  L->flags = flags;
  tp_status_t st = fail_local(L, backward_impl(L, dx, dy, M, stream));
  L->flags = 0;
  return st;
}

static tp_status_t forward_impl(tp_parallel_linear_t L, float *y, const float *x, int64_t M, tp_stream_t stream) {
  L->xsave_m = -1; /* set again once this forward's input is kept (copied or borrowed) */
  int64_t K = L->cfg.in_features, N = L->cfg.out_features;
  const float *b = (L->flags & TP_LIN_SKIP_BIAS) ? NULL : L->b;
  if (L->cfg.kind == TP_COLUMN_PARALLEL) {
    TP_CHECK(save_input(L, x, M, K, 0, K, stream));
    if (!L->cfg.gather_output || L->world == 1) return lk_linear_forward(&L->lk, y, x, &L->W, b, M, K, L->wr, stream);
    /* GEMM straight into my block of the registered gather buffer: the all-gather is in place. */
    TP_CHECK(ensure_reg(L, outbuf(L), (size_t)(M * N) * sizeof(float)));
    float *g = outbuf(L)->ptr;
    TP_CHECK(lk_linear_forward(&L->lk, g + L->off * M, x, &L->W, b, M, K, L->loc, stream));
    return gather_columns(L, y, g, M, N, stream);
  }
  /* Row parallel. */
  int64_t xcols = L->cfg.input_is_parallel ? L->loc : K;
  TP_CHECK(save_input(L, x, M, L->loc, L->cfg.input_is_parallel ? 0 : L->off, xcols, stream));
  if (L->world == 1) return lk_linear_forward(&L->lk, y, L->xin, &L->W, b, M, L->loc, N, stream);
  TP_CHECK(ensure_reg(L, outbuf(L), (size_t)(M * N) * sizeof(float)));
  float *r = outbuf(L)->ptr;
  TP_CHECK(lk_linear_forward(&L->lk, r, L->xin, &L->W, NULL, M, L->loc, N, stream));
  TP_CHECK(tp_layer_all_reduce(r, (size_t)(M * N), TP_SUM, L->comm, L->region, stream));
  /* y = r + b (the bias once, after the reduce), or a copy of r */
  return lk_add_bias_rows(&L->lk, y, r, b, M, N, stream);
}

static tp_status_t backward_impl(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M, tp_stream_t stream) {
  if (L->xsave_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "linear backward: called before forward");
  if (M != L->xsave_m)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "linear backward: dy has %lld rows but the last forward had %lld",
                        (long long)M, (long long)L->xsave_m);
  TP_CHECK(ensure_grads(L)); /* NOMEM: fail_local aborts the communicator (the peers would wait) */
  int64_t K = L->cfg.in_features, N = L->cfg.out_features;
  float *db = (L->flags & TP_LIN_SKIP_BIAS) ? NULL : L->db;
  if (L->cfg.kind == TP_COLUMN_PARALLEL) {
    const float *dyr = dy;
    if (L->cfg.gather_output && L->world > 1) { /* my columns of the full dy */
      TP_CHECK(lk_copy_rows(&L->lk, L->dytmp, L->loc, dy + L->off, N, M, L->loc, stream));
      dyr = L->dytmp;
    }
    if (L->world == 1) return lk_linear_backward(&L->lk, dx, L->dw, db, dyr, L->xin, &L->W, M, K, L->wr, stream);
    TP_CHECK(ensure_reg(L, &L->grad_buf, (size_t)(M * K) * sizeof(float)));
    float *d = L->grad_buf.ptr;
    TP_CHECK(lk_linear_backward(&L->lk, d, L->dw, db, dyr, L->xin, &L->W, M, K, L->wr, stream));
    TP_CHECK(tp_layer_all_reduce(d, (size_t)(M * K), TP_SUM, L->comm, L->region, stream));
    return lk_copy(&L->lk, dx, d, (size_t)(M * K) * sizeof(float), stream);
  }
  /* Row parallel: dy is the full gradient on every rank. */
  if (L->cfg.input_is_parallel || L->world == 1)
    return lk_linear_backward(&L->lk, dx, L->dw, db, dy, L->xin, &L->W, M, L->loc, N, stream);
  TP_CHECK(ensure_reg(L, &L->grad_buf, (size_t)(M * K) * sizeof(float)));
  float *g = L->grad_buf.ptr;
  TP_CHECK(lk_linear_backward(&L->lk, g + L->off * M, L->dw, db, dy, L->xin, &L->W, M, L->loc, N, stream));
  return gather_columns(L, dx, g, M, K, stream);
}

tp_status_t tp_parallel_linear_forward_inbuf(tp_parallel_linear_t L, float **y, const float *x, int64_t M, int flags,
                                             tp_stream_t stream) {
  TP_CHECK(check_rows(L, M, "forward"));
  if (L->cfg.kind != TP_ROW_PARALLEL || !L->cfg.input_is_parallel)
    return tp_set_error(TP_ERR_INTERNAL,
                        "linear: an in-buffer forward needs a row-parallel layer with a parallel input");
  L->flags = flags;
  L->xsave_m = -1;
  int64_t N = L->cfg.out_features;
  tp_status_t st = save_input(L, x, M, L->loc, 0, L->loc, stream);
  if (st == TP_SUCCESS) st = ensure_reg(L, outbuf(L), (size_t)(M * N) * sizeof(float));
  L->flags = 0;
  TP_CHECK(fail_local(L, st));
  float *r = outbuf(L)->ptr;
  TP_CHECK(lk_linear_forward(&L->lk, r, L->xin, &L->W, NULL, M, L->loc, N, stream));
  if (L->world > 1) TP_CHECK(tp_layer_all_reduce(r, (size_t)(M * N), TP_SUM, L->comm, L->region, stream));
  if (L->b) TP_CHECK(lk_add_bias_rows(&L->lk, r, r, L->b, M, N, stream)); /* in place, once, after the reduce */
  *y = r;
  return TP_SUCCESS;
}

/* Weights in their storage format and the bias (params), the gradients that exist (grads),
 * the saved-input arena and a GPU layer's low-precision scratch (workspace), the collective
 * buffers (comm).  Tensors count as the arena slices they take (rounded to the alignment). */
tp_status_t tp_parallel_linear_memory(tp_parallel_linear_t L, tp_layer_memory_t *mem) {
  TP_NONNULL("linear memory", L, "layer");
  TP_CHECK(tp_memory_begin("linear memory", mem, L->dev, L->dev_id));
  tp_linear_info_t i;
  tp_parallel_linear_info(L, &i);
  size_t wbytes = 0, bbytes = (size_t)i.bias_len * sizeof(float);
  tp_lk_wbytes("linear memory", "the weight shard", L->W.dt, L->wr, L->wc, &wbytes); /* checked at create */
  mem->params = tp_mem_tensor(L->W.p, wbytes) + tp_mem_tensor(L->b, bbytes);
  mem->grads = tp_mem_tensor(L->dw, (size_t)(L->wr * L->wc) * sizeof(float)) + tp_mem_tensor(L->db, bbytes);
  mem->workspace = L->ws.cap + L->lpws.cap;
  mem->comm = L->out_buf.cap + L->grad_buf.cap;
  return TP_SUCCESS;
}
