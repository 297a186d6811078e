/* The tensor-parallel Transformer block (see tpcore/layers.h): norms, attention with
 * this rank's heads, the parallel MLP, residuals; a KV cache for decoding. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers_impl.h"
#include "tpcore/kernels.h"
#include "tpcore/layers.h"

struct tp_block {
  tp_comm_t comm;
  tp_block_config_t cfg;
  int rank, world;
  int64_t C, D, H, Hk, group, q0, nq, k0, nk, W, A; /* W: qkv shard width, A: attention output width */
  int kv_replicated;
  float *wqkv, *bqkv, *dwqkv, *dbqkv, *wo, *bo, *dwo, *dbo;
  float *n1w, *n1b, *dn1w, *dn1b, *n2w, *n2b, *dn2w, *dn2b;
  tp_parallel_mlp_t mlp;
  /* workspaces for `cap` rows (and probs for the last batch shape) */
  int64_t cap, probs_cap, mask_cap, bcap;
  float *xs, *s1, *h1, *s2, *n1, *n2, *qkv, *ao, *mo;
  float *mean1, *rstd1, *mean2, *rstd2;
  float *probs;
  float *dqkv, *dao, *dn, *dh, *dt, *kvsnap;
  int64_t *pos, *pos0, *klen;
  uint8_t *mask;
  reg_buf red, kvred;
  /* the last forward: rows, shape, whether backward may follow */
  int64_t B, T;
  int have_mask, ready;
  /* KV cache [cb, clen, nk * D] each */
  float *kc, *vc;
  int64_t cb, clen;
};

static float uinit(uint64_t seed, uint64_t tensor, uint64_t index, float bound) {
  return (float)((2.0 * tp_uniform01(seed, tensor, index) - 1.0) * bound);
}

void tp_block_destroy(tp_block_t k) {
  if (!k) return;
  tp_parallel_mlp_destroy(k->mlp);
  tp_reg_release(&k->red);
  tp_reg_release(&k->kvred);
  float *fs[] = {k->wqkv, k->bqkv, k->dwqkv, k->dbqkv, k->wo, k->bo, k->dwo, k->dbo, k->n1w, k->n1b, k->dn1w,
                 k->dn1b, k->n2w, k->n2b, k->dn2w, k->dn2b, k->xs, k->s1, k->h1, k->s2, k->n1, k->n2, k->qkv, k->ao,
                 k->mo, k->mean1, k->rstd1, k->mean2, k->rstd2, k->probs, k->dqkv, k->dao, k->dn, k->dh, k->dt,
                 k->kvsnap, k->kc, k->vc};
  for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++) free(fs[i]);
  free(k->pos);
  free(k->pos0);
  free(k->klen);
  free(k->mask);
  free(k);
}

static float *falloc(int64_t n, int zero) {
  size_t c = (size_t)(n > 0 ? n : 1);
  return zero ? calloc(c, sizeof(float)) : malloc(c * sizeof(float));
}

