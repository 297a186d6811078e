/* The block's attention: fused QKV (column parallel over heads), RoPE, the KV cache,
 * attention on this rank's heads, and the row-parallel output projection (a
 * tp_parallel_linear_t: one all-reduce, the bias once after it). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>

#include "block_impl.h"
#include "layer_kernels.h"

static tp_attention_args attn_args(tp_block_t k, int64_t B, int64_t T, int use_cache) {
  tp_attention_args a;
  memset(&a, 0, sizeof a);
  a.B = B, a.Tq = T, a.Hq = k->nq, a.Hk = k->nk ? k->nk : 1, a.D = k->D;
  a.q = k->qkv, a.q_ld = k->W;
  a.o = k->ao, a.o_ld = k->A;
  a.causal = k->cfg.causal;
  a.scale = k->cfg.attn_scale > 0 ? k->cfg.attn_scale : 1.0f / sqrtf((float)k->D);
  a.softcap = k->cfg.attn_softcap;
  a.window = k->cfg.sliding_window;
  a.group = k->group, a.q_head0 = k->q0, a.k_head0 = k->k0; /* a rank's heads may start mid-group */
  if (use_cache) {
    a.k = k->kc, a.v = k->vc, a.kv_ld = k->nk * k->D, a.kv_bstride = k->crows * k->nk * k->D, a.Tk = k->crows;
    if (k->crows < k->clen) a.kv_ring = k->crows; /* a sliding window's ring: position j at row j % crows */
    a.q_pos = k->pos0, a.k_len = k->klen;
    if (k->have_slots) a.kv_slot = k->slot, a.kv_batch = k->cb; /* row b reads cache sequence slot[b] */
    if (k->paged) { /* row b's position j in block btab[b][j / crows]: the pool of cb blocks of crows rows */
      a.Tk = k->bcols * k->crows, a.kv_batch = k->cb;
      a.kv_block_table = k->btab, a.kv_block_cols = k->bcols, a.kv_block_size = k->crows;
    }
  } else {
    a.k = k->qkv ? k->qkv + k->nq * k->D : NULL, a.v = k->qkv ? k->qkv + (k->nq + k->nk) * k->D : NULL;
    a.kv_ld = k->W, a.kv_bstride = T * k->W, a.Tk = T;
    a.key_mask = k->have_mask ? k->mask : NULL;
  }
  return a;
}

/* What forward keeps for backward: the log-sum-exp [B, nq, T] on tables that say so (the
 * fused CUDA kernels: no T x T anywhere), else the probabilities [B, nq, T, T]. */
static int keeps_lse(tp_block_t k) { return k->lk.k->attention_keeps_lse; }

static void set_kept(tp_block_t k, tp_attention_args *a, float *kept) {
  if (keeps_lse(k)) a->lse = kept;
  else a->probs = kept;
}

int64_t tp_block_attention_kept(tp_block_t k, int64_t B, int64_t T) {
  return keeps_lse(k) ? B * k->nq * T : B * k->nq * T * T; /* bounded by check_batch */
}

size_t tp_block_attention_workspace(tp_block_t k, int64_t B, int64_t T, int use_cache, int need_backward) {
  if (!k->nq || !B || !T) return 0;
  tp_attention_args a = attn_args(k, B, T, use_cache);
  static float kept; /* sizes only: a non-NULL probs (lse) says that forward keeps them */
  if (need_backward) set_kept(k, &a, &kept);
  size_t f = lk_attention_workspace(&k->lk, &a, 0), b = need_backward ? lk_attention_workspace(&k->lk, &a, 1) : 0;
  return f > b ? f : b;
}

/* The rotary embedding (its transpose when inverse) on the Q and K heads of x (qkv or dqkv: they
 * are adjacent), with the block's frequency table and cos/sin factor when it has them. */
static tp_status_t block_rope(tp_block_t k, float *x, int inverse, tp_stream_t s) {
  return lk_rope(&k->lk, x, k->B * k->T, k->W, k->nq + k->nk, k->D, k->pos, k->rope_freq, k->cfg.rope_theta,
                 k->rope_factor, inverse, s);
}

/* qk_norm: the n heads of D values at x[m * W + h * D] (rows m < M) through an RMS norm of weight w:
 * copied out to in [M n, D] (kept for backward), normalized into out, copied back. */
