/* Vocab-parallel embedding and softmax cross-entropy (see tpcore/layers.h). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers_impl.h"
#include "tpcore/kernels.h"
#include "tpcore/layers.h"

/* The vocabulary split: sizes from `partition` (or even), checked to sum to n. */
static tp_status_t split(const int64_t *partition, int world, int rank, int64_t n, const char *who, int64_t *off,
                         int64_t *loc) {
  int64_t sum = 0;
  for (int p = 0; p < world; p++) {
    int64_t v = partition ? partition[p] : n / world + (p < n % world);
    if (v < 0) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: partition[%d] is negative (%lld)", who, p, (long long)v);
    if (p == rank) {
      *off = sum;
      *loc = v;
    }
    if (!tp_add_count(sum, v, &sum))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: the partition sums past 2^63 - 1 (partition[%d] = %lld)", who,
                          p, (long long)v);
  }
  if (sum != n)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: the partition sums to %lld but the vocabulary has %lld entries",
                        who, (long long)sum, (long long)n);
  return TP_SUCCESS;
}

/* ------------------------------------------------------------------ embedding */

struct tp_vocab_embedding {
  tp_comm_t comm;
  int world;
  int64_t n, C, off, loc;
  float *w, *dw;
  int64_t *tok, tok_cap, last_m; /* the last forward's tokens; last_m -1 before the first */
  reg_buf buf;
};

void tp_vocab_embedding_destroy(tp_vocab_embedding_t E) {
  if (!E) return;
  tp_reg_release(&E->buf);
  free(E->w);
  free(E->dw);
  free(E->tok);
  free(E);
}