tp_status_t tp_block_create(tp_block_t *out, tp_comm_t comm, const tp_block_config_t *cfg) {
  if (!out || !comm || !cfg) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: NULL argument");
  *out = NULL;
  if (cfg->size != sizeof(tp_block_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: config built for another tpcore version");
  int64_t C = cfg->hidden, H = cfg->heads, Hk = cfg->kv_heads ? cfg->kv_heads : cfg->heads, D = cfg->head_dim;
  if (C < 1 || H < 1 || D < 1 || (cfg->ffn_hidden < 1 && !cfg->attention_only))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: hidden, heads, head_dim and ffn_hidden must be >= 1");
  if (Hk < 1 || Hk > H || H % Hk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: heads (%lld) must be a multiple of kv_heads (%lld)",
                        (long long)H, (long long)Hk);
  if (cfg->rope_theta > 0 && D % 2)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: rotary positions need an even head_dim, got %lld", (long long)D);
  if ((unsigned)cfg->norm > TP_NORM_RMS || (unsigned)cfg->activation > TP_ACT_SWIGLU)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: unknown norm or activation");
  /* GEMM dimensions go to BLAS as 32-bit ints: hidden and the QKV width (heads + 2 kv_heads) x head_dim */
  int64_t qkv_w;
  if (C > INT_MAX / 4 || H > INT_MAX / 4 || Hk > INT_MAX / 4 || D > INT_MAX / 4 ||
      !tp_mul_count(H + 2 * Hk, D, &qkv_w) || qkv_w > INT_MAX / 4)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: hidden (%lld) and (heads + 2 kv_heads) x head_dim ((%lld + "
                        "2 x %lld) x %lld) must each be at most %d (BLAS uses 32-bit dimensions)", (long long)C,
                        (long long)H, (long long)Hk, (long long)D, INT_MAX / 4);
  int64_t wel;
  if (!tp_numel2(qkv_w, C, &wel))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: the QKV weight of %lld x %lld (hidden %lld, heads %lld, "
                        "kv_heads %lld, head_dim %lld) is too large: at most 2^40 elements", (long long)qkv_w,
                        (long long)C, (long long)C, (long long)H, (long long)Hk, (long long)D);
  tp_block_t k = calloc(1, sizeof *k);
  if (!k) return tp_set_error(TP_ERR_NOMEM, "block: out of memory");
  k->comm = comm;
  k->cfg = *cfg;
  k->cfg.head_partition = k->cfg.ffn_partition = NULL;
  tp_comm_rank(comm, &k->rank);
  tp_comm_size(comm, &k->world);
  k->C = C, k->D = D, k->H = H, k->Hk = Hk, k->group = H / Hk;
  /* whole query heads per rank; the KV heads their groups use */
  int64_t sum = 0, prev_end = -1;
  for (int p = 0; p < k->world; p++) {
    int64_t n = cfg->head_partition ? cfg->head_partition[p] : H / k->world + (p < H % k->world);
    if (n < 0 || n > H - sum) {
      tp_block_destroy(k);
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: head_partition[%d] = %lld is %s", p, (long long)n,
                          n < 0 ? "negative" : "more than the heads left for it (the partition must sum to heads)");
    }
    if (n > 0) {
      int64_t kb = sum / k->group, ke = (sum + n - 1) / k->group + 1;
      if (kb < prev_end) k->kv_replicated = 1;
      prev_end = ke;
      if (p == k->rank) k->k0 = kb, k->nk = ke - kb;
    }
    if (p == k->rank) k->q0 = sum, k->nq = n;
    sum += n;
  }
  if (sum != H) {
    tp_block_destroy(k);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: the head partition sums to %lld but there are %lld heads",
                        (long long)sum, (long long)H);
  }
  k->W = (k->nq + 2 * k->nk) * D;
  k->A = k->nq * D;
  int b = cfg->bias;
  k->wqkv = falloc(k->W * C, 0), k->dwqkv = falloc(k->W * C, 1);
  k->wo = falloc(C * k->A, 0), k->dwo = falloc(C * k->A, 1);
  k->bqkv = b ? falloc(k->W, 0) : NULL, k->dbqkv = b ? falloc(k->W, 1) : NULL;
  k->bo = b ? falloc(C, 0) : NULL, k->dbo = b ? falloc(C, 1) : NULL;
  int nb = cfg->norm == TP_NORM_LAYER;
  k->n1w = falloc(C, 0), k->dn1w = falloc(C, 1), k->n2w = falloc(C, 0), k->dn2w = falloc(C, 1);
  k->n1b = nb ? falloc(C, 1) : NULL, k->dn1b = nb ? falloc(C, 1) : NULL;
  k->n2b = nb ? falloc(C, 1) : NULL, k->dn2b = nb ? falloc(C, 1) : NULL;
  if (!k->wqkv || !k->dwqkv || !k->wo || !k->dwo || (b && (!k->bqkv || !k->dbqkv || !k->bo || !k->dbo)) ||
      !k->n1w || !k->dn1w || !k->n2w || !k->dn2w || (nb && (!k->n1b || !k->dn1b || !k->n2b || !k->dn2b))) {
    tp_status_t st = tp_set_error(TP_ERR_NOMEM, "block: out of memory for the parameters (a QKV shard of %lld x "
                                  "%lld floats)", (long long)k->W, (long long)C);
    tp_block_destroy(k); /* after the message: it reads k */
    return st;
  }
  /* nn.Linear-style init from (seed, tensor, index of the full tensor): the same logical
   * block at every world size and head partition */
  float bq = 1.0f / sqrtf((float)C), bo = 1.0f / sqrtf((float)(H * D));
  for (int64_t i = 0; i < k->W; i++) {
    int64_t nqd = k->nq * D, nkd = k->nk * D;
    int64_t frow = i < nqd ? k->q0 * D + i : i < nqd + nkd ? H * D + k->k0 * D + (i - nqd)
                                                            : (H + Hk) * D + k->k0 * D + (i - nqd - nkd);
    for (int64_t j = 0; j < C; j++) k->wqkv[i * C + j] = uinit(cfg->seed, 10, (uint64_t)(frow * C + j), bq);
    if (b) k->bqkv[i] = uinit(cfg->seed, 11, (uint64_t)frow, bq);
  }
  for (int64_t i = 0; i < C; i++) {
    for (int64_t j = 0; j < k->A; j++) k->wo[i * k->A + j] = uinit(cfg->seed, 12, (uint64_t)(i * H * D + k->q0 * D + j), bo);
    if (b) k->bo[i] = uinit(cfg->seed, 13, (uint64_t)i, bo);
    k->n1w[i] = k->n2w[i] = 1.0f;
  }
  if (cfg->attention_only) { /* ParallelAttention: no MLP */
    *out = k;
    return TP_SUCCESS;
  }
  tp_mlp_config_t mc = TP_MLP_CONFIG_INITIALIZER;
  mc.hidden = C;
  mc.ffn_hidden = cfg->ffn_hidden;
  mc.activation = cfg->activation;
  mc.bias = cfg->bias;
  mc.partition = cfg->ffn_partition;
  mc.seed = cfg->seed + 100;
  tp_status_t st = tp_parallel_mlp_create(&k->mlp, comm, &mc);
  if (st != TP_SUCCESS) {
    tp_error_prefix("block");
    tp_block_destroy(k);
    return st;
  }
  *out = k;
  return TP_SUCCESS;
}

tp_status_t tp_block_info(tp_block_t k, tp_block_info_t *info) {
  if (!k || !info) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: NULL argument");
  info->q0 = k->q0, info->nq = k->nq, info->k0 = k->k0, info->nk = k->nk;
  info->cache_batch = k->cb, info->cache_len = k->clen;
  info->kv_replicated = k->kv_replicated;
  return TP_SUCCESS;
}

int tp_block_params(tp_block_t k, tp_param_t *out, int max) {
  if (!k) return 0;
  tp_linear_info_t f1, f2;
  memset(&f1, 0, sizeof f1);
  memset(&f2, 0, sizeof f2);
  if (k->mlp) {
    tp_parallel_linear_info(tp_parallel_mlp_layer(k->mlp, 0), &f1);
    tp_parallel_linear_info(tp_parallel_mlp_layer(k->mlp, 1), &f2);
  }
  tp_param_t all[] = {
      {"norm1.weight", k->n1w, k->dn1w, 1, k->C, 0},
      {"norm1.bias", k->n1b, k->dn1b, 1, k->C, 0},
      {"attn.qkv.weight", k->wqkv, k->dwqkv, 2, k->W, k->C},
      {"attn.qkv.bias", k->bqkv, k->dbqkv, 1, k->W, 0},
      {"attn.out.weight", k->wo, k->dwo, 2, k->C, k->A},
      {"attn.out.bias", k->bo, k->dbo, 1, k->C, 0},
      {"norm2.weight", k->n2w, k->dn2w, 1, k->C, 0},
      {"norm2.bias", k->n2b, k->dn2b, 1, k->C, 0},
      {"mlp.fc1.weight", f1.weight, f1.grad_weight, 2, f1.weight_rows, f1.weight_cols},
      {"mlp.fc1.bias", f1.bias, f1.grad_bias, 1, f1.bias_len, 0},
      {"mlp.fc2.weight", f2.weight, f2.grad_weight, 2, f2.weight_rows, f2.weight_cols},
      {"mlp.fc2.bias", f2.bias, f2.grad_bias, 1, f2.bias_len, 0},
  };
  int n = 0;
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    if (!all[i].data || (k->cfg.attention_only && strncmp(all[i].name, "attn.", 5) != 0)) continue;
    if (n < max) out[n] = all[i];
    n++;
  }
  return n;
}