static tp_status_t head_norm_fwd(tp_block_t k, float *x, float *in, float *out, float *rstd, const float *w, int64_t n,
                                 tp_stream_t s) {
  int64_t M = k->B * k->T, D = k->D;
  if (!n || !M) return TP_SUCCESS;
  TP_CHECK(lk_copy_rows(&k->lk, in, n * D, x, k->W, M, n * D, s));
  TP_CHECK(lk_rmsnorm_forward(&k->lk, out, rstd, in, w, M * n, D, k->cfg.eps, s));
  return lk_copy_rows(&k->lk, x, k->W, out, n * D, M, n * D, s);
}

static tp_status_t qk_norm_forward(tp_block_t k, tp_stream_t s) {
  int64_t M = k->B * k->T, D = k->D, nq = k->nq;
  TP_CHECK(head_norm_fwd(k, k->qkv, k->qkin, k->qkout, k->qkrstd, k->qnw, nq, s));
  return head_norm_fwd(k, k->qkv + nq * D, k->qkin + M * nq * D, k->qkout + M * nq * D, k->qkrstd + M * nq, k->knw,
                       k->nk, s);
}

/* The gradient at the norms' outputs (in dx's rows, W apart) -> at their inputs, in place; the
 * weights' gradient accumulated into dw.  dy, dxs: scratch of M n D floats. */
static tp_status_t head_norm_bwd(tp_block_t k, float *dx, const float *in, const float *rstd, const float *w, float *dw,
                                 float *dy, float *dxs, int64_t n, tp_stream_t s) {
  int64_t M = k->B * k->T, D = k->D;
  if (!n || !M) return TP_SUCCESS;
  TP_CHECK(lk_copy_rows(&k->lk, dy, n * D, dx, k->W, M, n * D, s));
  TP_CHECK(lk_rmsnorm_backward(&k->lk, dxs, dw, dy, in, w, rstd, M * n, D, s));
  return lk_copy_rows(&k->lk, dx, k->W, dxs, n * D, M, n * D, s);
}

/* The Q/K norms' backward on dqkv (after the rotary transpose).  Their weights are replicated and
 * each rank's heads add their part of the gradient: this step's deltas are summed over the ranks
 * (every rank takes part, with heads or not). */
static tp_status_t qk_norm_backward(tp_block_t k, tp_stream_t s) {
  int64_t M = k->B * k->T, D = k->D, nq = k->nq, world = k->world;
  size_t db = (size_t)D * sizeof(float);
  if (world > 1) { /* the weights' gradients before this step (two arena slices: not adjacent) */
    TP_CHECK(lk_copy(&k->lk, k->qknsnap, k->dqnw, db, s));
    TP_CHECK(lk_copy(&k->lk, k->qknsnap + D, k->dknw, db, s));
  }
  if (k->nq) { /* scratch: qkout (forward's, no longer needed) and dao (attention backward has read it) */
    TP_CHECK(head_norm_bwd(k, k->dqkv, k->qkin, k->qkrstd, k->qnw, k->dqnw, k->qkout, k->dao, nq, s));
    TP_CHECK(head_norm_bwd(k, k->dqkv + nq * D, k->qkin + M * nq * D, k->qkrstd + M * nq, k->knw, k->dknw, k->qkout,
                           k->dao, k->nk, s));
  }
  if (world == 1) return TP_SUCCESS;
  TP_CHECK(tp_reg_ensure(k->comm, &k->qkred, 2 * db, k->dev, k->dev_id));
  float *g = k->qkred.ptr;
  TP_CHECK(lk_sub(&k->lk, g, k->dqnw, k->qknsnap, D, s));
  TP_CHECK(lk_sub(&k->lk, g + D, k->dknw, k->qknsnap + D, D, s));
  TP_CHECK(tp_layer_all_reduce(g, (size_t)(2 * D), TP_SUM, k->comm, "attention", s));
  TP_CHECK(lk_add(&k->lk, k->dqnw, k->qknsnap, g, D, s));
  return lk_add(&k->lk, k->dknw, k->qknsnap + D, g + D, D, s);
}

