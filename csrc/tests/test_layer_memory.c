/*
 * C test of the layers' memory accounting (tp_*_memory), world sizes 1-3: every count
 * against a size computed here from the config and the shard each rank holds (info / params),
 * before and after forwards of more and fewer rows, a backward, a KV cache and decode steps;
 * float32, bfloat16 and q8_0 weights; a NULL or wrong-version tp_layer_memory_t refused.
 * Arenas round every slice up to TP_DEVICE_ALIGN bytes (an empty one takes one unit); a
 * collective buffer holds 4096 bytes, or 1.5 x what it was asked for when that is more.
 * Runs with one kernel thread, so that the kernels' scratch sizes are those of one chunk.
 * Prints "N passed, N failed".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tpcore/layers.h"

#define F2(p, r, c) ((tp_tensor[]){tp_tensor_2d((void *)(p), TP_FLOAT32, (r), (c))})
#define F1(p, n) ((tp_tensor[]){tp_tensor_1d((void *)(p), TP_FLOAT32, (n))})
#define I1(p, n) ((tp_tensor[]){tp_tensor_1d((void *)(p), TP_INT64, (n))})

static int bad;
#define EXPECT(what, got, want)                                                                                     \
  do {                                                                                                              \
    size_t g_ = (got), w_ = (want);                                                                                 \
    if (g_ != w_) {                                                                                                 \
      fprintf(stderr, "%s:%d rank %d/%d: %s: got %zu, expected %zu\n", __FILE__, __LINE__, rank_, world_, what, g_, \
              w_);                                                                                                  \
      bad = 1;                                                                                                      \
    }                                                                                                               \
  } while (0)
static int rank_, world_;

/* a slice of n bytes in an arena; n elements of e bytes */
static size_t al(size_t n) { return ((n ? n : 1) + TP_DEVICE_ALIGN - 1) / TP_DEVICE_ALIGN * TP_DEVICE_ALIGN; }
static size_t aln(int64_t n, size_t e) { return al((size_t)n * e); }
/* a collective buffer asked for n bytes */
static size_t reg(size_t n) { return n > 4096 ? n + n / 2 : 4096; }

static tp_layer_memory_t mem_of(int kind, void *layer) {
  tp_layer_memory_t m;
  memset(&m, 0xab, sizeof m); /* every field must be written */
  m.size = sizeof m;
  tp_status_t st = kind == 0   ? tp_parallel_linear_memory(layer, &m)
                   : kind == 1 ? tp_parallel_mlp_memory(layer, &m)
                   : kind == 2 ? tp_vocab_embedding_memory(layer, &m)
                   : kind == 3 ? tp_vocab_xent_memory(layer, &m)
                               : tp_block_memory(layer, &m);
  if (st != TP_SUCCESS) {
    fprintf(stderr, "memory (kind %d): %s\n", kind, tp_last_error());
    bad = 1;
  }
  if (m.device != TP_DEVICE_CPU || m.device_id != 0) {
    fprintf(stderr, "memory (kind %d): device %d:%d, not the CPU\n", kind, (int)m.device, m.device_id);
    bad = 1;
  }
  return m;
}

static void fill(float *p, int64_t n, double s) {
  for (int64_t i = 0; i < n; i++) p[i] = (float)sin(s + 0.37 * (double)i);
}

/* A linear layer: params, grads (those that exist), the saved input and dy columns, the
 * collective buffers, across forwards of 5, 3 and 9 rows and a backward. */