tp_status_t tp_block_cache(tp_block_t k, int64_t batch, int64_t max_len) {
  if (!k) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block cache: NULL argument");
  /* max_len is the leading dimension of the attention's score GEMMs: a 32-bit int */
  if (batch < 1 || batch > INT_MAX || max_len < 1 || max_len > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block cache: batch and max_len must be in [1, %d], got batch %lld "
                        "and max_len %lld", INT_MAX, (long long)batch, (long long)max_len);
  int64_t n;
  if (!tp_numel3(batch, max_len, k->nk * k->D, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block cache: batch %lld x max_len %lld x %lld K/V values per "
                        "token is too large: at most 2^40 elements", (long long)batch, (long long)max_len,
                        (long long)(k->nk * k->D));
  float *kc = falloc(n, 1), *vc = falloc(n, 1);
  if (!kc || !vc) {
    free(kc), free(vc);
    return tp_set_error(TP_ERR_NOMEM, "block cache: out of memory for batch %lld x max_len %lld tokens (2 x %lld "
                        "floats)", (long long)batch, (long long)max_len, (long long)n);
  }
  free(k->kc), free(k->vc);
  k->kc = kc, k->vc = vc, k->cb = batch, k->clen = max_len;
  return TP_SUCCESS;
}

/* Workspaces for M rows; probs for B x nq x T x T when backward may follow. */
static tp_status_t workspaces(tp_block_t k, int64_t M, int64_t B, int64_t T, int probs) {
  /* allocated (at least one element) even for an empty batch: no copy or kernel ever gets NULL */
  if (M > k->cap || !k->xs) {
    int64_t C = k->C;
    float **bufs[] = {&k->xs, &k->s1, &k->h1, &k->s2, &k->n1, &k->n2, &k->mo, &k->dn, &k->dh, &k->dt,
                      &k->qkv, &k->dqkv, &k->ao, &k->dao, &k->mean1, &k->rstd1, &k->mean2, &k->rstd2};
    int64_t width[] = {C, C, C, C, C, C, C, C, C, C, k->W, k->W, k->A, k->A, 1, 1, 1, 1};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
      free(*bufs[i]);
      *bufs[i] = falloc(M * width[i], 0);
      if (!*bufs[i]) {
        k->cap = 0;
        return tp_set_error(TP_ERR_NOMEM, "block: out of memory for %lld rows of workspace", (long long)M);
      }
    }
    free(k->pos);
    k->pos = malloc((size_t)(M ? M : 1) * sizeof(int64_t));
    if (!k->pos) {
      k->cap = 0;
      return tp_set_error(TP_ERR_NOMEM, "block: out of memory");
    }
    k->cap = M;
  }
  if (B > k->bcap || !k->pos0) {
    free(k->pos0), free(k->klen);
    k->pos0 = malloc((size_t)(B ? B : 1) * sizeof(int64_t)), k->klen = malloc((size_t)(B ? B : 1) * sizeof(int64_t));
    if (!k->pos0 || !k->klen) {
      k->bcap = 0;
      return tp_set_error(TP_ERR_NOMEM, "block: out of memory");
    }
    k->bcap = B;
  }
  if (M > k->mask_cap || !k->mask) {
    free(k->mask);
    k->mask = malloc((size_t)(M ? M : 1));
    if (!k->mask) {
      k->mask_cap = 0;
      return tp_set_error(TP_ERR_NOMEM, "block: out of memory");
    }
    k->mask_cap = M;
  }
  if (probs) {
    int64_t np = B * k->nq * T * T; /* bounded by check_batch */
    if (np > k->probs_cap || !k->probs) {
      free(k->probs);
      k->probs = falloc(np, 0);
      if (!k->probs) {
        k->probs_cap = 0;
        return tp_set_error(TP_ERR_NOMEM, "block: out of memory for the attention probabilities (%lld floats)",
                            (long long)np);
      }
      k->probs_cap = np;
    }
  }
  return TP_SUCCESS;
}