tp_status_t tp_block_attention_forward(tp_block_t k, float **r, const float *in, int use_cache, int keep,
                                       tp_stream_t stream) {
  int64_t M = k->B * k->T, D = k->D;
  TP_CHECK(lk_linear_forward(&k->lk, k->qkv, in, &k->Wqkv, k->bqkv, M, k->C, k->W, stream));
  if (k->cfg.qk_norm) TP_CHECK(qk_norm_forward(k, stream));
  if (k->cfg.rope_theta > 0 && k->nq) TP_CHECK(block_rope(k, k->qkv, 0, stream));
  if (use_cache && k->nk && k->paged)
    TP_CHECK(lk_kv_cache_write_paged(&k->lk, k->kc, k->vc, k->qkv + k->nq * D, k->qkv + (k->nq + k->nk) * D, k->W,
                                     k->pos0, k->btab, k->bcols, k->crows, k->B, k->T, k->nk * D, stream));
  else if (use_cache && k->nk)
    TP_CHECK(lk_kv_cache_write(&k->lk, k->kc, k->vc, k->qkv + k->nq * D, k->qkv + (k->nq + k->nk) * D, k->W, k->pos0,
                               k->have_slots ? k->slot : NULL, k->B, k->T, k->crows, k->nk * D,
                               k->crows < k->clen ? k->crows : 0, stream));
  if (k->nq) {
    tp_attention_args a = attn_args(k, k->B, k->T, use_cache);
    if (keep) set_kept(k, &a, k->probs);
    tp_status_t st = lk_attention_forward(&k->lk, &a, k->attn_ws, k->attn_ws_bytes, stream);
    if (st != TP_SUCCESS) {
      tp_error_prefix("block: attention");
      tp_comm_abort(k->comm, tp_last_error()); /* the peers would wait in the all-reduce */
      return st;
    }
  }
  /* row-parallel output projection: partial sums all-reduced in registered memory, bias once after */
  return tp_parallel_linear_forward_inbuf(k->out, r, k->ao, M, TP_LIN_BORROW_INPUT, stream);
}

/* (slot, batch row) pairs in slot order: a slot given twice shows as two neighbours */
typedef struct {
  int64_t slot, row;
} slot_row;

static int by_slot(const void *x, const void *y) {
  const slot_row *a = x, *b = y;
  return a->slot < b->slot ? -1 : a->slot > b->slot ? 1 : (a->row > b->row) - (a->row < b->row);
}

/* The cache slots of a forward (host metadata): each in [0, cache batch), none twice. */
static tp_status_t check_slots(tp_block_t k, const tp_block_batch_t *bt) {
  if (!bt->use_cache)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: slots map batch rows to KV-cache sequences: they "
                        "need use_cache");
  for (int64_t b = 0; b < bt->B; b++)
    if (bt->slots[b] < 0 || bt->slots[b] >= k->cb)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "block forward: slots[%lld] = %lld is outside the KV cache's %lld "
                          "sequences [0, %lld)",
                          (long long)b, (long long)bt->slots[b], (long long)k->cb, (long long)k->cb);
  if (bt->B < 2) return TP_SUCCESS;
  size_t nbytes = 0; /* B <= cache batch <= INT_MAX here */
  tp_arena_add_n(&nbytes, bt->B, sizeof(slot_row));
  slot_row *p;
  TP_CHECK(tp_host_zalloc(nbytes, (void **)&p, "block forward: the slot check"));
  for (int64_t b = 0; b < bt->B; b++) p[b].slot = bt->slots[b], p[b].row = b;
  qsort(p, (size_t)bt->B, sizeof *p, by_slot);
  tp_status_t st = TP_SUCCESS;
  for (int64_t i = 1; i < bt->B && st == TP_SUCCESS; i++)
    if (p[i].slot == p[i - 1].slot)
      st = tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: slots[%lld] and slots[%lld] are both %lld: two "
                        "batch rows would write one KV-cache sequence",
                        (long long)p[i - 1].row, (long long)p[i].row, (long long)p[i].slot);
  tp_host_free(p);
  return st;
}

/* Every size and position of a forward, before anything is allocated or written: rows
 * B x T at most INT_MAX (BLAS), their activations and the kept attention probabilities
 * (B x heads x T x T, on tables that keep them rather than the lse) at most 2^40 elements, positions pos0[b] >= 0 with pos0[b] + T
 * representable, and inside the KV cache ([0, max_len - T]) when it is used.  pos0 and
 * key_mask are host metadata. */