static void check_linear(tp_comm_t comm, tp_parallel_kind_t kind, tp_dtype_t dt, int bias) {
  enum { K = 64, N = 10 };
  tp_linear_config_t c = TP_LINEAR_CONFIG_INITIALIZER;
  c.kind = kind, c.in_features = K, c.out_features = N, c.bias = bias, c.weight_dtype = dt, c.seed = 3;
  c.gather_output = kind == TP_COLUMN_PARALLEL, c.input_is_parallel = 0;
  int64_t part[3] = {K, 0, 0};
  if (kind == TP_ROW_PARALLEL && world_ == 2) part[0] = 32, part[1] = 32;
  if (kind == TP_ROW_PARALLEL && world_ == 3) part[0] = 32, part[1] = 0, part[2] = 32;
  if (kind == TP_ROW_PARALLEL) c.partition = part;
  tp_parallel_linear_t L;
  if (tp_parallel_linear_create(&L, comm, &c) != TP_SUCCESS) {
    fprintf(stderr, "linear: %s\n", tp_last_error());
    bad = 1;
    return;
  }
  tp_linear_info_t i;
  tp_parallel_linear_info(L, &i);
  size_t rb;
  tp_weight_row_bytes(dt, i.weight_cols, &rb);
  size_t params = al((size_t)i.weight_rows * rb) + (bias ? aln(i.bias_len, 4) : 0);
  tp_layer_memory_t m = mem_of(0, L);
  EXPECT("linear params", m.params, params);
  size_t grads = (i.grad_weight ? aln(i.weight_rows * i.weight_cols, 4) : 0) + (i.grad_bias ? aln(i.bias_len, 4) : 0);
  EXPECT("linear grads before backward", m.grads, grads);
  EXPECT("linear workspace before forward", m.workspace, 0);
  EXPECT("linear comm before forward", m.comm, 0);
  EXPECT("linear cache", m.cache + m.cache_used, 0);
  int col = kind == TP_COLUMN_PARALLEL;
  int64_t xs = col ? K : i.local; /* saved input columns */
  size_t out_reg = 0, grad_reg = 0, ws = 0;
  float x[9 * K], y[9 * N], dy[9 * N], dx[9 * K];
  int64_t rows[3] = {5, 3, 9};
  for (int s = 0; s < 3; s++) {
    int64_t M = rows[s];
    fill(x, M * K, s), fill(dy, M * N, s + 1);
    if (tp_parallel_linear_forward(L, F2(y, M, N), F2(x, M, K), NULL) != TP_SUCCESS ||
        tp_parallel_linear_backward(L, F2(dx, M, K), F2(dy, M, N), NULL) != TP_SUCCESS) {
      fprintf(stderr, "linear step: %s\n", tp_last_error());
      bad = 1;
      break;
    }
    size_t need = aln(M * xs, 4) + aln(col && world_ > 1 ? M * i.local : 0, 4);
    if (need > ws) ws = need; /* grows only for a larger batch */
    if (world_ > 1) {
      size_t o = (size_t)(M * N) * 4, g = (size_t)(M * K) * 4; /* row: gathered dx; column: dx partials */
      if (o > out_reg) out_reg = reg(o);
      if (g > grad_reg) grad_reg = reg(g);
    }
    m = mem_of(0, L);
    EXPECT("linear params after a step", m.params, params);
    tp_parallel_linear_info(L, &i);
    EXPECT("linear grads after backward", m.grads,
           aln(i.weight_rows * i.weight_cols, 4) * !tp_weight_is_quantized(dt) + (bias ? aln(i.bias_len, 4) : 0));
    if ((i.grad_weight != NULL) == tp_weight_is_quantized(dt)) {
      fprintf(stderr, "linear: a weight gradient %s\n", i.grad_weight ? "of a quantized weight" : "missing");
      bad = 1;
    }
    EXPECT("linear workspace", m.workspace, ws);
    EXPECT("linear comm", m.comm, out_reg + grad_reg);
  }
  tp_parallel_linear_destroy(L);
}

/* The MLP: fc1 + fc2 + its own activation arena (h, a, da, dh and the bias + activation
 * backward's scratch when fc1 has a bias gradient). */