static void add_rows(float *y, const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

static void norm_fwd(tp_block_t k, float *y, float *mean, float *rstd, const float *x, const float *w,
                     const float *b, int64_t M) {
  if (k->cfg.norm == TP_NORM_RMS) tp_legacy_rmsnorm_forward(y, rstd, x, w, M, k->C, k->cfg.eps);
  else tp_legacy_layernorm_forward(y, mean, rstd, x, w, b, M, k->C, k->cfg.eps);
}

static void norm_bwd(tp_block_t k, float *dx, float *dw, float *db, const float *dy, const float *x, const float *w,
                     const float *mean, const float *rstd, int64_t M) {
  if (k->cfg.norm == TP_NORM_RMS) tp_legacy_rmsnorm_backward(dx, dw, dy, x, w, rstd, M, k->C);
  else tp_legacy_layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, M, k->C);
}

static tp_attention_args attn_args(tp_block_t k, int use_cache) {
  tp_attention_args a;
  memset(&a, 0, sizeof a);
  a.B = k->B, a.Tq = k->T, a.Hq = k->nq, a.Hk = k->nk ? k->nk : 1, a.D = k->D;
  a.q = k->qkv, a.q_ld = k->W;
  a.o = k->ao, a.o_ld = k->A;
  a.causal = k->cfg.causal;
  a.scale = 1.0f / sqrtf((float)k->D);
  a.group = k->group, a.q_head0 = k->q0, a.k_head0 = k->k0; /* a rank's heads may start mid-group */
  if (use_cache) {
    a.k = k->kc, a.v = k->vc, a.kv_ld = k->nk * k->D, a.kv_bstride = k->clen * k->nk * k->D, a.Tk = k->clen;
    a.q_pos = k->pos0, a.k_len = k->klen;
  } else {
    a.k = k->qkv + k->nq * k->D, a.v = k->qkv + (k->nq + k->nk) * k->D;
    a.kv_ld = k->W, a.kv_bstride = k->T * k->W, a.Tk = k->T;
    a.key_mask = k->have_mask ? k->mask : NULL;
  }
  return a;
}