tp_status_t tp_vocab_embedding_create(tp_vocab_embedding_t *out, tp_comm_t comm, const tp_embedding_config_t *cfg) {
  if (!out || !comm || !cfg) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding: NULL argument");
  *out = NULL;
  if (cfg->size != sizeof(tp_embedding_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding: config built for another tpcore version");
  if (cfg->num_embeddings < 1 || cfg->embedding_dim < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding: num_embeddings and embedding_dim must be >= 1, got %lld "
                        "and %lld", (long long)cfg->num_embeddings, (long long)cfg->embedding_dim);
  int rank, world;
  tp_comm_rank(comm, &rank);
  tp_comm_size(comm, &world);
  int64_t off = 0, loc = 0, nel;
  TP_CHECK(split(cfg->partition, world, rank, cfg->num_embeddings, "embedding", &off, &loc));
  if (!tp_numel2(loc, cfg->embedding_dim, &nel))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding: a table shard of %lld x %lld (num_embeddings %lld, "
                        "embedding_dim %lld) is too large: at most 2^40 elements per shard", (long long)loc,
                        (long long)cfg->embedding_dim, (long long)cfg->num_embeddings, (long long)cfg->embedding_dim);
  tp_vocab_embedding_t E = calloc(1, sizeof *E);
  if (!E) return tp_set_error(TP_ERR_NOMEM, "embedding: out of memory");
  E->comm = comm;
  E->world = world;
  E->n = cfg->num_embeddings;
  E->C = cfg->embedding_dim;
  E->off = off;
  E->loc = loc;
  E->last_m = -1;
  E->w = malloc((size_t)(nel ? nel : 1) * sizeof(float));
  E->dw = calloc((size_t)(nel ? nel : 1), sizeof(float));
  if (!E->w || !E->dw) {
    tp_vocab_embedding_destroy(E);
    return tp_set_error(TP_ERR_NOMEM, "embedding: out of memory for the table shard (%lld floats)", (long long)nel);
  }
  /* N(0, 1) by Box-Muller: elements 2p and 2p + 1 of the full table are the cosine and sine
   * halves of pair p, drawn from two counter-based uniforms of p (a shard that starts or ends
   * mid-pair draws the whole pair and keeps its half): the same table at any partition. */
  uint64_t base = (uint64_t)off * (uint64_t)E->C;
  for (int64_t i = 0; i < nel;) {
    uint64_t idx = base + (uint64_t)i, p = idx / 2;
    double u1 = tp_uniform01(cfg->seed, 2, 2 * p), u2 = tp_uniform01(cfg->seed, 2, 2 * p + 1);
    double r = sqrt(-2.0 * log1p(-u1)), a = 6.283185307179586 * u2;
    double z0 = r * cos(a), z1 = r * sin(a);
    if (idx % 2 == 0) {
      E->w[i++] = (float)z0;
      if (i < nel) E->w[i++] = (float)z1;
    } else {
      E->w[i++] = (float)z1;
    }
  }
  *out = E;
  return TP_SUCCESS;
}

tp_status_t tp_vocab_embedding_info(tp_vocab_embedding_t E, tp_embedding_info_t *info) {
  if (!E || !info) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding: NULL argument");
  info->weight = E->w;
  info->grad_weight = E->dw;
  info->offset = E->off;
  info->local = E->loc;
  info->dim = E->C;
  info->num_embeddings = E->n;
  return TP_SUCCESS;
}

static tp_status_t embedding_forward(tp_vocab_embedding_t E, float *y, const int64_t *tokens, int64_t M) {
  E->last_m = -1; /* until this forward's tokens are kept */
  for (int64_t m = 0; m < M; m++)
    if (tokens[m] < 0 || tokens[m] >= E->n)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding forward: token %lld (position %lld) is out of range "
                          "0..%lld", (long long)tokens[m], (long long)m, (long long)(E->n - 1));
  /* Local failures before the collective abort the communicator (the peers would wait). */
  tp_status_t st = tp_grow((void **)&E->tok, &E->tok_cap, M, sizeof(int64_t), "embedding forward");
  if (st != TP_SUCCESS) {
    tp_comm_abort(E->comm, tp_last_error());
    return st;
  }
  if (M) memcpy(E->tok, tokens, (size_t)M * sizeof(int64_t));
  E->last_m = M;
  if (E->world == 1) {
    tp_legacy_embedding_forward(y, tokens, E->w, M, E->off, E->loc, E->C);
    return TP_SUCCESS;
  }
  size_t nbytes = (size_t)(M * E->C) * sizeof(float);
  TP_CHECK(tp_reg_ensure(E->comm, &E->buf, nbytes));
  float *r = E->buf.ptr;
  tp_legacy_embedding_forward(r, tokens, E->w, M, E->off, E->loc, E->C);
  TP_CHECK(tp_all_reduce(r, r, (size_t)(M * E->C), TP_FLOAT32, TP_SUM, E->comm, NULL));
  TP_COPY(y, r, nbytes);
  return TP_SUCCESS;
}

tp_status_t tp_vocab_embedding_forward(tp_vocab_embedding_t E, float *y, const int64_t *tokens, int64_t M) {
  if (!E || (M && (!y || !tokens))) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding forward: NULL argument");
  int64_t nel;
  if (M < 0 || !tp_numel2(M, E->C, &nel))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding forward: %lld tokens is out of range (0 to 2^40 / "
                        "embedding_dim %lld)", (long long)M, (long long)E->C);
  return embedding_forward(E, y, tokens, M);
}

tp_status_t tp_vocab_embedding_backward(tp_vocab_embedding_t E, const float *dy, int64_t M) {
  if (!E || (M && !dy)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding backward: NULL argument");
  if (E->last_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "embedding backward: called before forward");
  if (M != E->last_m)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "embedding backward: dy has %lld rows, the last forward had %lld "
                        "tokens", (long long)M, (long long)E->last_m);
  tp_legacy_embedding_backward(E->dw, E->tok, dy, M, E->off, E->loc, E->C);
  return TP_SUCCESS;
}

/* -------------------------------------------------------------- cross-entropy */

struct tp_vocab_xent {
  tp_comm_t comm;
  int rank, world;
  reg_buf buf;             /* [M + world + 2 maxima | 2M sums] */
  float *gmax, *sumexp, *rs, *s2; /* s2: 2M sums at world 1 */
  int64_t *tg, cap;        /* targets of the last forward, -1 where ignored */
  const float *logits;     /* the last forward's logits (the caller keeps them) */
  int64_t last_m, V, lo;   /* last_m -1 before the first forward */
};

tp_status_t tp_vocab_xent_create(tp_vocab_xent_t *out, tp_comm_t comm) {
  if (!out || !comm) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: NULL argument");
  tp_vocab_xent_t X = calloc(1, sizeof *X);
  if (!X) return tp_set_error(TP_ERR_NOMEM, "cross-entropy: out of memory");
  X->comm = comm;
  tp_comm_rank(comm, &X->rank);
  tp_comm_size(comm, &X->world);
  X->last_m = -1;
  *out = X;
  return TP_SUCCESS;
}

void tp_vocab_xent_destroy(tp_vocab_xent_t X) {
  if (!X) return;
  tp_reg_release(&X->buf);
  free(X->gmax);
  free(X->sumexp);
  free(X->rs);
  free(X->s2);
  free(X->tg);
  free(X);
}

static tp_status_t xent_workspace(tp_vocab_xent_t X, int64_t M) {
  if (M <= X->cap && X->gmax) return TP_SUCCESS;
  float *a = malloc((size_t)(M ? M : 1) * sizeof(float)), *b = malloc((size_t)(M ? M : 1) * sizeof(float));
  float *c = malloc((size_t)(M ? M : 1) * sizeof(float)), *d = malloc((size_t)(M ? 2 * M : 1) * sizeof(float));
  int64_t *t = malloc((size_t)(M ? M : 1) * sizeof(int64_t));
  if (!a || !b || !c || !d || !t) {
    free(a), free(b), free(c), free(d), free(t);
    return tp_set_error(TP_ERR_NOMEM, "cross-entropy: out of memory for %lld rows", (long long)M);
  }
  free(X->gmax), free(X->sumexp), free(X->rs), free(X->s2), free(X->tg);
  X->gmax = a, X->sumexp = b, X->rs = c, X->s2 = d, X->tg = t;
  X->cap = M;
  return TP_SUCCESS;
}

/* A 24-bit fingerprint of the targets and ignore_index (exact in float32): max(h) == -max(-h) over
 * the ranks iff every rank hashed the same targets. */
static float targets_hash(const int64_t *t, int64_t M, int64_t ignore_index) {
  uint64_t h = (0xcbf29ce484222325ULL ^ (uint64_t)M) * 0x100000001b3ULL ^ (uint64_t)ignore_index;
  for (int64_t m = 0; m < M; m++) h = (h ^ (uint64_t)t[m]) * 0x100000001b3ULL;
  h ^= h >> 29;
  return (float)(h & 0xFFFFFF);
}

static tp_status_t xent_forward(tp_vocab_xent_t X, float *losses, const float *logits, const int64_t *targets,
                                int64_t M, int64_t V, int64_t vocab_offset, int64_t ignore_index, int64_t *valid,
                                int64_t *vocab) {
  int n = X->world;
  X->last_m = -1; /* until this forward succeeds: no backward over half-written workspaces */
  tp_status_t st = xent_workspace(X, M);
  if (st == TP_SUCCESS && n > 1) st = tp_reg_ensure(X->comm, &X->buf, (size_t)(3 * M + 2 * n + 2) * sizeof(float));
  if (st != TP_SUCCESS) {
    if (st == TP_ERR_NOMEM) tp_comm_abort(X->comm, tp_last_error());
    return st;
  }
  int64_t lo = vocab_offset, total = V;
  float *mx = n > 1 ? (float *)X->buf.ptr : X->gmax;
  tp_legacy_xent_row_max(mx, logits, M, V);
  if (n > 1) {
    /* One max all-reduce: row maxima, every rank's width and given offset (-1: none), and a
     * fingerprint of (targets, ignore_index).  Everything after it is decided from the same
     * numbers on every rank, so a bad layout or mismatched targets fail every rank alike
     * (and the communicator stays in step).  Widths and offsets are exact up to 2^24. */
    float *wid = mx + M, *offs = mx + M + n, *fp = mx + M + 2 * n;
    for (int p = 0; p < n; p++) wid[p] = offs[p] = -1.0f;
    wid[X->rank] = (float)V;
    offs[X->rank] = vocab_offset < 0 ? -1.0f : vocab_offset > (1 << 24) ? (float)(1 << 25) : (float)vocab_offset;
    float h = targets_hash(targets, M, ignore_index);
    fp[0] = h;
    fp[1] = -h;
    TP_CHECK(tp_all_reduce(mx, mx, (size_t)(M + 2 * n + 2), TP_FLOAT32, TP_MAX, X->comm, NULL));
    if (fp[0] != -fp[1])
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: the ranks passed different targets or ignore_index "
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
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: vocab_offset was given on %lld of %d ranks (give "
                          "it on every rank or on none)", (long long)given, n);
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
        return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: the ranks' vocab_offset and shard widths do not "
                            "tile the vocabulary [0, %lld) (this rank: offset %lld, width %lld)", (long long)total,
                            (long long)vocab_offset, (long long)V);
    } else {
      lo = below;
    }
    memcpy(X->gmax, mx, (size_t)M * sizeof(float));
  } else {
    lo = lo < 0 ? 0 : lo;
    total = lo + V;
  }
  int64_t nvalid = 0;
  for (int64_t m = 0; m < M; m++) {
    int64_t t = targets[m];
    if (t == ignore_index) {
      X->tg[m] = -1;
      continue;
    }
    if (t < 0 || t >= total)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy: target %lld (row %lld) is out of range 0..%lld",
                          (long long)t, (long long)m, (long long)(total - 1));
    X->tg[m] = t;
    nvalid++;
  }
  /* (sum of exp, target logit) per row */
  float *sums = n > 1 ? (float *)X->buf.ptr + M + n + 2 : X->s2;
  tp_legacy_xent_row_sums(sums, logits, X->gmax, X->tg, M, lo, V);
  if (n > 1) TP_CHECK(tp_all_reduce(sums, sums, (size_t)(2 * M), TP_FLOAT32, TP_SUM, X->comm, NULL));
  memcpy(X->sumexp, sums, (size_t)M * sizeof(float));
  const float *tl = sums + M;
  for (int64_t m = 0; m < M; m++)
    losses[m] = X->tg[m] < 0 ? 0.0f : (float)(log((double)X->sumexp[m]) + (double)X->gmax[m] - (double)tl[m]);
  X->logits = logits;
  X->last_m = M;
  X->V = V;
  X->lo = lo;
  if (valid) *valid = nvalid;
  if (vocab) *vocab = total;
  return TP_SUCCESS;
}