static void check_mlp(tp_comm_t comm, tp_activation_t act) {
  enum { C = 12, FF = 23 };
  tp_mlp_config_t c = TP_MLP_CONFIG_INITIALIZER;
  c.hidden = C, c.ffn_hidden = FF, c.activation = act, c.seed = 5;
  tp_parallel_mlp_t mlp;
  if (tp_parallel_mlp_create(&mlp, comm, &c) != TP_SUCCESS) {
    fprintf(stderr, "mlp: %s\n", tp_last_error());
    bad = 1;
    return;
  }
  tp_linear_info_t i1, i2;
  tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 0), &i1);
  tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 1), &i2);
  size_t params = aln(i1.weight_rows * i1.weight_cols, 4) + aln(i1.bias_len, 4) +
                  aln(i2.weight_rows * i2.weight_cols, 4) + aln(i2.bias_len, 4);
  tp_layer_memory_t m = mem_of(1, mlp);
  EXPECT("mlp params", m.params, params);
  EXPECT("mlp workspace before forward", m.workspace, 0);
  float x[7 * C], y[7 * C], dx[7 * C];
  int64_t rows[3] = {7, 2, 7};
  size_t ws = 0, reg2 = 0, reg1 = 0;
  for (int s = 0; s < 3; s++) {
    int64_t M = rows[s], f1 = i1.y_cols, f = i2.x_cols;
    int had_db = i1.bias != NULL; /* the scratch is planned at forward, for a bias (its gradient may come later) */
    fill(x, M * C, s + 0.5);
    if (tp_parallel_mlp_forward(mlp, F2(y, M, C), F2(x, M, C), NULL) != TP_SUCCESS ||
        tp_parallel_mlp_backward(mlp, F2(dx, M, C), F2(y, M, C), NULL) != TP_SUCCESS) {
      fprintf(stderr, "mlp step: %s\n", tp_last_error());
      bad = 1;
      break;
    }
    size_t bws = 0;
    if (had_db) tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, f, act, &bws);
    /* own arena; fc1 saves x (M x C), fc2 borrows a (nothing saved: one empty slice of each) */
    size_t need = 2 * aln(M * f1, 4) + 2 * aln(M * f, 4) + al(bws) + aln(M * C, 4) + al(0) + 2 * al(0);
    if (need > ws) ws = need;
    if (world_ > 1) {
      if ((size_t)(M * C) * 4 > reg2) reg2 = reg((size_t)(M * C) * 4), reg1 = reg2; /* fc2's sum, fc1's dx */
    }
    tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 0), &i1);
    tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 1), &i2);
    m = mem_of(1, mlp);
    EXPECT("mlp params after a step", m.params, params);
    EXPECT("mlp grads", m.grads, params); /* float32: a gradient per parameter, same shapes */
    EXPECT("mlp workspace", m.workspace, ws);
    EXPECT("mlp comm", m.comm, reg1 + reg2);
  }
  tp_parallel_mlp_destroy(mlp);
}

/* The embedding (float32 and bfloat16 tables) and the cross-entropy. */
static void check_vocab(tp_comm_t comm, tp_dtype_t dt) {
  enum { V = 13, DIM = 6 };
  tp_embedding_config_t c = TP_EMBEDDING_CONFIG_INITIALIZER;
  c.num_embeddings = V, c.embedding_dim = DIM, c.weight_dtype = dt;
  tp_vocab_embedding_t E;
  tp_vocab_xent_t X;
  if (tp_vocab_embedding_create(&E, comm, &c) != TP_SUCCESS || tp_vocab_xent_create(&X, comm, NULL) != TP_SUCCESS) {
    fprintf(stderr, "vocab: %s\n", tp_last_error());
    bad = 1;
    return;
  }
  tp_embedding_info_t i;
  tp_vocab_embedding_info(E, &i);
  tp_layer_memory_t m = mem_of(2, E);
  EXPECT("embedding params", m.params, aln(i.local * DIM, tp_dtype_size(dt)));
  EXPECT("embedding grads", m.grads, i.grad_weight ? aln(i.local * DIM, 4) : 0);
  EXPECT("embedding workspace before forward", m.workspace, 0);
  m = mem_of(3, X);
  EXPECT("cross-entropy before forward", m.params + m.grads + m.workspace + m.comm + m.cache, 0);
  int64_t tok[8] = {0, 12, 5, 5, 7, 1, 3, 2};
  float y[8 * DIM], logits[8 * V], loss[8], dl[8 * V];
  size_t ews = 0, xws = 0, ereg = 0, xreg = 0;
  int64_t rows[3] = {6, 8, 4};
  for (int s = 0; s < 3; s++) {
    int64_t M = rows[s];
    if (tp_vocab_embedding_forward(E, F2(y, M, DIM), I1(tok, M), NULL) != TP_SUCCESS ||
        tp_vocab_embedding_backward(E, F2(y, M, DIM), NULL) != TP_SUCCESS) {
      fprintf(stderr, "embedding step: %s\n", tp_last_error());
      bad = 1;
      break;
    }
    /* the logits shard of this rank: its vocabulary rows */
    fill(logits, M * i.local, s);
    if (tp_vocab_xent_forward(X, F1(loss, M), F2(logits, M, i.local), I1(tok, M), -1, -100, NULL, NULL, NULL) !=
            TP_SUCCESS ||
        tp_vocab_xent_backward(X, F2(dl, M, i.local), NULL, 1.0f, NULL) != TP_SUCCESS) {
      fprintf(stderr, "cross-entropy step: %s\n", tp_last_error());
      bad = 1;
      break;
    }
    size_t e = aln(M, 8) + aln(2, 8), x = 3 * aln(M, 4) + aln(2 * M, 4) + aln(M, 8) + aln(3, 8);
    if (e > ews) ews = e;
    if (x > xws) xws = x;
    if (world_ > 1) {
      size_t eb = (size_t)(M * DIM) * 4, xb = (size_t)(3 * M + 2 * world_ + 2) * 4;
      if (eb > ereg) ereg = reg(eb);
      if (xb > xreg) xreg = reg(xb);
    }
    m = mem_of(2, E);
    tp_vocab_embedding_info(E, &i);
    EXPECT("embedding params after a step", m.params, aln(i.local * DIM, tp_dtype_size(dt)));
    EXPECT("embedding grads after backward", m.grads, aln(i.local * DIM, 4));
    EXPECT("embedding workspace", m.workspace, ews);
    EXPECT("embedding comm", m.comm, ereg);
    m = mem_of(3, X);
    EXPECT("cross-entropy params", m.params + m.grads + m.cache, 0);
    EXPECT("cross-entropy workspace", m.workspace, xws);
    EXPECT("cross-entropy comm", m.comm, xreg);
  }
  tp_vocab_embedding_destroy(E);
  tp_vocab_xent_destroy(X);
}