/* attention on this rank's heads of in[M, C]; the all-reduced projection (+ bias) lands in r[M, C] */
static tp_status_t attention_forward(tp_block_t k, float *r, const float *in, int use_cache, int keep) {
  int64_t M = k->B * k->T, D = k->D;
  tp_legacy_linear_forward(k->qkv, in, k->wqkv, k->bqkv, M, k->C, k->W);
  if (k->cfg.rope_theta > 0 && k->nq)
    tp_legacy_rope_apply(k->qkv, M, k->W, k->nq + k->nk, D, k->pos, k->cfg.rope_theta, 0); /* Q and K heads are adjacent */
  if (use_cache) {
    int64_t kw = k->nk * D;
    for (int64_t b = 0; b < k->B; b++)
      for (int64_t t = 0; t < k->T; t++) {
        const float *row = k->qkv + (b * k->T + t) * k->W;
        int64_t at = (b * k->clen + k->pos0[b] + t) * kw;
        memcpy(k->kc + at, row + k->nq * D, (size_t)kw * sizeof(float));
        memcpy(k->vc + at, row + (k->nq + k->nk) * D, (size_t)kw * sizeof(float));
      }
  }
  if (k->nq) {
    tp_attention_args a = attn_args(k, use_cache);
    a.probs = keep ? k->probs : NULL;
    if (tp_legacy_attention_forward(&a)) {
      tp_set_error(TP_ERR_NOMEM, "block: out of memory in attention");
      tp_comm_abort(k->comm, tp_last_error()); /* the peers would wait in the all-reduce */
      return TP_ERR_NOMEM;
    }
  }
  /* row-parallel output projection: partial sums all-reduced in registered memory, bias once after */
  tp_legacy_linear_forward(r, k->ao, k->wo, NULL, M, k->A, k->C);
  if (k->world > 1) TP_CHECK(tp_all_reduce(r, r, (size_t)(M * k->C), TP_FLOAT32, TP_SUM, k->comm, NULL));
  if (k->bo)
    for (int64_t m = 0; m < M; m++)
      for (int64_t c = 0; c < k->C; c++) r[m * k->C + c] += k->bo[c];
  return TP_SUCCESS;
}

/* Every size and position of a forward, before anything is allocated or written: rows
 * B x T at most INT_MAX (BLAS), their activations and the kept attention probabilities
 * (B x heads x T x T) at most 2^40 elements, positions pos0[b] >= 0 with pos0[b] + T
 * representable, and inside the KV cache ([0, max_len - T]) when it is used. */
