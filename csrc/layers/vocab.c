/* Vocab-parallel embedding and softmax cross-entropy (see tpcore/layers.h). */
#include <limits.h>
#include <math.h>

#include "layers_impl.h"
#include "layer_kernels.h"

/* ------------------------------------------------------------------ embedding */

struct tp_vocab_embedding {
  tp_comm_t comm;
  int world;
  tp_device_t dev;
  int dev_id;
  tp_lk lk; /* the device's kernels */
  int64_t n, C, off, loc;
  int64_t gn; /* elements of dw: loc x C */
  int frozen; /* a quantized table: no dw */
  tp_lk_w W;  /* the table shard, in cfg.weight_dtype (W.lpws = &lpws: init scratch) */
  tp_arena_t lpws;
  float *dw;           /* NULL until ensure_grads, and always for a quantized (frozen) table */
  tp_arena_t params;   /* w */
  tp_arena_t grads;    /* dw: on demand (the first backward, tp_vocab_embedding_alloc_grads) */
  tp_arena_t ws;       /* the last forward's tokens and the range check's result */
  int64_t *tok, *flag; /* flag: [index, value] of the first token out of range */
  int64_t last_m;      /* -1 before the first forward */
  reg_buf buf;
};

void tp_vocab_embedding_destroy(tp_vocab_embedding_t E) {
  if (!E) return;
  tp_reg_release(&E->buf);
  tp_arena_release(&E->params);
  tp_arena_release(&E->grads);
  tp_arena_release(&E->ws);
  tp_arena_release(&E->lpws);
  tp_host_free(E);
}

