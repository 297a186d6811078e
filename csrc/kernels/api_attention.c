/* The public attention and optimizer kernels (tpcore/kernels.h): checks, then the
 * entry of the device's kernel table. */
#include <limits.h>
#include <math.h>

#include "api_impl.h"

static tp_status_t dim_ok(tp_kcall *c, const char *what, int64_t v, int64_t lo) {
  if (v < lo || v > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->%s = %lld must be in [%lld, %d]", c->op, what, (long long)v,
                        (long long)lo, INT_MAX);
  return TP_SUCCESS;
}

/* softcap, window and kv_ring (0 everywhere: off). */
static tp_status_t check_families(tp_kcall *c, const tp_attention_args *a, int backward) {
  if (!(a->softcap >= 0.0f) || isinf(a->softcap)) /* NaN fails the first test */
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->softcap = %g must be finite and >= 0 (0: off)", c->op,
                        (double)a->softcap);
  if (a->window < 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->window = %lld must be >= 0 (0: off)", c->op,
                        (long long)a->window);
  if (a->kv_ring < 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_ring = %lld must be >= 0 (0: off)", c->op,
                        (long long)a->kv_ring);
  if (!a->kv_ring) return TP_SUCCESS;
  if (backward)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_ring is for forward over a KV cache only", c->op);
  if (!a->k_len)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->kv_ring = %lld needs args->k_len (a ring is read over a KV cache: q_pos and k_len)",
                        c->op, (long long)a->kv_ring);
  if (a->probs || a->key_mask)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->kv_ring takes neither probs nor key_mask (both are indexed by key position < Tk)",
                        c->op);
  if (!a->window || a->window > INT64_MAX - a->Tq || a->window + a->Tq - 1 > a->kv_ring)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->kv_ring = %lld needs a window with window + Tq - 1 <= kv_ring (the keys a step "
                        "sees must all be in the ring), got window = %lld, Tq = %lld",
                        c->op, (long long)a->kv_ring, (long long)a->window, (long long)a->Tq);
  if (a->kv_ring > a->Tk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_ring = %lld is above the Tk = %lld rows k and v hold",
                        c->op, (long long)a->kv_ring, (long long)a->Tk);
  return TP_SUCCESS;
}

/* The paged KV cache (kv_block_size > 0): the pool, the table, and on the CPU every entry
 * of the B rows of the table (host memory) either < 0 (no block) or a block of the pool. */