static tp_status_t check_batch(tp_block_t k, const tp_block_batch_t *bt) {
  int64_t M, n;
  if (bt->B < 0 || bt->T < 0 || !tp_mul_count(bt->B, bt->T, &M) || M > INT_MAX || !tp_numel2(M, k->W + k->C, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: a batch of B = %lld sequences of T = %lld tokens is "
                        "out of range (B, T >= 0, B x T at most %d rows and 2^40 activations)", (long long)bt->B,
                        (long long)bt->T, INT_MAX);
  if (bt->need_backward && !tp_numel3(M, k->nq, bt->T, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: keeping the attention probabilities for backward "
                        "needs B x heads x T x T = %lld x %lld x %lld x %lld floats, more than 2^40",
                        (long long)bt->B, (long long)k->nq, (long long)bt->T, (long long)bt->T);
  for (int64_t b = 0; bt->pos0 && b < bt->B; b++) {
    int64_t p = bt->pos0[b];
    if (p < 0)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: pos0 must be >= 0, got pos0[%lld] = %lld",
                          (long long)b, (long long)p);
    if (p > INT64_MAX - bt->T)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: pos0[%lld] = %lld + T = %lld overflows the "
                          "positions (at most 2^63 - 1 - T)", (long long)b, (long long)p, (long long)bt->T);
  }
  if (bt->use_cache) {
    if (!k->cfg.causal)
      return tp_set_error(TP_ERR_INVALID_USAGE, "block forward: a KV cache needs causal attention");
    if (bt->need_backward) return tp_set_error(TP_ERR_INVALID_USAGE, "block forward: no backward through the KV cache");
    if (bt->key_mask) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: key_mask is not used with the cache");
    if (bt->B > k->cb)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: batch %lld exceeds the cache's %lld sequences",
                          (long long)bt->B, (long long)k->cb);
    if (bt->B && bt->T > k->clen)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: T = %lld tokens reach past the KV cache's "
                          "max_len %lld", (long long)bt->T, (long long)k->clen);
    for (int64_t b = 0; b < (bt->pos0 ? bt->B : bt->B > 0); b++) { /* without pos0: every sequence at 0 */
      int64_t p = bt->pos0 ? bt->pos0[b] : 0; /* >= 0, checked above */
      if (p > k->clen - bt->T)
        return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: pos0[%lld] = %lld with T = %lld tokens reaches "
                            "past the KV cache's max_len %lld: pos0 must be in [0, max_len - T] = [0, %lld]",
                            (long long)b, (long long)p, (long long)bt->T, (long long)k->clen,
                            (long long)(k->clen - bt->T));
    }
  }
  return TP_SUCCESS;
}