tp_status_t tp_vocab_embedding_create(tp_vocab_embedding_t *out, tp_comm_t comm, const tp_embedding_config_t *cfg) {
  TP_NONNULL("embedding", out, "out");
  TP_NONNULL("embedding", comm, "comm");
  TP_NONNULL("embedding", cfg, "config");
  *out = NULL;
  if (cfg->size != sizeof(tp_embedding_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding: config built for another tpcore version");
  TP_CHECK(tp_lk_check_wdtype("embedding", cfg->weight_dtype));
  if (cfg->num_embeddings < 1 || cfg->embedding_dim < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "embedding: num_embeddings and embedding_dim must be >= 1, got %lld "
                        "and %lld",
                        (long long)cfg->num_embeddings, (long long)cfg->embedding_dim);
  TP_CHECK(tp_layer_device("embedding", cfg->device, cfg->device_id));
  int rank, world;
  tp_comm_rank(comm, &rank);
  tp_comm_size(comm, &world);
  tp_vocab_embedding_t E;
  size_t hbytes = sizeof *E + (size_t)(world + 1) * sizeof(int64_t);
  TP_CHECK(tp_host_zalloc(hbytes, (void **)&E, "embedding"));
  int64_t *offs = (int64_t *)(E + 1), nel;
  tp_status_t st = tp_lk_init(&E->lk, "embedding", cfg->device, cfg->device_id);
  if (st == TP_SUCCESS)
    st = tp_partition_sizes(cfg->num_embeddings, world, cfg->partition, NULL, offs, "embedding: partition",
                            "the vocabulary size (num_embeddings)");
  if (st != TP_SUCCESS) {
    tp_host_free(E);
    return st;
  }
  int64_t off = offs[rank], loc = offs[rank + 1] - offs[rank];
  if (!tp_numel2(loc, cfg->embedding_dim, &nel)) {
    tp_host_free(E);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "embedding: a table shard of %lld x %lld (num_embeddings %lld, "
                        "embedding_dim %lld) is too large: at most 2^40 elements per shard",
                        (long long)loc, (long long)cfg->embedding_dim, (long long)cfg->num_embeddings,
                        (long long)cfg->embedding_dim);
  }
  E->comm = comm;
  E->world = world;
  E->dev = cfg->device;
  E->dev_id = cfg->device_id;
  E->n = cfg->num_embeddings;
  E->C = cfg->embedding_dim;
  E->off = off;
  E->loc = loc;
  E->last_m = -1;
  tp_arena_init(&E->params, E->dev, E->dev_id);
  tp_arena_init(&E->grads, E->dev, E->dev_id);
  tp_arena_init(&E->ws, E->dev, E->dev_id);
  tp_arena_init(&E->lpws, E->dev, E->dev_id);
  E->W.dt = cfg->weight_dtype;
  E->W.lpws = &E->lpws;
  size_t total = 0, wbytes = 0;
  int quant = tp_weight_is_quantized(E->W.dt); /* a quantized table is frozen: no gradient */
  st = tp_lk_wbytes("embedding", "the table", E->W.dt, loc, E->C, &wbytes);
  if (st != TP_SUCCESS) {
    tp_vocab_embedding_destroy(E);
    return st;
  }
  E->gn = nel;
  E->frozen = quant;
  tp_arena_add_n(&total, (int64_t)wbytes, 1);
  st = tp_arena_reserve(&E->params, total, "embedding: table");
  if (st == TP_SUCCESS) {
    E->W.p = tp_arena_take_n(&E->params, (int64_t)wbytes, 1);
    st = lk_zero(&E->lk, E->params.base, E->params.cap, NULL);
  }
  /* N(0, 1) by Box-Muller: elements 2p and 2p + 1 of the full table are the cosine and sine
   * halves of pair p, drawn from two counter-based uniforms of p (a shard that starts or ends
   * mid-pair draws the whole pair and keeps its half): the same table at any partition. */
  if (st == TP_SUCCESS)
    st = lk_init_w(&E->lk, &E->W, 0, nel, E->C, 1, cfg->seed, 2, (uint64_t)off * (uint64_t)E->C, 0.0f, NULL);
  if (st == TP_SUCCESS) st = tp_device_sync(E->dev, E->dev_id, NULL);
  tp_arena_release(&E->lpws); /* the init scratch of a 16-bit table (lookups need none) */
  if (st != TP_SUCCESS) {
    tp_vocab_embedding_destroy(E);
    return st;
  }
  *out = E;
  return TP_SUCCESS;
}

/* dw, zeroed (a quantized table has none): made by the first backward or alloc_grads. */
static tp_status_t ensure_grads(tp_vocab_embedding_t E) {
  if (E->grads.base || E->frozen) return TP_SUCCESS;
  size_t total = 0;
  if (!tp_arena_add_n(&total, E->gn, sizeof(float)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "embedding: the gradient of a %lld x %lld table shard overflows a "
                        "size",
                        (long long)E->loc, (long long)E->C);
  tp_status_t st = tp_arena_reserve(&E->grads, total, "embedding: gradient");
  if (st == TP_SUCCESS) st = lk_zero(&E->lk, E->grads.base, E->grads.cap, NULL);
  if (st == TP_SUCCESS) st = tp_device_sync(E->dev, E->dev_id, NULL);
  if (st != TP_SUCCESS) {
    tp_arena_release(&E->grads);
    if (st != TP_ERR_NOMEM) return st;
    return tp_set_error(TP_ERR_NOMEM,
                        "embedding: out of memory for the gradient of the %lld x %lld table shard (%zu "
                        "bytes of %s memory)",
                        (long long)E->loc, (long long)E->C, total, tp_device_name(E->dev));
  }
  E->dw = tp_arena_take_n(&E->grads, E->gn, sizeof(float));
  return TP_SUCCESS;
}

tp_status_t tp_vocab_embedding_alloc_grads(tp_vocab_embedding_t E) {
  TP_NONNULL("embedding alloc_grads", E, "embedding");
  return ensure_grads(E);
}

tp_status_t tp_vocab_embedding_info(tp_vocab_embedding_t E, tp_embedding_info_t *info) {
  TP_NONNULL("embedding", E, "embedding");
  TP_NONNULL("embedding", info, "info");
  info->weight = E->W.p;
  info->weight_dtype = E->W.dt;
  info->grad_weight = E->dw;
  info->offset = E->off;
  info->local = E->loc;
  info->dim = E->C;
  info->num_embeddings = E->n;
  return TP_SUCCESS;
}

static tp_status_t embedding_forward(tp_vocab_embedding_t E, float *y, const int64_t *tokens, int64_t M,
                                     tp_stream_t stream) {
  E->last_m = -1; /* until this forward's tokens are kept */
  /* Local failures before the collective abort the communicator (the peers would wait). */
  size_t total = 0;
  tp_arena_add_n(&total, M, sizeof(int64_t)); /* M x dim is bounded by 2^40: no overflow */
  tp_arena_add_n(&total, 2, sizeof(int64_t));
  tp_status_t st = tp_arena_reserve(&E->ws, total, "embedding forward");
  if (st != TP_SUCCESS) {
    tp_comm_abort(E->comm, tp_last_error());
    return st;
  }
  E->tok = tp_arena_take_n(&E->ws, M, sizeof(int64_t));
  E->flag = tp_arena_take_n(&E->ws, 2, sizeof(int64_t));
  int64_t bad[2];
  TP_CHECK(lk_find_out_of_range(&E->lk, E->flag, bad, tokens, M, 0, E->n, stream));
  if (bad[0] >= 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "embedding forward: token %lld (position %lld) is out of range "
                        "0..%lld",
                        (long long)bad[1], (long long)bad[0], (long long)(E->n - 1));
  TP_CHECK(lk_copy(&E->lk, E->tok, tokens, (size_t)M * sizeof(int64_t), stream));
  E->last_m = M;
  if (E->world == 1) return lk_embedding_forward(&E->lk, y, tokens, &E->W, M, E->off, E->loc, E->C, stream);
  size_t nbytes = (size_t)(M * E->C) * sizeof(float);
  TP_CHECK(tp_reg_ensure(E->comm, &E->buf, nbytes, E->dev, E->dev_id));
  float *r = E->buf.ptr;
  TP_CHECK(lk_embedding_forward(&E->lk, r, tokens, &E->W, M, E->off, E->loc, E->C, stream));
  TP_CHECK(tp_layer_all_reduce(r, (size_t)(M * E->C), TP_SUM, E->comm, "embedding", stream));
  return lk_copy(&E->lk, y, r, nbytes, stream);
}

tp_status_t tp_vocab_embedding_forward(tp_vocab_embedding_t E, const tp_tensor *y, const tp_tensor *tokens,
                                       tp_stream_t stream) {
  TP_NONNULL("embedding forward", E, "embedding");
  TP_CHECK(tp_check_stream("embedding forward", E->dev, stream));
  TP_NONNULL("embedding forward", y, "y");
  TP_NONNULL("embedding forward", tokens, "tokens");
  int64_t M = 0, nel;
  TP_CHECK(tp_check_vector("embedding forward", "tokens", tokens, TP_INT64, -1, E->dev, E->dev_id, &M));
  if (!tp_numel2(M, E->C, &nel))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "embedding forward: %lld tokens is out of range (0 to 2^40 / "
                        "embedding_dim %lld)",
                        (long long)M, (long long)E->C);
  TP_CHECK(tp_check_matrix("embedding forward", "y", y, TP_FLOAT32, M, E->C, E->dev, E->dev_id, NULL));
  return embedding_forward(E, y->data, tokens->data, M, stream);
}

tp_status_t tp_vocab_embedding_backward(tp_vocab_embedding_t E, const tp_tensor *dy, tp_stream_t stream) {
  TP_NONNULL("embedding backward", E, "embedding");
  TP_CHECK(tp_check_stream("embedding backward", E->dev, stream));
  TP_NONNULL("embedding backward", dy, "dy");
  int64_t M = 0;
  TP_CHECK(tp_check_matrix("embedding backward", "dy", dy, TP_FLOAT32, -1, E->C, E->dev, E->dev_id, &M));
  if (E->last_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "embedding backward: called before forward");
  if (M != E->last_m)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "embedding backward: dy has %lld rows, the last forward had %lld "
                        "tokens",
                        (long long)M, (long long)E->last_m);
  TP_CHECK(ensure_grads(E)); /* local: no collective follows */
  return lk_embedding_backward(&E->lk, E->dw, E->tok, dy->data, M, E->off, E->loc, E->C, stream);
}

