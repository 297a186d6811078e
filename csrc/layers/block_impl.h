/* Private side of the Transformer block: its handle, shared by block.c (create, params,
 * forward/backward with norms, residuals and the MLP) and attention.c (QKV, RoPE, the
 * KV cache, attention and the row-parallel output projection). */
#ifndef TPCORE_BLOCK_IMPL_H
#define TPCORE_BLOCK_IMPL_H

#include "layer_kernels.h"

struct tp_block {
  tp_comm_t comm;
  tp_block_config_t cfg;
  int rank, world;
  tp_device_t dev;
  int dev_id;
  tp_lk lk;                                         /* the device's kernels */
  int64_t C, D, H, Hk, group, q0, nq, k0, nk, W, A; /* W: qkv shard width, A: attention output width */
  int kv_replicated;
  int64_t *out_part; /* [world] attention output columns per rank (nq x D; in the handle) */
  /* parameters: one allocation (the output projection and the MLP own theirs); their
   * gradients another, made on demand (tp_block_alloc_grads, the first backward) */
  tp_arena_t params, grads;
  tp_lk_w Wqkv;    /* the QKV shard in cfg.weight_dtype (Wqkv.lpws = &lpws) */
  tp_arena_t lpws; /* the low-precision GEMMs' workspace (and init scratch) */
  float *bqkv, *dwqkv, *dbqkv;
  float *n1w, *n1b, *dn1w, *dn1b, *n2w, *n2b, *dn2w, *dn2b;
  /* the families' parameters (NULL when off): per-head Q/K norms [D], post norms [C] */
  float *qnw, *knw, *dqnw, *dknw, *n3w, *n3b, *dn3w, *dn3b, *n4w, *n4b, *dn4w, *dn4b;
  int qkv_bias, out_bias, mlp_bias; /* the projections that have a bias */
  float *rope_freq;                 /* device [D / 2] (in ropet), or NULL: rope_theta's */
  float rope_factor;
  tp_arena_t ropet;
  float *qkin, *qkout, *qkrstd, *qknsnap;              /* qk_norm: Q|K heads before the norm [M (nq+nk) D], the norm's
                                             output, its rstd [M (nq+nk)], the weights' gradient snapshot */
  float *ra, *pa, *pm, *mean3, *rstd3, *mean4, *rstd4; /* post norms: attention output, the norms' outputs */
  tp_parallel_linear_t out; /* attention output projection: row parallel, input_is_parallel */
  tp_parallel_mlp_t mlp;
  /* workspaces of the last forward, carved from one arena: its own, or (a forward without
   * need_backward) the shared workspace when it has one */
  tp_arena_t ws;
  tp_workspace_t shared;
  float *mh, *ma; /* an inference forward's MLP activations (h, a), carved with the rest */
  float *xs, *s1, *h1, *s2, *n1, *n2, *qkv, *ao, *mo;
  float *mean1, *rstd1, *mean2, *rstd2;
  float *probs; /* what attention backward needs: probs, or lse (attention.c) */
  float *dqkv, *dao, *dn, *dh, *dt, *kvsnap;
  void *attn_ws; /* the attention kernels' scratch */
  size_t attn_ws_bytes;
  int64_t *pos, *pos0, *klen; /* device: positions of the rows, first position and keys per sequence */
  int64_t *slot;              /* device: the cache sequence of each batch row (have_slots) */
  uint8_t *mask;              /* device: the key mask of the last forward */
  reg_buf red, kvred, qkred;
  /* the last forward: rows, shape, whether backward may follow */
  int64_t B, T;
  int have_mask, have_slots, ready;
  /* KV cache [cb, clen, nk * D] each, one allocation */
  tp_arena_t cache;
  float *kc, *vc;
  int64_t cb, clen; /* sequences and the logical max_len */
  int64_t crows;    /* K/V rows per sequence: clen, or the ring of a sliding window (position p at row p % crows) */
  int64_t *kv_end;  /* host [cb]: per cache sequence (paged: per block), the highest row written + 1 */
  /* a paged cache (tp_block_cache_paged): cb blocks of crows = clen rows; the last forward's
   * block table [B, bcols] on the device (have_table) */
  int paged, have_table;
  int64_t *btab, bcols;
};

struct tp_workspace {
  tp_arena_t arena;
  reg_buf out;    /* the inference forwards' collective output buffer (on comm) */
  tp_comm_t comm; /* the communicator of the first block that used `out` (NULL: none yet) */
  int refs;       /* atomic */
};

/* block_paged.c: a forward's block table against the paged cache (use_cache; bt->block_table
 * iff the cache is paged), and the blocks' high-water marks after it. */
tp_status_t tp_block_check_paged(tp_block_t k, const tp_block_batch_t *bt);
void tp_block_paged_written(tp_block_t k, const tp_block_batch_t *bt);
/* block.c: drop the KV cache (both kinds) */
void tp_block_cache_release(tp_block_t k);

/* attention.c */
tp_status_t tp_block_check_batch(tp_block_t k, const tp_block_batch_t *bt);
/* The attention kernels' scratch for a batch (forward, and backward when need_backward). */
/* Floats forward keeps for attention backward: B x nq x T (lse, tables with attention_keeps_lse) or
 * B x nq x T x T (probabilities). */
int64_t tp_block_attention_kept(tp_block_t k, int64_t B, int64_t T);
size_t tp_block_attention_workspace(tp_block_t k, int64_t B, int64_t T, int use_cache, int need_backward);
/* attention on this rank's heads of in[M, C]; the all-reduced projection + bias is left in
 * *r (the output projection's collective buffer, valid until its next call). */
tp_status_t tp_block_attention_forward(tp_block_t k, float **r, const float *in, int use_cache, int keep,
                                       tp_stream_t stream);
/* dr[M, C] (the gradient at the attention's all-reduced output) -> din[M, C] (at its input,
 * all-reduced); accumulates the gradients. */
tp_status_t tp_block_attention_backward(tp_block_t k, float *din, const float *dr, const float *in, tp_stream_t stream);

/* linear.c: the row-parallel (input_is_parallel) forward of the output projection that
 * leaves y = all-reduce(x W_r^T) + b in the layer's collective buffer (*y): the GEMM
 * writes there, the all-reduce runs in place, the bias is added in place after it. */
tp_status_t tp_parallel_linear_forward_inbuf(tp_parallel_linear_t L, float **y, const float *x, int64_t M, int flags,
                                             tp_stream_t stream);
/* linear.c: create with the seeded-init tensor ids of the weight and the bias (the block's
 * output projection keeps its own ids, 12 and 13, so its numbers stay those of before). */
tp_status_t tp_parallel_linear_create_ids(tp_parallel_linear_t *out, tp_comm_t comm, const tp_linear_config_t *cfg,
                                          uint64_t weight_id, uint64_t bias_id);

#endif