tp_status_t tp_block_forward(tp_block_t k, float *y, const float *x, const tp_block_batch_t *bt) {
  if (!k || !bt || (bt->B > 0 && bt->T > 0 && (!x || !y))) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: NULL argument");
  TP_CHECK(check_batch(k, bt));
  int64_t B = bt->B, T = bt->T, M = B * T, C = k->C;
  if (M == 0) B = T = 0; /* an empty batch (2^40 sequences of 0 tokens ...) needs no per-sequence workspace */
  k->ready = 0;
  tp_status_t st = workspaces(k, M, B, T, bt->need_backward);
  if (st != TP_SUCCESS) {
    tp_comm_abort(k->comm, tp_last_error()); /* the peers would wait in the all-reduce */
    return st;
  }
  k->B = B, k->T = T;
  for (int64_t b = 0; b < B; b++) {
    k->pos0[b] = bt->pos0 ? bt->pos0[b] : 0;
    k->klen[b] = k->pos0[b] + T;
    for (int64_t t = 0; t < T; t++) k->pos[b * T + t] = k->pos0[b] + t;
  }
  k->have_mask = bt->key_mask != NULL;
  if (k->have_mask) TP_COPY(k->mask, bt->key_mask, (size_t)M);
  TP_COPY(k->xs, x, (size_t)(M * C) * sizeof(float));
  TP_CHECK(tp_reg_ensure(k->comm, &k->red, (size_t)(M * C) * sizeof(float)));
  float *r = k->red.ptr;
  if (k->cfg.attention_only) {
    TP_CHECK(attention_forward(k, r, k->xs, bt->use_cache, bt->need_backward));
    TP_COPY(y, r, (size_t)(M * C) * sizeof(float));
  } else if (k->cfg.pre_norm) {
    norm_fwd(k, k->n1, k->mean1, k->rstd1, k->xs, k->n1w, k->n1b, M);
    TP_CHECK(attention_forward(k, r, k->n1, bt->use_cache, bt->need_backward));
    add_rows(k->h1, k->xs, r, M * C);
    norm_fwd(k, k->n2, k->mean2, k->rstd2, k->h1, k->n2w, k->n2b, M);
    TP_CHECK(tp_parallel_mlp_forward(k->mlp, k->mo, k->n2, M));
    add_rows(y, k->h1, k->mo, M * C);
  } else {
    TP_CHECK(attention_forward(k, r, k->xs, bt->use_cache, bt->need_backward));
    add_rows(k->s1, k->xs, r, M * C);
    norm_fwd(k, k->h1, k->mean1, k->rstd1, k->s1, k->n1w, k->n1b, M);
    TP_CHECK(tp_parallel_mlp_forward(k->mlp, k->mo, k->h1, M));
    add_rows(k->s2, k->h1, k->mo, M * C);
    norm_fwd(k, y, k->mean2, k->rstd2, k->s2, k->n2w, k->n2b, M);
  }
  k->ready = bt->need_backward;
  return TP_SUCCESS;
}

/* dr[M, C] (the gradient at the attention's all-reduced output) -> din[M, C] (at its
 * input, all-reduced: the conjugate of the replicated input); accumulates the grads. */
static tp_status_t attention_backward(tp_block_t k, float *din, const float *dr, const float *in) {
  int64_t M = k->B * k->T, D = k->D, C = k->C;
  if (k->dbo)
    for (int64_t m = 0; m < M; m++)
      for (int64_t c = 0; c < C; c++) k->dbo[c] += dr[m * C + c];
  tp_legacy_linear_backward(k->dao, k->dwo, NULL, dr, k->ao, k->wo, M, k->A, C, 0);
  if (k->nq) {
    tp_attention_args a = attn_args(k, 0);
    a.probs = k->probs;
    if (tp_legacy_attention_backward(&a, k->dqkv, k->dqkv + k->nq * D, k->dqkv + (k->nq + k->nk) * D, k->dao)) {
      tp_set_error(TP_ERR_NOMEM, "block backward: out of memory in attention");
      tp_comm_abort(k->comm, tp_last_error());
      return TP_ERR_NOMEM;
    }
    if (k->cfg.rope_theta > 0) tp_legacy_rope_apply(k->dqkv, M, k->W, k->nq + k->nk, D, k->pos, k->cfg.rope_theta, 1);
  }
  /* KV heads replicated on several ranks: their weight gradients are sums over those ranks;
   * keep this step's share aside (snapshot) to add the all-reduced sums instead */
  int64_t kvw = 2 * k->nk * D, kvoff = k->nq * D;
  if (k->kv_replicated) {
    if (!k->kvsnap) k->kvsnap = falloc(kvw * (C + 1), 0);
    if (!k->kvsnap) {
      tp_set_error(TP_ERR_NOMEM, "block backward: out of memory");
      tp_comm_abort(k->comm, tp_last_error());
      return TP_ERR_NOMEM;
    }
    memcpy(k->kvsnap, k->dwqkv + kvoff * C, (size_t)(kvw * C) * sizeof(float));
    if (k->dbqkv) memcpy(k->kvsnap + kvw * C, k->dbqkv + kvoff, (size_t)kvw * sizeof(float));
  }
  float *r = k->red.ptr;
  tp_legacy_linear_backward(r, k->dwqkv, k->dbqkv, k->dqkv, in, k->wqkv, M, C, k->W, 0);
  if (k->world > 1) TP_CHECK(tp_all_reduce(r, r, (size_t)(M * C), TP_FLOAT32, TP_SUM, k->comm, NULL));
  TP_COPY(din, r, (size_t)(M * C) * sizeof(float));
  if (k->kv_replicated) {
    /* full layout: [K weights Hk*D*C | V weights | K bias Hk*D | V bias] */
    int64_t HkD = k->Hk * D, n = 2 * HkD * (C + 1);
    TP_CHECK(tp_reg_ensure(k->comm, &k->kvred, (size_t)n * sizeof(float)));
    float *g = k->kvred.ptr;
    memset(g, 0, (size_t)n * sizeof(float));
    int64_t nkd = k->nk * D, k0d = k->k0 * D;
    for (int kv = 0; kv < 2; kv++) {
      for (int64_t i = 0; i < nkd; i++) {
        float *cur = k->dwqkv + (kvoff + kv * nkd + i) * C, *old = k->kvsnap + (kv * nkd + i) * C;
        float *dst = g + kv * HkD * C + (k0d + i) * C;
        for (int64_t c = 0; c < C; c++) dst[c] = cur[c] - old[c];
        if (k->dbqkv)
          g[2 * HkD * C + kv * HkD + k0d + i] = k->dbqkv[kvoff + kv * nkd + i] - k->kvsnap[kvw * C + kv * nkd + i];
      }
    }
    TP_CHECK(tp_all_reduce(g, g, (size_t)n, TP_FLOAT32, TP_SUM, k->comm, NULL));
    for (int kv = 0; kv < 2; kv++)
      for (int64_t i = 0; i < nkd; i++) {
        float *cur = k->dwqkv + (kvoff + kv * nkd + i) * C, *old = k->kvsnap + (kv * nkd + i) * C;
        const float *sum = g + kv * HkD * C + (k0d + i) * C;
        for (int64_t c = 0; c < C; c++) cur[c] = old[c] + sum[c];
        if (k->dbqkv)
          k->dbqkv[kvoff + kv * nkd + i] = k->kvsnap[kvw * C + kv * nkd + i] + g[2 * HkD * C + kv * HkD + k0d + i];
      }
  }
  return TP_SUCCESS;
}