/* -------------------------------------------------------------- cross-entropy */

struct tp_vocab_xent {
  tp_comm_t comm;
  int rank, world;
  tp_device_t dev;
  int dev_id;
  tp_lk lk;    /* the device's kernels */
  reg_buf buf; /* [M row maxima | world widths | world offsets | 2 fingerprints | 2M sums] */
  tp_arena_t ws;
  float *gmax, *sumexp, *rs, *s2; /* s2: 2M sums at world 1 */
  int64_t *tg;                    /* targets of the last forward, -1 where ignored */
  int64_t *flag;                  /* [first bad row, valid rows] from the target check */
  float *meta;                    /* host: the 2 world + 2 metadata values of the max all-reduce (in the handle) */
  const float *logits;            /* the last forward's logits (the caller keeps them) */
  int64_t last_m, V, lo;          /* last_m -1 before the first forward */
};

tp_status_t tp_vocab_xent_create(tp_vocab_xent_t *out, tp_comm_t comm, const tp_xent_config_t *cfg) {
  TP_NONNULL("cross-entropy", out, "out");
  TP_NONNULL("cross-entropy", comm, "comm");
  *out = NULL;
  tp_xent_config_t def = TP_XENT_CONFIG_INITIALIZER;
  if (!cfg) cfg = &def;
  if (cfg->size != sizeof(tp_xent_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: config built for another tpcore version");
  TP_CHECK(tp_layer_device("cross-entropy", cfg->device, cfg->device_id));
  int world;
  tp_comm_size(comm, &world);
  tp_vocab_xent_t X;
  TP_CHECK(tp_host_zalloc(sizeof *X + (size_t)(2 * world + 2) * sizeof(float), (void **)&X, "cross-entropy"));
  X->meta = (float *)(X + 1);
  X->comm = comm;
  X->world = world;
  tp_comm_rank(comm, &X->rank);
  X->dev = cfg->device;
  X->dev_id = cfg->device_id;
  tp_arena_init(&X->ws, X->dev, X->dev_id);
  X->last_m = -1;
  tp_status_t st = tp_lk_init(&X->lk, "cross-entropy", X->dev, X->dev_id);
  if (st != TP_SUCCESS) {
    tp_vocab_xent_destroy(X);
    return st;
  }
  *out = X;
  return TP_SUCCESS;
}

void tp_vocab_xent_destroy(tp_vocab_xent_t X) {
  if (!X) return;
  tp_reg_release(&X->buf);
  tp_arena_release(&X->ws);
  tp_host_free(X);
}

static tp_status_t xent_workspace(tp_vocab_xent_t X, int64_t M) {
  size_t total = 0; /* M is at most INT_MAX / 4 */
  tp_arena_add_n(&total, M, sizeof(float));
  tp_arena_add_n(&total, M, sizeof(float));
  tp_arena_add_n(&total, M, sizeof(float));
  tp_arena_add_n(&total, 2 * M, sizeof(float));
  tp_arena_add_n(&total, M, sizeof(int64_t));
  tp_arena_add_n(&total, 3, sizeof(int64_t));
  TP_CHECK(tp_arena_reserve(&X->ws, total, "cross-entropy"));
  X->gmax = tp_arena_take_n(&X->ws, M, sizeof(float));
  X->sumexp = tp_arena_take_n(&X->ws, M, sizeof(float));
  X->rs = tp_arena_take_n(&X->ws, M, sizeof(float));
  X->s2 = tp_arena_take_n(&X->ws, 2 * M, sizeof(float));
  X->tg = tp_arena_take_n(&X->ws, M, sizeof(int64_t));
  X->flag = tp_arena_take_n(&X->ws, 3, sizeof(int64_t));
  return TP_SUCCESS;
}

static tp_status_t xent_forward(tp_vocab_xent_t X, float *losses, const float *logits, const int64_t *targets,
                                int64_t M, int64_t V, int64_t vocab_offset, int64_t ignore_index, int64_t *valid,
                                int64_t *vocab, tp_stream_t stream) {
  int n = X->world;
  X->last_m = -1; /* until this forward succeeds: no backward over half-written workspaces */
  tp_status_t st = xent_workspace(X, M);
  if (st == TP_SUCCESS && n > 1)
    st = tp_reg_ensure(X->comm, &X->buf, (size_t)(3 * M + 2 * n + 2) * sizeof(float), X->dev, X->dev_id);
  if (st != TP_SUCCESS) {
    if (st == TP_ERR_NOMEM) tp_comm_abort(X->comm, tp_last_error());
    return st;
  }
  int64_t lo = vocab_offset, total = V;
  float *mx = n > 1 ? (float *)X->buf.ptr : X->gmax;
  TP_CHECK(lk_xent_row_max(&X->lk, mx, logits, M, V, stream));
  if (n > 1) {
    /* One max all-reduce: row maxima, every rank's width and given offset (-1: none), and a
     * fingerprint of (targets, ignore_index).  Everything after it is decided from the same
     * numbers on every rank, so a bad layout or mismatched targets fail every rank alike
     * (and the communicator stays in step).  Widths and offsets are exact up to 2^24.
     * The metadata is written on the host and goes in and out with one copy each way. */
    float *wid = X->meta, *offs = X->meta + n, *fp = X->meta + 2 * n;
    for (int p = 0; p < n; p++) wid[p] = offs[p] = -1.0f;
    wid[X->rank] = (float)V;
    offs[X->rank] = vocab_offset<0 ? -1.0f : vocab_offset>(1 << 24) ? (float)(1 << 25) : (float)vocab_offset;
    TP_CHECK(tp_device_copy(X->dev, mx + M, TP_DEVICE_CPU, X->meta, (size_t)(2 * n) * sizeof(float), stream));
    TP_CHECK(lk_targets_hash(&X->lk, mx + M + 2 * n, targets, M, ignore_index, stream)); /* fp on the device */
    TP_CHECK(tp_layer_all_reduce(mx, (size_t)(M + 2 * n + 2), TP_MAX, X->comm, "head", stream));
    TP_CHECK(tp_device_copy(TP_DEVICE_CPU, X->meta, X->dev, mx + M, (size_t)(2 * n + 2) * sizeof(float), stream));
    TP_CHECK(tp_device_sync(X->dev, X->dev_id, stream));
    if (fp[0] != -fp[1])
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "cross-entropy: the ranks passed different targets or ignore_index "
                          "(every rank needs the same targets for its logits shard)");
    total = 0;
    int64_t below = 0, given = 0;
    for (int p = 0; p < n; p++) {
      int64_t w = (int64_t)wid[p];
      if (p < X->rank) below += w;
      total += w;
      given += offs[p] >= 0;
    }
    if (given != 0 && given != n)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "cross-entropy: vocab_offset was given on %lld of %d ranks (give "
                          "it on every rank or on none)",
                          (long long)given, n);
    if (given) { /* the shards must tile [0, total): sort by offset, then they must abut */
      int64_t covered = 0;
      for (int step = 0; step < n; step++) {
        int q = -1;
        for (int p = 0; p < n; p++)
          if ((int64_t)offs[p] == covered && wid[p] > 0 && (q < 0)) q = p;
        if (q < 0) break;
        covered += (int64_t)wid[q];
      }
      int empty_ok = 1;
      for (int p = 0; p < n; p++)
        if (wid[p] == 0 && (offs[p] < 0 || (int64_t)offs[p] > total)) empty_ok = 0;
      if (covered != total || !empty_ok)
        return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                            "cross-entropy: the ranks' vocab_offset and shard widths do not "
                            "tile the vocabulary [0, %lld) (this rank: offset %lld, width %lld)",
                            (long long)total, (long long)vocab_offset, (long long)V);
    } else {
      lo = below;
    }
    TP_CHECK(lk_copy(&X->lk, X->gmax, mx, (size_t)M * sizeof(float), stream));
  } else {
    lo = lo < 0 ? 0 : lo;
    total = lo + V;
  }
  /* targets -> tg (-1 where ignored), checked against [0, total): one flag read back */
  int64_t res[3];
  TP_CHECK(lk_xent_targets(&X->lk, X->tg, X->flag, res, targets, M, ignore_index, total, stream));
  if (res[0] >= 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: target %lld (row %lld) is out of range 0..%lld",
                        (long long)res[1], (long long)res[0], (long long)(total - 1));
  /* (sum of exp, target logit) per row */
  float *sums = n > 1 ? (float *)X->buf.ptr + M + n + 2 : X->s2;
  TP_CHECK(lk_xent_row_sums(&X->lk, sums, logits, X->gmax, X->tg, M, lo, V, stream));
  if (n > 1) TP_CHECK(tp_layer_all_reduce(sums, (size_t)(2 * M), TP_SUM, X->comm, "head", stream));
  TP_CHECK(lk_copy(&X->lk, X->sumexp, sums, (size_t)M * sizeof(float), stream));
  TP_CHECK(lk_xent_losses(&X->lk, losses, X->sumexp, X->gmax, sums + M, X->tg, M, stream));
  X->logits = logits;
  X->last_m = M;
  X->V = V;
  X->lo = lo;
  if (valid) *valid = res[2];
  if (vocab) *vocab = total;
  return TP_SUCCESS;
}