/* The attention kernels' scratch for a block forward (and backward): the kernel table's
 * own size query with this rank's heads. */
static size_t attn_scratch(int64_t B, int64_t T, int64_t Tk, const tp_block_info_t *bi, int64_t D, int64_t group,
                           int need_backward) {
  int64_t nq = bi->nq, nk = bi->nk;
  if (!nq || !B || !T) return 0;
  static float dummy[1];
  tp_attention_args a;
  memset(&a, 0, sizeof a);
  a.B = B, a.Tq = T, a.Tk = Tk, a.Hq = nq, a.Hk = nk, a.D = D;
  a.q = a.k = a.v = a.o = dummy;
  a.q_ld = a.o_ld = (nq + 2 * nk) * D, a.kv_ld = (nq + 2 * nk) * D, a.kv_bstride = Tk * a.kv_ld;
  a.group = group, a.q_head0 = bi->q0, a.k_head0 = bi->k0, a.causal = 1, a.scale = 1;
  if (need_backward) a.probs = dummy;
  size_t f = 0, b = 0;
  if (tp_attention_workspace_size(&a, 0, &f) != TP_SUCCESS ||
      (need_backward && tp_attention_workspace_size(&a, 1, &b) != TP_SUCCESS)) {
    fprintf(stderr, "attention workspace size: %s\n", tp_last_error());
    bad = 1;
  }
  return f > b ? f : b;
}

/* The block's own arena for a forward of B x T rows (block.c's workspaces()). */
static size_t block_ws(int64_t B, int64_t T, int64_t Tk, int64_t C, const tp_block_info_t *bi, int64_t D, int64_t group,
                       int nb) {
  int64_t M = B * T, nq = bi->nq, nk = bi->nk, W = (nq + 2 * nk) * D, A = nq * D;
  size_t s = 10 * aln(M * C, 4) + 2 * aln(M * W, 4) + 2 * aln(M * A, 4) + 4 * aln(M, 4);
  s += aln(nb ? B * nq * T * T : 0, 4);                            /* kept probabilities */
  s += aln(nb && bi->kv_replicated ? 2 * nk * D * (C + 1) : 0, 4); /* replicated KV heads' snapshot */
  s += aln(M, 8) + 3 * aln(B, 8) + aln(M, 1) + al(attn_scratch(B, T, Tk, bi, D, group, nb));
  s += 2 * al(0);  /* an inference forward's MLP activations: empty slices in a training forward */
  s += 11 * al(0); /* the families' buffers (Q/K norms, post norms): off here, empty slices */
  return s;
}