tp_status_t tp_vocab_xent_forward(tp_vocab_xent_t X, float *losses, const float *logits, const int64_t *targets,
                                  int64_t M, int64_t V, int64_t vocab_offset, int64_t ignore_index, int64_t *valid,
                                  int64_t *vocab) {
  if (!X || (M && (!losses || !targets || (V && !logits))))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy forward: NULL argument");
  int64_t nel;
  if (M < 0 || V < 0 || !tp_numel2(M, V, &nel) || M > INT_MAX / 4)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy forward: %lld rows x %lld columns is out of range",
                        (long long)M, (long long)V);
  /* lo + V must not overflow where it is computed (one rank).  With several ranks the
   * offsets are checked together, so that a bad one fails every rank alike. */
  if (X->world == 1 && vocab_offset > INT64_MAX - V)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy forward: vocab_offset must be at most 2^63 - 1 - "
                        "the shard width %lld, got %lld", (long long)V, (long long)vocab_offset);
  if (V > (1 << 24))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy forward: a shard of %lld vocabulary entries is wider "
                        "than 2^24", (long long)V);
  return xent_forward(X, losses, logits, targets, M, V, vocab_offset, ignore_index, valid, vocab);
}

tp_status_t tp_vocab_xent_backward(tp_vocab_xent_t X, float *dlogits, const float *dloss, float scale) {
  if (!X) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy backward: NULL argument");
  if (X->last_m < 0) return tp_set_error(TP_ERR_INVALID_USAGE, "cross-entropy backward: called before forward");
  int64_t M = X->last_m;
  if (M && X->V && !dlogits) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cross-entropy backward: NULL argument");
  for (int64_t m = 0; m < M; m++) X->rs[m] = X->tg[m] < 0 ? 0.0f : dloss ? dloss[m] : 1.0f;
  tp_legacy_xent_backward(dlogits, X->logits, X->gmax, X->sumexp, X->tg, X->rs, scale, M, X->lo, X->V);
  return TP_SUCCESS;
}