tp_status_t tp_vocab_xent_forward(tp_vocab_xent_t X, const tp_tensor *losses, const tp_tensor *logits,
                                  const tp_tensor *targets, int64_t vocab_offset, int64_t ignore_index, int64_t *valid,
                                  int64_t *vocab, tp_stream_t stream) {
  TP_NONNULL("cross-entropy forward", X, "cross-entropy");
  TP_CHECK(tp_check_stream("cross-entropy forward", X->dev, stream));
  TP_NONNULL("cross-entropy forward", losses, "losses");
  TP_NONNULL("cross-entropy forward", logits, "logits");
  TP_NONNULL("cross-entropy forward", targets, "targets");
  const char *op = "cross-entropy forward";
  if (logits->ndim != 2)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: logits must be 2-D [rows, shard width], got %d-D", op,
                        logits->ndim);
  int64_t M = logits->shape[0], V = logits->shape[1], nel;
  if (M < 0 || V < 0 || !tp_numel2(M, V, &nel) || M > INT_MAX / 4)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cross-entropy forward: logits of %lld rows x %lld columns is out of "
                        "range",
                        (long long)M, (long long)V);
  TP_CHECK(tp_check_matrix(op, "logits", logits, TP_FLOAT32, M, V, X->dev, X->dev_id, NULL));
  TP_CHECK(tp_check_vector(op, "targets", targets, TP_INT64, M, X->dev, X->dev_id, NULL));
  TP_CHECK(tp_check_vector(op, "losses", losses, TP_FLOAT32, M, X->dev, X->dev_id, NULL));
  /* lo + V must not overflow where it is computed (one rank).  With several ranks the
   * offsets are checked together, so that a bad one fails every rank alike. */
  if (X->world == 1 && vocab_offset > INT64_MAX - V)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cross-entropy forward: vocab_offset must be at most 2^63 - 1 - "
                        "the shard width %lld, got %lld",
                        (long long)V, (long long)vocab_offset);
  if (V > (1 << 24))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cross-entropy forward: a shard of %lld vocabulary entries is wider "
                        "than 2^24",
                        (long long)V);
  return xent_forward(X, losses->data, logits->data, targets->data, M, V, vocab_offset, ignore_index, valid, vocab,
                      stream);
}