tp_status_t tp_block_check_batch(tp_block_t k, const tp_block_batch_t *bt) {
  int64_t M, n;
  if (bt->B < 0 || bt->T < 0 || !tp_mul_count(bt->B, bt->T, &M) || M > INT_MAX || !tp_numel2(M, k->W + k->C, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: a batch of B = %lld sequences of T = %lld tokens is "
                        "out of range (B, T >= 0, B x T at most %d rows and 2^40 activations)",
                        (long long)bt->B, (long long)bt->T, INT_MAX);
  if (bt->need_backward && !keeps_lse(k) && !tp_numel3(M, k->nq, bt->T, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: keeping the attention probabilities for backward "
                        "needs B x heads x T x T = %lld x %lld x %lld x %lld floats, more than 2^40",
                        (long long)bt->B, (long long)k->nq, (long long)bt->T, (long long)bt->T);
  for (int64_t b = 0; bt->pos0 && b < bt->B; b++) {
    int64_t p = bt->pos0[b];
    if (p < 0)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: pos0 must be >= 0, got pos0[%lld] = %lld",
                          (long long)b, (long long)p);
    if (p > INT64_MAX - bt->T)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "block forward: pos0[%lld] = %lld + T = %lld overflows the "
                          "positions (at most 2^63 - 1 - T)",
                          (long long)b, (long long)p, (long long)bt->T);
  }
  TP_CHECK(tp_block_check_paged(k, bt));
  if (bt->use_cache) {
    if (!k->cfg.causal) return tp_set_error(TP_ERR_INVALID_USAGE, "block forward: a KV cache needs causal attention");
    if (bt->need_backward) return tp_set_error(TP_ERR_INVALID_USAGE, "block forward: no backward through the KV cache");
    if (bt->key_mask)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: key_mask is not used with the cache");
    if (k->paged) return TP_SUCCESS; /* the block table places every position (tp_block_check_paged) */
    if (bt->B > k->cb)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block forward: batch %lld exceeds the cache's %lld sequences",
                          (long long)bt->B, (long long)k->cb);
    if (bt->B && bt->T > k->clen)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "block forward: T = %lld tokens reach past the KV cache's "
                          "max_len %lld",
                          (long long)bt->T, (long long)k->clen);
    int64_t W = k->cfg.sliding_window;
    if (k->crows < k->clen && bt->B && bt->T > k->crows - W + 1)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "block forward: T = %lld tokens at once exceed what the sliding window's KV ring of %lld "
                          "rows takes (window %lld: at most %lld per forward; feed a longer prompt in chunks)",
                          (long long)bt->T, (long long)k->crows, (long long)W, (long long)(k->crows - W + 1));
    for (int64_t b = 0; b < (bt->pos0 ? bt->B : bt->B > 0); b++) { /* without pos0: every sequence at 0 */
      int64_t p = bt->pos0 ? bt->pos0[b] : 0;                      /* >= 0, checked above */
      if (p > k->clen - bt->T)
        return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                            "block forward: pos0[%lld] = %lld with T = %lld tokens reaches "
                            "past the KV cache's max_len %lld: pos0 must be in [0, max_len - T] = [0, %lld]",
                            (long long)b, (long long)p, (long long)bt->T, (long long)k->clen,
                            (long long)(k->clen - bt->T));
    }
  }
  if (bt->slots) TP_CHECK(check_slots(k, bt));
  return TP_SUCCESS;
}

/* KV heads replicated on several ranks: their weight gradients are sums over those ranks.
 * Before the QKV backward, this step's starting values are kept aside (snapshot); after
 * it, the deltas are all-reduced in the full layout [K weights Hk*D*C | V weights | K bias
 * Hk*D | V bias] and the heads' gradients become snapshot + summed delta. */
static tp_status_t kv_snapshot(tp_block_t k, tp_stream_t stream) {
  int64_t C = k->C, kvw = 2 * k->nk * k->D, kvoff = k->nq * k->D;
  if (k->dwqkv) /* NULL: a quantized (frozen) QKV weight */
    TP_CHECK(lk_copy(&k->lk, k->kvsnap, k->dwqkv + kvoff * C, (size_t)(kvw * C) * sizeof(float), stream));
  if (k->dbqkv) TP_CHECK(lk_copy(&k->lk, k->kvsnap + kvw * C, k->dbqkv + kvoff, (size_t)kvw * sizeof(float), stream));
  return TP_SUCCESS;
}