static tp_status_t check_paged(tp_kcall *c, const tp_attention_args *a, int backward) {
  if (a->kv_block_size < 0 || a->kv_block_size > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_block_size = %lld must be in [0, %d] (0: off)", c->op,
                        (long long)a->kv_block_size, INT_MAX);
  if (!a->kv_block_size) {
    if (a->kv_block_table)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_block_table is set but args->kv_block_size is 0",
                          c->op);
    return TP_SUCCESS;
  }
  const char *excl = backward ? "backward" : a->kv_slot ? "kv_slot" : a->kv_ring ? "kv_ring" : NULL;
  if (excl)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: a paged KV cache (args->kv_block_size > 0) excludes %s", c->op,
                        excl);
  if (!a->k_len)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: a paged KV cache needs args->k_len (it is read over a KV cache: q_pos and k_len)", c->op);
  if (a->kv_batch < 1 || a->kv_batch > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->kv_batch = %lld (the blocks of the paged pool) must be in [1, %d]", c->op,
                        (long long)a->kv_batch, INT_MAX);
  int64_t span;
  if (a->kv_block_cols < 1 || !tp_mul_count(a->kv_block_cols, a->kv_block_size, &span) || span < a->Tk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->kv_block_cols = %lld x kv_block_size = %lld must cover the Tk = %lld key positions",
                        c->op, (long long)a->kv_block_cols, (long long)a->kv_block_size, (long long)a->Tk);
  if (a->B && a->Tq && !a->kv_block_table)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_block_table is NULL", c->op);
  if (a->device != TP_DEVICE_CPU) return TP_SUCCESS; /* device memory: CUDA treats a bad entry as no block */
  int64_t n;
  if (!tp_mul_count(a->B, a->kv_block_cols, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: B x kv_block_cols overflows", c->op);
  for (int64_t e = 0; a->Tq && e < n; e++)
    if (a->kv_block_table[e] >= a->kv_batch)
      return tp_set_error(
          TP_ERR_INVALID_ARGUMENT,
          "%s: args->kv_block_table[%lld][%lld] = %lld is outside the pool's blocks [0, kv_batch = %lld) "
          "(< 0: no block)",
          c->op, (long long)(e / a->kv_block_cols), (long long)(e % a->kv_block_cols), (long long)a->kv_block_table[e],
          (long long)a->kv_batch);
  return TP_SUCCESS;
}

/* The sizes, layouts and pointers of args (attention.c reads nothing outside them). */
static tp_status_t check_args(tp_kcall *c, const tp_attention_args *a, int backward) {
  if (!a) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args is NULL", c->op);
  TP_CHECK(tp_kdevice(c, "args", a->device, a->device_id));
  TP_CHECK(dim_ok(c, "B", a->B, 0));
  TP_CHECK(dim_ok(c, "Tq", a->Tq, 0));
  TP_CHECK(dim_ok(c, "Tk", a->Tk, 0));
  TP_CHECK(dim_ok(c, "Hq", a->Hq, 0));
  TP_CHECK(dim_ok(c, "Hk", a->Hk, 1));
  TP_CHECK(dim_ok(c, "D", a->D, 0));
  if (!a->group && a->Hq % a->Hk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->Hq (%lld) must be a multiple of args->Hk (%lld)", c->op,
                        (long long)a->Hq, (long long)a->Hk);
  if (a->group < 0 || a->q_head0 < 0 || a->k_head0 < 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->group, q_head0 and k_head0 must be >= 0", c->op);
  int64_t qw, kw, n, rows;
  if (!tp_mul_count(a->Hq, a->D, &qw) || !tp_mul_count(a->Hk, a->D, &kw) || !tp_mul_count(a->B, a->Tq, &rows) ||
      !tp_numel3(a->B, a->Tq, qw, &n) || !tp_numel3(a->B, a->Tk, kw, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: B x T x heads x D is out of range (at most 2^40)", c->op);
  if (a->q_ld < qw || a->o_ld < qw || a->kv_ld < kw || a->q_ld > INT_MAX || a->o_ld > INT_MAX || a->kv_ld > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->q_ld and o_ld must be in [Hq x D = %lld, %d] and kv_ld in "
                        "[Hk x D = %lld, %d], got %lld, %lld and %lld",
                        c->op, (long long)qw, INT_MAX, (long long)kw, INT_MAX, (long long)a->q_ld, (long long)a->o_ld,
                        (long long)a->kv_ld);
  /* the KV sequences the kernel may index: B, or kv_batch through kv_slot */
  if (a->kv_slot && backward)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_slot is for forward over a KV cache only", c->op);
  if (a->kv_slot && (a->kv_batch < 1 || a->kv_batch > INT_MAX))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->kv_batch = %lld (the KV sequences kv_slot indexes) must "
                        "be in [1, %d]",
                        c->op, (long long)a->kv_batch, INT_MAX);
  TP_CHECK(check_paged(c, a, backward));
  const int paged = a->kv_block_size > 0;
  int64_t nkv = a->kv_slot || paged ? a->kv_batch : a->B, krows = paged ? a->kv_block_size : a->Tk;
  if (nkv > 1 && (a->kv_bstride < 0 || a->kv_bstride / (krows ? krows : 1) < a->kv_ld))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_bstride (%lld) must be at least %s x kv_ld", c->op,
                        (long long)a->kv_bstride, paged ? "kv_block_size" : "Tk");
  if (a->kv_slot && a->device == TP_DEVICE_CPU) /* host memory: every slot checked here (CUDA: in the kernel) */
    for (int64_t b = 0; b < a->B; b++)
      if (a->kv_slot[b] < 0 || a->kv_slot[b] >= a->kv_batch)
        return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->kv_slot[%lld] = %lld is outside [0, kv_batch = %lld)",
                            c->op, (long long)b, (long long)a->kv_slot[b], (long long)a->kv_batch);
  int64_t qreach, oreach, kreach, kv_rows; /* the elements the kernel's indexing reaches, in int64 */
  if (!tp_mul_count(rows, a->q_ld, &qreach) || !tp_mul_count(rows, a->o_ld, &oreach) ||
      !tp_mul_count(krows, a->kv_ld, &kv_rows) ||
      !tp_mul_count(nkv > 1 ? nkv - 1 : 0, nkv > 1 ? a->kv_bstride : 0, &kreach) ||
      !tp_add_count(kreach, kv_rows, &kreach))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args' leading dimensions reach past 2^63 elements (B x Tq x "
                        "q_ld, B x Tq x o_ld, or (B or kv_batch - 1) x kv_bstride + rows x kv_ld)",
                        c->op);
  if (rows && qw && (!a->q || !a->o))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->q or args->o is NULL", c->op);
  if (a->B && a->Tk && kw && (!a->k || !a->v))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: args->k or args->v is NULL", c->op);
  TP_CHECK(check_families(c, a, backward));
  if (backward && !a->probs && !a->lse)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: args->probs and args->lse are NULL (forward must keep the "
                        "probabilities or the log-sum-exp)",
                        c->op);
  return TP_SUCCESS;
}