tp_status_t tp_block_backward(tp_block_t k, float *dx, const float *dy, int64_t rows) {
  if (!k) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block backward: NULL argument");
  if (!k->ready) return tp_set_error(TP_ERR_INVALID_USAGE, "block backward: called before forward (with need_backward)");
  int64_t M = k->B * k->T, C = k->C;
  if (rows != M)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block backward: dy has %lld rows but the last forward had %lld "
                        "(B * T = %lld x %lld)", (long long)rows, (long long)M, (long long)k->B, (long long)k->T);
  if (M && (!dx || !dy)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block backward: NULL argument");
  if (k->cfg.attention_only) {
    TP_COPY(k->dt, dy, (size_t)(M * C) * sizeof(float));
    return attention_backward(k, dx, k->dt, k->xs);
  }
  if (k->cfg.pre_norm) {
    TP_CHECK(tp_parallel_mlp_backward(k->mlp, k->dn, dy, M));                       /* d norm2 out */
    norm_bwd(k, k->dt, k->dn2w, k->dn2b, k->dn, k->h1, k->n2w, k->mean2, k->rstd2, M);
    add_rows(k->dh, dy, k->dt, M * C);                                              /* d h1 */
    TP_CHECK(attention_backward(k, k->dn, k->dh, k->n1));                          /* d norm1 out */
    norm_bwd(k, k->dt, k->dn1w, k->dn1b, k->dn, k->xs, k->n1w, k->mean1, k->rstd1, M);
    add_rows(dx, k->dh, k->dt, M * C);
  } else {
    norm_bwd(k, k->dt, k->dn2w, k->dn2b, dy, k->s2, k->n2w, k->mean2, k->rstd2, M);  /* d s2 */
    TP_CHECK(tp_parallel_mlp_backward(k->mlp, k->dn, k->dt, M));
    add_rows(k->dh, k->dt, k->dn, M * C);                                           /* d h1 */
    norm_bwd(k, k->dt, k->dn1w, k->dn1b, k->dh, k->s1, k->n1w, k->mean1, k->rstd1, M); /* d s1 */
    TP_CHECK(attention_backward(k, k->dn, k->dt, k->xs));
    add_rows(dx, k->dt, k->dn, M * C);
  }
  return TP_SUCCESS;
}