static tp_status_t kv_grad_sum(tp_block_t k, tp_stream_t stream) {
  int64_t C = k->C, D = k->D, kvw = 2 * k->nk * D, kvoff = k->nq * D;
  int64_t HkD = k->Hk * D, n = 2 * HkD * (C + 1), nkd = k->nk * D, k0d = k->k0 * D;
  TP_CHECK(tp_reg_ensure(k->comm, &k->kvred, (size_t)n * sizeof(float), k->dev, k->dev_id));
  float *g = k->kvred.ptr;
  TP_CHECK(lk_zero(&k->lk, g, (size_t)n * sizeof(float), stream));
  for (int kv = 0; kv < 2; kv++) { /* this rank's heads: nkd rows of C, contiguous in both layouts */
    if (k->dwqkv) {
      float *cur = k->dwqkv + (kvoff + kv * nkd) * C, *old = k->kvsnap + kv * nkd * C;
      TP_CHECK(lk_sub(&k->lk, g + kv * HkD * C + k0d * C, cur, old, nkd * C, stream));
    }
    if (k->dbqkv)
      TP_CHECK(lk_sub(&k->lk, g + 2 * HkD * C + kv * HkD + k0d, k->dbqkv + kvoff + kv * nkd,
                      k->kvsnap + kvw * C + kv * nkd, nkd, stream));
  }
  TP_CHECK(tp_layer_all_reduce(g, (size_t)n, TP_SUM, k->comm, "attention", stream));
  for (int kv = 0; kv < 2; kv++) {
    if (k->dwqkv) {
      float *cur = k->dwqkv + (kvoff + kv * nkd) * C, *old = k->kvsnap + kv * nkd * C;
      TP_CHECK(lk_add(&k->lk, cur, old, g + kv * HkD * C + k0d * C, nkd * C, stream));
    }
    if (k->dbqkv)
      TP_CHECK(lk_add(&k->lk, k->dbqkv + kvoff + kv * nkd, k->kvsnap + kvw * C + kv * nkd,
                      g + 2 * HkD * C + kv * HkD + k0d, nkd, stream));
  }
  return TP_SUCCESS;
}

tp_status_t tp_block_attention_backward(tp_block_t k, float *din, const float *dr, const float *in,
                                        tp_stream_t stream) {
  int64_t M = k->B * k->T, D = k->D, C = k->C;
  /* the output projection: dao = dr W_o (its input is parallel: no collective), grads accumulated */
  TP_CHECK(tp_parallel_linear_backward_ex(k->out, k->dao, dr, M, 0, stream));
  if (k->nq) {
    tp_attention_args a = attn_args(k, k->B, k->T, 0);
    set_kept(k, &a, k->probs); /* the lse mode reads forward's output k->ao: kept for W_o's gradient */
    tp_status_t st = lk_attention_backward(&k->lk, &a, k->dqkv, k->dqkv + k->nq * D, k->dqkv + (k->nq + k->nk) * D,
                                           k->dao, k->attn_ws, k->attn_ws_bytes, stream);
    if (st != TP_SUCCESS) {
      tp_error_prefix("block backward: attention");
      tp_comm_abort(k->comm, tp_last_error());
      return st;
    }
    if (k->cfg.rope_theta > 0) TP_CHECK(block_rope(k, k->dqkv, 1, stream));
  }
  if (k->cfg.qk_norm) TP_CHECK(qk_norm_backward(k, stream));
  if (k->kv_replicated) TP_CHECK(kv_snapshot(k, stream));
  float *r = k->red.ptr;
  TP_CHECK(lk_linear_backward(&k->lk, r, k->dwqkv, k->dbqkv, k->dqkv, in, &k->Wqkv, M, C, k->W, stream));
  if (k->world > 1) TP_CHECK(tp_layer_all_reduce(r, (size_t)(M * C), TP_SUM, k->comm, "attention", stream));
  TP_CHECK(lk_copy(&k->lk, din, r, (size_t)(M * C) * sizeof(float), stream));
  if (k->kv_replicated) TP_CHECK(kv_grad_sum(k, stream));
  return TP_SUCCESS;
}