/* A block (float32, or bfloat16 projections with grouped-query heads): params and grads
 * from its parameter list, the workspace after a training forward, the KV cache and its
 * use after a prefill and decode steps (with slots), cleared by a new cache. */
static void check_block(tp_comm_t comm, tp_dtype_t dt) {
  enum { C = 16, Hq = 6, D = 4, FF = 20 };
  tp_block_config_t c = TP_BLOCK_CONFIG_INITIALIZER;
  c.hidden = C, c.heads = Hq, c.kv_heads = dt == TP_FLOAT32 ? Hq : 3, c.head_dim = D, c.ffn_hidden = FF;
  c.weight_dtype = dt, c.seed = 9, c.rope_theta = dt == TP_FLOAT32 ? 0.0f : 10000.0f;
  c.norm = dt == TP_FLOAT32 ? TP_NORM_LAYER : TP_NORM_RMS, c.bias = dt == TP_FLOAT32;
  c.activation = dt == TP_FLOAT32 ? TP_ACT_GELU : TP_ACT_SWIGLU;
  tp_block_t k;
  if (tp_block_create(&k, comm, &c) != TP_SUCCESS) {
    fprintf(stderr, "block: %s\n", tp_last_error());
    bad = 1;
    return;
  }
  tp_block_info_t bi;
  tp_block_info(k, &bi);
  tp_param_t ps[16];
  int np = tp_block_params(k, ps, 16);
  size_t params = 0, grads = 0;
  for (int p = 0; p < np; p++) {
    size_t rb = 0;
    int64_t cols = ps[p].ndim == 2 ? ps[p].cols : 1;
    tp_weight_row_bytes(ps[p].dtype, cols, &rb);
    params += al((size_t)ps[p].rows * rb);
    if (ps[p].grad) grads += aln(ps[p].rows * cols, 4);
  }
  tp_layer_memory_t m = mem_of(4, k);
  EXPECT("block params", m.params, params);
  EXPECT("block grads", m.grads, grads);
  EXPECT("block workspace before forward", m.workspace, 0);
  EXPECT("block cache before cache()", m.cache + m.cache_used, 0);
  EXPECT("block comm before forward", m.comm, 0);
  enum { B = 2, T = 5 };
  float x[B * T * C], y[B * T * C], dx[B * T * C];
  fill(x, B * T * C, 0.2);
  tp_block_batch_t bt = TP_BLOCK_BATCH_INITIALIZER;
  bt.B = B, bt.T = T, bt.need_backward = 1;
  if (tp_block_forward(k, F2(y, B * T, C), F2(x, B * T, C), &bt, NULL) != TP_SUCCESS ||
      tp_block_backward(k, F2(dx, B * T, C), F2(y, B * T, C), NULL) != TP_SUCCESS) {
    fprintf(stderr, "block step: %s\n", tp_last_error());
    bad = 1;
    tp_block_destroy(k);
    return;
  }
  m = mem_of(4, k);
  EXPECT("block params after a step", m.params, params);
  np = tp_block_params(k, ps, 16);
  grads = 0;
  for (int p = 0; p < np; p++)
    if (ps[p].dtype == TP_FLOAT32 || ps[p].dtype == TP_BFLOAT16)
      grads += aln(ps[p].rows * (ps[p].ndim == 2 ? ps[p].cols : 1), 4);
  EXPECT("block grads after backward", m.grads, grads);
  /* block arena + the output projection's (borrowed input: one empty slice each) + the MLP's */
  int64_t M = B * T, f1 = 0, f = 0;
  for (int p = 0; p < np; p++)
    if (!strcmp(ps[p].name, "mlp.fc1.weight")) f1 = ps[p].rows;
    else if (!strcmp(ps[p].name, "mlp.fc2.weight")) f = ps[p].cols;
  size_t bws = 0;
  tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, f, c.activation, &bws);
  size_t mlp_ws =
      2 * aln(M * f1, 4) + 2 * aln(M * f, 4) + (c.bias ? al(bws) : al(0)) + aln(M * C, 4) + al(0) + 2 * al(0);
  size_t ws = block_ws(B, T, T, C, &bi, D, Hq / c.kv_heads, 1) + 2 * al(0) + mlp_ws;
  EXPECT("block workspace after a training forward", m.workspace, ws);
  size_t comm_b = reg((size_t)(M * C) * 4);               /* the block's QKV dx sum */
  if (world_ > 1) comm_b += reg((size_t)(M * C) * 4) * 3; /* out projection's sum, fc2's sum, fc1's dx */
  else comm_b += reg((size_t)(M * C) * 4);                /* out projection's in-buffer sum (any world) */
  if (bi.kv_replicated) comm_b += reg((size_t)(2 * c.kv_heads * D * (C + 1)) * 4); /* their gradient sum */
  EXPECT("block comm", m.comm, comm_b);
  /* the KV cache: K and V [batch, max_len, local KV heads x D] */
  enum { CB = 3, CL = 11 };
  if (tp_block_cache(k, CB, CL) != TP_SUCCESS) {
    fprintf(stderr, "block cache: %s\n", tp_last_error());
    bad = 1;
  }
  size_t row = (size_t)(bi.nk * D) * 4; /* bytes of one token's K (or V) on this rank */
  m = mem_of(4, k);
  EXPECT("kv cache", m.cache, 2 * al(CB * CL * row));
  EXPECT("kv cache used after cache()", m.cache_used, 0);
  /* prefill: sequences 2 and 0 (slots), 4 tokens each */
  int64_t slots[2] = {2, 0}, pos0[2] = {0, 0};
  bt = (tp_block_batch_t)TP_BLOCK_BATCH_INITIALIZER;
  bt.B = 2, bt.T = 4, bt.use_cache = 1, bt.slots = slots, bt.pos0 = pos0;
  if (tp_block_forward(k, F2(y, 8, C), F2(x, 8, C), &bt, NULL) != TP_SUCCESS) {
    fprintf(stderr, "block prefill: %s\n", tp_last_error());
    bad = 1;
  }
  m = mem_of(4, k);
  EXPECT("kv cache used after a prefill", m.cache_used, 2 * 2 * 4 * row);
  EXPECT("kv cache after a prefill", m.cache, 2 * al(CB * CL * row));
  /* three decode steps of sequence 2 only, then one of sequences 1 (at 0) and 0 (at 4) */
  for (int s = 0; s < 3; s++) {
    int64_t sl[1] = {2}, p0[1] = {4 + s};
    bt.B = 1, bt.T = 1, bt.slots = sl, bt.pos0 = p0;
    if (tp_block_forward(k, F2(y, 1, C), F2(x, 1, C), &bt, NULL) != TP_SUCCESS) bad = 1;
  }
  m = mem_of(4, k);
  EXPECT("kv cache used after decode steps", m.cache_used, 2 * (7 + 4) * row);
  int64_t sl2[2] = {1, 0}, p2[2] = {0, 4};
  bt.B = 2, bt.T = 1, bt.slots = sl2, bt.pos0 = p2;
  if (tp_block_forward(k, F2(y, 2, C), F2(x, 2, C), &bt, NULL) != TP_SUCCESS) bad = 1;
  m = mem_of(4, k);
  EXPECT("kv cache used, three sequences", m.cache_used, 2 * (7 + 5 + 1) * row);
  /* rewriting positions already written does not count twice */
  int64_t p3[2] = {0, 0};
  bt.pos0 = p3;
  if (tp_block_forward(k, F2(y, 2, C), F2(x, 2, C), &bt, NULL) != TP_SUCCESS) bad = 1;
  m = mem_of(4, k);
  EXPECT("kv cache used after a rewrite", m.cache_used, 2 * (7 + 5 + 1) * row);
  /* decode workspace: the arena keeps its largest size (the training forward's) */
  EXPECT("block workspace after decode", m.workspace, ws);
  if (tp_block_cache(k, 2, 5) != TP_SUCCESS) bad = 1;
  m = mem_of(4, k);
  EXPECT("kv cache after a new cache()", m.cache, 2 * al(2 * 5 * row));
  EXPECT("kv cache used after a new cache()", m.cache_used, 0);
  tp_block_destroy(k);
}