tp_status_t tp_attention_workspace_size(const tp_attention_args *a, int backward, size_t *nbytes) {
  tp_kcall c = {"attention_workspace_size", TP_DEVICE_CPU, 0, 0};
  if (!nbytes) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: nbytes is NULL", c.op);
  *nbytes = 0;
  TP_CHECK(check_args(&c, a, 0));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, NULL, &k));
  *nbytes = k->attention_workspace(a, backward != 0);
  return TP_SUCCESS;
}

tp_status_t tp_attention_forward(tp_stream_t s, const tp_attention_args *a, const tp_tensor *workspace) {
  tp_kcall c = {"attention_forward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(check_args(&c, a, 0));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  void *ws;
  size_t wsb;
  TP_CHECK(tp_kworkspace(&c, workspace, 0, &ws, &wsb)); /* the kernel checks it holds a block */
  return k->attention_forward(s, a, ws, wsb);
}

tp_status_t tp_attention_backward(tp_stream_t s, const tp_attention_args *a, float *dq, float *dk, float *dv,
                                  const float *dout, const tp_tensor *workspace) {
  tp_kcall c = {"attention_backward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(check_args(&c, a, 1));
  if (a->B && ((a->Tq && a->Hq && a->D && (!dq || !dout)) || (a->Tk && a->D && (!dk || !dv))))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: dq, dk, dv or dout is NULL", c.op);
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  void *ws;
  size_t wsb;
  TP_CHECK(tp_kworkspace(&c, workspace, 0, &ws, &wsb));
  return k->attention_backward(s, a, dq, dk, dv, dout, ws, wsb);
}

/* -------------------------------------------------------------- optimizers */

/* p: float32, contiguous, any shape; the others: p's shape. */
static tp_status_t like_p(tp_kcall *c, const tp_tensor *p) {
  if (!p) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: p is NULL", c->op);
  int64_t any[TP_MAX_DIMS];
  for (int i = 0; i < TP_MAX_DIMS; i++) any[i] = TP_ANY;
  if (p->ndim < 0 || p->ndim > TP_MAX_DIMS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: p has %d dimensions", c->op, p->ndim);
  return tp_karg(c, "p", p, 0, TP_FLOAT32, p->ndim, any);
}

tp_status_t tp_adamw_step(tp_stream_t s, const tp_tensor *p, const tp_tensor *g, const tp_tensor *m, const tp_tensor *v,
                          float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  tp_kcall c = {"adamw_step", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(like_p(&c, p));
  TP_CHECK(tp_karg(&c, "g", g, 0, TP_FLOAT32, p->ndim, p->shape));
  TP_CHECK(tp_karg(&c, "m", m, 0, TP_FLOAT32, p->ndim, p->shape));
  TP_CHECK(tp_karg(&c, "v", v, 0, TP_FLOAT32, p->ndim, p->shape));
  if (step < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "adamw_step: step counts from 1, got %lld", (long long)step);
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->adamw_step(s, p->data, g->data, m->data, v->data, tp_tensor_numel(p), lr, beta1, beta2, eps, weight_decay,
                       step);
}

tp_status_t tp_sgd_step(tp_stream_t s, const tp_tensor *p, const tp_tensor *g, const tp_tensor *buf, float lr,
                        float momentum, float weight_decay, int first) {
  tp_kcall c = {"sgd_step", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(like_p(&c, p));
  TP_CHECK(tp_karg(&c, "g", g, 0, TP_FLOAT32, p->ndim, p->shape));
  TP_CHECK(tp_karg(&c, "buf", buf, 1, TP_FLOAT32, p->ndim, p->shape));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->sgd_step(s, p->data, g->data, buf ? buf->data : NULL, tp_tensor_numel(p), lr, momentum, weight_decay,
                     first);
}