tp_status_t tp_vocab_xent_backward(tp_vocab_xent_t X, const tp_tensor *dlogits, const tp_tensor *dloss, float scale,
                                   tp_stream_t stream) {
  TP_NONNULL("cross-entropy backward", X, "cross-entropy");
  TP_CHECK(tp_check_stream("cross-entropy backward", X->dev, stream));
  TP_NONNULL("cross-entropy backward", dlogits, "dlogits");
  if (X->last_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "cross-entropy backward: called before forward");
  int64_t M = X->last_m;
  const char *op = "cross-entropy backward";
  TP_CHECK(tp_check_matrix(op, "dlogits", dlogits, TP_FLOAT32, M, X->V, X->dev, X->dev_id, NULL));
  if (dloss) TP_CHECK(tp_check_vector(op, "dloss", dloss, TP_FLOAT32, M, X->dev, X->dev_id, NULL));
  TP_CHECK(lk_xent_row_scale(&X->lk, X->rs, X->tg, dloss ? dloss->data : NULL, M, stream));
  return lk_xent_backward(&X->lk, dlogits->data, X->logits, X->gmax, X->sumexp, X->tg, X->rs, scale, M, X->lo, X->V,
                          stream);
}

/* ------------------------------------------------------------------ memory */

tp_status_t tp_vocab_embedding_memory(tp_vocab_embedding_t E, tp_layer_memory_t *mem) {
  TP_NONNULL("embedding memory", E, "embedding");
  TP_CHECK(tp_memory_begin("embedding memory", mem, E->dev, E->dev_id));
  size_t wbytes = 0;
  tp_lk_wbytes("embedding memory", "the table", E->W.dt, E->loc, E->C, &wbytes); /* checked at create */
  mem->params = tp_mem_tensor(E->W.p, wbytes);
  mem->grads = tp_mem_tensor(E->dw, (size_t)(E->loc * E->C) * sizeof(float));
  mem->workspace = E->ws.cap + E->lpws.cap;
  mem->comm = E->buf.cap;
  return TP_SUCCESS;
}

tp_status_t tp_vocab_xent_memory(tp_vocab_xent_t X, tp_layer_memory_t *mem) {
  TP_NONNULL("cross-entropy memory", X, "cross-entropy");
  TP_CHECK(tp_memory_begin("cross-entropy memory", mem, X->dev, X->dev_id));
  mem->workspace = X->ws.cap;
  mem->comm = X->buf.cap;
  return TP_SUCCESS;
}