/* NULL layers and a wrong size are refused with a message naming the call. */
static void check_refusals(tp_comm_t comm) {
  tp_linear_config_t c = TP_LINEAR_CONFIG_INITIALIZER;
  c.in_features = 4, c.out_features = 4;
  tp_parallel_linear_t L;
  if (tp_parallel_linear_create(&L, comm, &c) != TP_SUCCESS) {
    bad = 1;
    return;
  }
  tp_layer_memory_t m;
  memset(&m, 0, sizeof m);
  m.size = sizeof m - 8;
  if (tp_parallel_linear_memory(L, &m) != TP_ERR_INVALID_ARGUMENT || !strstr(tp_last_error(), "linear memory") ||
      !strstr(tp_last_error(), "size")) {
    fprintf(stderr, "a wrong size was not refused (%s)\n", tp_last_error());
    bad = 1;
  }
  if (tp_parallel_linear_memory(L, NULL) != TP_ERR_INVALID_ARGUMENT || !strstr(tp_last_error(), "mem")) bad = 1;
  m.size = sizeof m;
  if (tp_parallel_linear_memory(NULL, &m) != TP_ERR_INVALID_ARGUMENT ||
      tp_parallel_mlp_memory(NULL, &m) != TP_ERR_INVALID_ARGUMENT ||
      tp_vocab_embedding_memory(NULL, &m) != TP_ERR_INVALID_ARGUMENT ||
      tp_vocab_xent_memory(NULL, &m) != TP_ERR_INVALID_ARGUMENT ||
      tp_block_memory(NULL, &m) != TP_ERR_INVALID_ARGUMENT) {
    fprintf(stderr, "a NULL layer was not refused (%s)\n", tp_last_error());
    bad = 1;
  }
  tp_parallel_linear_destroy(L);
}

static int run(int n, int r, const char *job) {
  rank_ = r, world_ = n;
  tp_set_num_threads(1);
  tp_comm_config_t cc = TP_COMM_CONFIG_INITIALIZER;
  cc.job_id = job;
  cc.timeout_s = 30;
  tp_comm_t comm;
  if (tp_comm_init_rank(&comm, n, r, &cc) != TP_SUCCESS) return fprintf(stderr, "init: %s\n", tp_last_error()), 1;
  check_linear(comm, TP_COLUMN_PARALLEL, TP_FLOAT32, 1);
  check_linear(comm, TP_ROW_PARALLEL, TP_FLOAT32, 1);
  check_linear(comm, TP_COLUMN_PARALLEL, TP_BFLOAT16, 0);
  check_linear(comm, TP_ROW_PARALLEL, TP_Q8_0, 0);
  check_mlp(comm, TP_ACT_GELU);
  check_mlp(comm, TP_ACT_SWIGLU);
  check_vocab(comm, TP_FLOAT32);
  check_vocab(comm, TP_BFLOAT16);
  check_block(comm, TP_FLOAT32);
  check_block(comm, TP_BFLOAT16);
  check_refusals(comm);
  tp_comm_destroy(comm);
  return bad;
}

static int run_world(int n, const char *name) {
  char job[64];
  snprintf(job, sizeof job, "cmem%d_%s_%d", (int)getpid(), name, n);
  pid_t pids[3];
  for (int r = 0; r < n; r++)
    if ((pids[r] = fork()) == 0) {
      alarm(60);
      _exit(run(n, r, job));
    }
  int ok = 1;
  for (int r = 0; r < n; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    ok &= WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  printf("%s world %d: %s\n", name, n, ok ? "ok" : "FAILED");
  return ok;
}

int main(void) {
  int passed = 0, failed = 0;
  for (int n = 1; n <= 3; n++) run_world(n, "memory") ? passed++ : failed++;
  /* plain memory (no registered buffers): the same counts under comm */
  setenv("TPCORE_REGISTERED_MEMORY", "0", 1);
  for (int n = 2; n <= 3; n++) run_world(n, "plain_memory") ? passed++ : failed++;
  unsetenv("TPCORE_REGISTERED_MEMORY");
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
