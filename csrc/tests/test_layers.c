/*
 * C-level tests of the layers without Python, world sizes 1-3: the parallel MLP
 * (column fc1 -> GELU -> row fc2), forward and input gradient, and the
 * vocab-parallel embedding + cross-entropy (a vocabulary of 13 split unevenly,
 * an ignored row), against double references computed here from the same
 * deterministic full tensors, which each rank writes into its own shard.
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
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tpcore/layers.h"

/* tensor views of test arrays (host, C-contiguous) */
#define F2(p, r, c) ((tp_tensor[]){tp_tensor_2d((void *)(p), TP_FLOAT32, (r), (c))})
#define F1(p, n) ((tp_tensor[]){tp_tensor_1d((void *)(p), TP_FLOAT32, (n))})
#define I1(p, n) ((tp_tensor[]){tp_tensor_1d((void *)(p), TP_INT64, (n))})

enum { H = 7, F = 11, R = 5 };

/* The registered-memory fallback: with TPCORE_REGISTERED_MEMORY=0 the backend
 * declines tp_comm_mem_alloc (TP_ERR_UNSUPPORTED) and the layers must go on in plain
 * device memory with the same numbers.  With TPCORE_SHM_SMALL=0
 * (no eager path for small messages) each rank then checks that no collective took the
 * zero-copy path (plain memory was used), and a registered run that some did. */
static int plain_mode, check_zero_copy;

static void enter_mode(tp_comm_t comm) {
  if (!plain_mode) return;
  void *p;
  tp_mem_t h;
  tp_status_t st = tp_comm_mem_alloc(comm, 64, &p, &h);
  if (st == TP_SUCCESS) { /* the backend must decline in this mode */
    tp_mem_release(h);
    fprintf(stderr, "plain mode: tp_comm_mem_alloc succeeded with TPCORE_REGISTERED_MEMORY=0\n");
    exit(1);
  }
}

static int check_mode(tp_comm_t comm, int n) {
  tp_comm_stats_t s;
  if (n < 2 || !check_zero_copy || tp_comm_get_stats(comm, &s) != TP_SUCCESS) return 0;
  if (plain_mode ? s.zero_copy != 0 : s.zero_copy == 0) {
    fprintf(stderr, "%s mode: %llu zero-copy collectives\n", plain_mode ? "plain" : "registered",
            (unsigned long long)s.zero_copy);
    return 1;
  }
  return 0;
}

static double w1(int i, int j) { return sin(0.37 * i + 0.11 * j + 0.5) * 0.4; } /* W1 [F][H] */
static double b1(int i) { return cos(0.7 * i) * 0.3; }
static double w2(int i, int j) { return cos(0.23 * i - 0.19 * j + 0.1) * 0.4; } /* W2 [H][F] */
static double b2(int i) { return sin(0.9 * i) * 0.2; }
static double xin(int m, int j) { return sin(1.3 * m + 0.7 * j) + 0.1; }
static double dyv(int m, int j) { return cos(0.5 * m - 0.3 * j); }
static double gelu(double v) { return 0.5 * v * (1 + erf(v / sqrt(2))); }
static double dgelu(double v) { return 0.5 * (1 + erf(v / sqrt(2))) + v * exp(-0.5 * v * v) / sqrt(2 * M_PI); }

/* Rank r of n's communicator of the job (a 30 s timeout); NULL, with the reason printed, if it fails. */
static tp_comm_t open_comm(int n, int r, const char *job) {
  tp_comm_config_t cc = TP_COMM_CONFIG_INITIALIZER;
  cc.job_id = job;
  cc.timeout_s = 30;
  tp_comm_t comm = NULL;
  if (tp_comm_init_rank(&comm, n, r, &cc) != TP_SUCCESS) {
    fprintf(stderr, "init: %s\n", tp_last_error());
    return NULL;
  }
  return comm;
}

static int run_rank(int n, int r, const char *job) {
  tp_comm_t comm = open_comm(n, r, job);
  if (!comm) return 1;
  enter_mode(comm);
  tp_mlp_config_t cfg = TP_MLP_CONFIG_INITIALIZER;
  cfg.hidden = H;
  cfg.ffn_hidden = F;
  cfg.activation = TP_ACT_GELU;
  tp_parallel_mlp_t mlp;
  if (tp_parallel_mlp_create(&mlp, comm, &cfg) != TP_SUCCESS) return fprintf(stderr, "mlp: %s\n", tp_last_error()), 1;
  tp_linear_info_t i1, i2;
  tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 0), &i1);
  tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 1), &i2);
  for (int i = 0; i < i1.local; i++) { /* fc1: rows [offset, offset + local) of W1 */
    for (int j = 0; j < H; j++) ((float *)i1.weight)[i * H + j] = (float)w1((int)i1.offset + i, j);
    i1.bias[i] = (float)b1((int)i1.offset + i);
  }
  for (int i = 0; i < H; i++) { /* fc2: columns [offset, offset + local) of W2 */
    for (int j = 0; j < i2.local; j++) ((float *)i2.weight)[i * i2.local + j] = (float)w2(i, (int)i2.offset + j);
    i2.bias[i] = (float)b2(i);
  }
  float x[R * H], y[R * H], dy[R * H], dx[R * H];
  for (int m = 0; m < R; m++)
    for (int j = 0; j < H; j++) x[m * H + j] = (float)xin(m, j), dy[m * H + j] = (float)dyv(m, j);
  /* gradients on demand: none after create (nor after a forward), every one after the first backward */
  int bad = i1.grad_weight || i1.grad_bias || i2.grad_weight || i2.grad_bias;
  if (bad) fprintf(stderr, "mlp: gradients allocated at create\n");
  for (int step = 0; step < 2; step++) { /* the second step reuses the workspaces */
    if (tp_parallel_mlp_forward(mlp, F2(y, R, H), F2(x, R, H), NULL) != TP_SUCCESS ||
        tp_parallel_mlp_backward(mlp, F2(dx, R, H), F2(dy, R, H), NULL) != TP_SUCCESS)
      return fprintf(stderr, "step: %s\n", tp_last_error()), 1;
    for (int m = 0; m < R; m++) {
      double h[F], a[F], da[F];
      for (int f = 0; f < F; f++) {
        h[f] = b1(f);
        for (int j = 0; j < H; j++) h[f] += xin(m, j) * w1(f, j);
        a[f] = gelu(h[f]);
        da[f] = 0;
        for (int o = 0; o < H; o++) da[f] += dyv(m, o) * w2(o, f);
      }
      for (int o = 0; o < H; o++) {
        double ref = b2(o), gref = 0;
        for (int f = 0; f < F; f++) ref += a[f] * w2(o, f), gref += da[f] * dgelu(h[f]) * w1(f, o);
        if (fabs(y[m * H + o] - ref) > 1e-5 * (1 + fabs(ref))) bad++;
        if (fabs(dx[m * H + o] - gref) > 1e-5 * (1 + fabs(gref))) bad++;
      }
    }
  }
  /* the weight and bias gradients, accumulated over the two steps, against the double reference;
   * alloc_grads after backward keeps the same buffers and values (idempotent) */
  float *g1 = NULL;
  for (int again = 0; again < 2; again++) {
    if (again && tp_parallel_mlp_alloc_grads(mlp) != TP_SUCCESS)
      return fprintf(stderr, "alloc: %s\n", tp_last_error()), 1;
    tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 0), &i1);
    tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 1), &i2);
    if (!i1.grad_weight || !i1.grad_bias || !i2.grad_weight || !i2.grad_bias || (again && i1.grad_weight != g1))
      return fprintf(stderr, "mlp: gradients missing after backward (or moved by alloc_grads)\n"), 1;
    g1 = i1.grad_weight;
    double dw1[F][H] = {{0}}, db1[F] = {0}, dw2[H][F] = {{0}}, db2[H] = {0};
    for (int m = 0; m < R; m++)
      for (int f = 0; f < F; f++) {
        double h = b1(f), da = 0;
        for (int j = 0; j < H; j++) h += xin(m, j) * w1(f, j);
        for (int o = 0; o < H; o++) da += dyv(m, o) * w2(o, f), dw2[o][f] += 2 * dyv(m, o) * gelu(h);
        double dh = da * dgelu(h);
        db1[f] += 2 * dh;
        for (int j = 0; j < H; j++) dw1[f][j] += 2 * dh * xin(m, j);
      }
    for (int m = 0; m < R; m++)
      for (int o = 0; o < H; o++) db2[o] += 2 * dyv(m, o);
    for (int i = 0; i < i1.local; i++) {
      int f = (int)i1.offset + i;
      bad += fabs(i1.grad_bias[i] - db1[f]) > 1e-4 * (1 + fabs(db1[f]));
      for (int j = 0; j < H; j++) bad += fabs(i1.grad_weight[i * H + j] - dw1[f][j]) > 1e-4 * (1 + fabs(dw1[f][j]));
    }
    for (int o = 0; o < H; o++) {
      bad += fabs(i2.grad_bias[o] - db2[o]) > 1e-4 * (1 + fabs(db2[o]));
      for (int j = 0; j < i2.local; j++) {
        double ref = dw2[o][i2.offset + j];
        bad += fabs(i2.grad_weight[o * i2.local + j] - ref) > 1e-4 * (1 + fabs(ref));
      }
    }
  }
  bad += check_mode(comm, n);
  tp_parallel_mlp_destroy(mlp);
  tp_comm_destroy(comm);
  if (bad) fprintf(stderr, "rank %d of %d: %d values off\n", r, n, bad);
  return bad ? 1 : 0;
}

enum { VOC = 13, DIM = 4, T = 6, IGNORE = -100 };

static double tab(int v, int c) { return sin(0.3 * v + 1.1 * c) * 2.0; }                     /* full table [VOC][DIM] */
static double logit(int m, int v) { return cos(0.7 * m + 0.45 * v) * 3.0 + 1e3 * (m == 2); } /* [T][VOC] */
static const int64_t tokens[T] = {0, 12, 5, 5, 7, 1};
static const int64_t targets[T] = {3, 12, IGNORE, 0, 6, 11};

/* Embedding forward/backward and cross-entropy value/gradient on rank r of n. */
static int run_vocab(int n, int r, const char *job) {
  tp_comm_t comm = open_comm(n, r, job);
  if (!comm) return 1;
  enter_mode(comm);
  int64_t part[3] = {0, 0, 0}, lo = 0;
  for (int p = 0; p < n; p++) part[p] = p == n - 1 ? VOC - (n - 1) * 3 : 3; /* 13 = 3 + 3 + 7 at world 3 */
  for (int p = 0; p < r; p++) lo += part[p];
  tp_embedding_config_t ec = TP_EMBEDDING_CONFIG_INITIALIZER;
  ec.num_embeddings = VOC;
  ec.embedding_dim = DIM;
  ec.partition = part;
  tp_vocab_embedding_t emb;
  tp_vocab_xent_t xent;
  if (tp_vocab_embedding_create(&emb, comm, &ec) != TP_SUCCESS || tp_vocab_xent_create(&xent, comm, NULL) != TP_SUCCESS)
    return fprintf(stderr, "create: %s\n", tp_last_error()), 1;
  tp_embedding_info_t ei;
  tp_vocab_embedding_info(emb, &ei);
  int bad = ei.offset != lo || ei.local != part[r];
  if (ei.grad_weight) bad |= fprintf(stderr, "embedding: a gradient at create\n") > 0;
  for (int v = 0; v < ei.local; v++)
    for (int c = 0; c < DIM; c++) ((float *)ei.weight)[v * DIM + c] = (float)tab((int)lo + v, c);
  float y[T * DIM], dy[T * DIM];
  if (tp_vocab_embedding_forward(emb, F2(y, T, DIM), I1(tokens, T), NULL) != TP_SUCCESS)
    return fprintf(stderr, "emb: %s\n", tp_last_error()), 1;
  for (int m = 0; m < T; m++)
    for (int c = 0; c < DIM; c++) {
      bad += y[m * DIM + c] != (float)tab((int)tokens[m], c); /* a lookup is exact */
      dy[m * DIM + c] = (float)(0.1 * m - 0.2 * c);
    }
  if (ei.grad_weight) bad |= fprintf(stderr, "embedding: a gradient after forward\n") > 0;
  if (tp_vocab_embedding_backward(emb, F2(dy, T, DIM), NULL) != TP_SUCCESS)
    return fprintf(stderr, "emb bwd: %s\n", tp_last_error()), 1;
  float *gw = (tp_vocab_embedding_info(emb, &ei), ei.grad_weight);
  if (tp_vocab_embedding_alloc_grads(emb) != TP_SUCCESS || tp_vocab_embedding_info(emb, &ei) != TP_SUCCESS ||
      !ei.grad_weight || ei.grad_weight != gw)
    return fprintf(stderr, "embedding: no gradient after backward, or alloc_grads moved it\n"), 1;
  for (int v = 0; v < ei.local; v++)
    for (int c = 0; c < DIM; c++) {
      double g = 0;
      for (int m = 0; m < T; m++) g += tokens[m] == lo + v ? 0.1 * m - 0.2 * c : 0.0;
      bad += fabs(ei.grad_weight[v * DIM + c] - g) > 1e-6;
    }
  /* cross-entropy over this rank's logits shard */
  int V = (int)part[r];
  float *lg = malloc(sizeof(float) * T * (V ? V : 1)), *dl = malloc(sizeof(float) * T * (V ? V : 1)), losses[T];
  for (int m = 0; m < T; m++)
    for (int v = 0; v < V; v++) lg[m * V + v] = (float)logit(m, (int)lo + v);
  int64_t valid = 0, vocab = 0;
  if (tp_vocab_xent_forward(xent, F1(losses, T), F2(lg, T, V), I1(targets, T), -1, IGNORE, &valid, &vocab, NULL) !=
          TP_SUCCESS ||
      tp_vocab_xent_backward(xent, F2(dl, T, V), NULL, 0.5f, NULL) != TP_SUCCESS)
    return fprintf(stderr, "xent: %s\n", tp_last_error()), 1;
  bad += valid != T - 1 || vocab != VOC;
  for (int m = 0; m < T; m++) {
    double mx = -1e300, s = 0;
    for (int v = 0; v < VOC; v++) mx = fmax(mx, logit(m, v));
    for (int v = 0; v < VOC; v++) s += exp(logit(m, v) - mx);
    int ign = targets[m] == IGNORE;
    double ref = ign ? 0.0 : log(s) + mx - logit(m, (int)targets[m]);
    bad += fabs(losses[m] - ref) > 1e-5 * (1 + fabs(ref));
    for (int v = 0; v < V; v++) {
      double p = exp(logit(m, (int)lo + v) - mx) / s, g = ign ? 0.0 : 0.5 * (p - (targets[m] == lo + v));
      bad += fabs(dl[m * V + v] - g) > 1e-6;
    }
  }
  free(lg);
  free(dl);
  bad += check_mode(comm, n);
  tp_vocab_xent_destroy(xent);
  tp_vocab_embedding_destroy(emb);
  tp_comm_destroy(comm);
  if (bad) fprintf(stderr, "vocab rank %d of %d: %d values off\n", r, n, bad);
  return bad ? 1 : 0;
}

/* The Transformer block (Llama-like: RMSNorm, RoPE, GQA, SwiGLU) at world 1-3: forward,
 * backward and a KV-cache decode step; rank 0 leaves y, dx and the decode output in shared
 * memory and main() checks that every world size gives the same numbers.  Run under ASan
 * too, this covers the block's workspaces, the cache and the replicated-KV gradient path. */
enum { BC = 12, BH = 4, BKV = 2, BD = 4, BF = 20, BB = 2, BT = 5 };
static float *block_out; /* [3 worlds][2 * BB*BT*BC + BB*BC] */

/* Gradients on demand: every parameter of the block has a gradient (want 1) or none (want 0);
 * a quantized weight (frozen) never has one. */
static int block_grads(const tp_param_t *p, int n, int want, const char *when) {
  int bad = 0;
  for (int i = 0; i < n; i++) {
    int expect = want && !tp_weight_is_quantized(p[i].dtype);
    if ((p[i].grad != NULL) != expect)
      bad |= fprintf(stderr, "block %s: %s has %s gradient\n", when, p[i].name, p[i].grad ? "a" : "no") > 0;
  }
  return bad;
}

/* A quantized (Q8_0) block: alloc_grads gives the norms theirs and the four weights none,
 * twice; backward then leaves them frozen too. */
static int quant_block_grads(tp_comm_t comm) {
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  cfg.hidden = 32, cfg.heads = 2, cfg.head_dim = 32, cfg.ffn_hidden = 64, cfg.weight_dtype = TP_Q8_0;
  tp_block_t blk;
  if (tp_block_create(&blk, comm, &cfg) != TP_SUCCESS) return fprintf(stderr, "q8 block: %s\n", tp_last_error()), 1;
  tp_param_t prm[16];
  int np = tp_block_params(blk, prm, 16), bad = block_grads(prm, np, 0, "(q8_0) after create");
  bad += tp_block_alloc_grads(blk) != TP_SUCCESS || tp_block_alloc_grads(blk) != TP_SUCCESS;
  bad += block_grads(prm, tp_block_params(blk, prm, 16), 1, "(q8_0) after alloc_grads");
  int frozen = 0;
  for (int i = 0; i < np; i++) frozen += tp_weight_is_quantized(prm[i].dtype);
  bad += frozen != 4;
  float x[2 * 32] = {0}, y[2 * 32], dx[2 * 32];
  for (int i = 0; i < 64; i++) x[i] = (float)sin(0.3 * i);
  tp_block_batch_t bt = {1, 2, NULL, NULL, 0, 1, NULL, NULL, 0};
  bad += tp_block_forward(blk, F2(y, 2, 32), F2(x, 2, 32), &bt, NULL) != TP_SUCCESS ||
         tp_block_backward(blk, F2(dx, 2, 32), F2(y, 2, 32), NULL) != TP_SUCCESS;
  bad += block_grads(prm, tp_block_params(blk, prm, 16), 1, "(q8_0) after backward");
  if (bad) fprintf(stderr, "q8 block: %s\n", tp_last_error());
  tp_block_destroy(blk);
  return bad;
}

static int run_block(int n, int r, const char *job) {
  tp_comm_t comm = open_comm(n, r, job);
  if (!comm) return 1;
  enter_mode(comm);
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  cfg.hidden = BC, cfg.heads = BH, cfg.kv_heads = BKV, cfg.head_dim = BD, cfg.ffn_hidden = BF;
  cfg.norm = TP_NORM_RMS, cfg.activation = TP_ACT_SWIGLU, cfg.bias = 0, cfg.rope_theta = 100.0f, cfg.seed = 3;
  tp_block_t blk;
  if (tp_block_create(&blk, comm, &cfg) != TP_SUCCESS) return fprintf(stderr, "block: %s\n", tp_last_error()), 1;
  enum { NX = BB * BT * BC };
  float x[NX], y[NX], dy[NX], dx[NX], xs[BB * BC], ys[BB * BC];
  for (int i = 0; i < NX; i++) x[i] = (float)sin(0.37 * i), dy[i] = (float)cos(0.11 * i);
  tp_block_batch_t bt = {BB, BT, NULL, NULL, 0, 1, NULL, NULL, 0};
  tp_param_t prm[16];
  int np = tp_block_params(blk, prm, 16), bad = np != 6; /* RMS norms and no biases: 6 weights */
  int bad_grads = block_grads(prm, np, 0, "after create");
  bad += tp_block_forward(blk, F2(y, BB * BT, BC), F2(x, BB * BT, BC), &bt, NULL) != TP_SUCCESS;
  bad_grads += block_grads(prm, tp_block_params(blk, prm, 16), 0, "after forward");
  bad += tp_block_backward(blk, F2(dx, BB * BT, BC), F2(dy, BB * BT, BC), NULL) != TP_SUCCESS;
  bad_grads += block_grads(prm, tp_block_params(blk, prm, 16), 1, "after backward");
  float *gq = prm[1].grad; /* attn.qkv.weight's: alloc_grads keeps it */
  bad_grads += tp_block_alloc_grads(blk) != TP_SUCCESS || (tp_block_params(blk, prm, 16), prm[1].grad != gq);
  bad += bad_grads;
  bad += tp_block_backward(blk, F2(dx, 1, BC), F2(dy, 1, BC), NULL) != TP_ERR_INVALID_ARGUMENT; /* rows must match */
  /* decode: cache the first BT - 1 tokens, then the last one at its position */
  int64_t pos[BB] = {BT - 1, BT - 1};
  float xp[BB * (BT - 1) * BC];
  for (int b = 0; b < BB; b++)
    for (int t = 0; t < BT; t++)
      for (int c = 0; c < BC; c++) {
        float v = x[(b * BT + t) * BC + c];
        if (t < BT - 1) xp[(b * (BT - 1) + t) * BC + c] = v;
        else xs[b * BC + c] = v;
      }
  float yp[BB * (BT - 1) * BC];
  tp_block_batch_t pre = {BB, BT - 1, NULL, NULL, 1, 0, NULL, NULL, 0}, dec = {BB, 1, pos, NULL, 1, 0, NULL, NULL, 0};
  bad += tp_block_cache(blk, BB, BT + 2) != TP_SUCCESS ||
         tp_block_forward(blk, F2(yp, BB * (BT - 1), BC), F2(xp, BB * (BT - 1), BC), &pre, NULL) != TP_SUCCESS ||
         tp_block_forward(blk, F2(ys, BB, BC), F2(xs, BB, BC), &dec, NULL) != TP_SUCCESS;
  for (int b = 0; b < BB; b++) /* the decoded last token equals the full forward's */
    for (int c = 0; c < BC; c++) bad += fabsf(ys[b * BC + c] - y[(b * BT + BT - 1) * BC + c]) > 1e-5f;
  /* the same through cache slots: sequence b prefilled into slot sl[b] of a cache of BB + 2 sequences
   * (the others hold stale tokens), then decoded with the rows in the other order, the slots following */
  int64_t sl[BB] = {3, 0}, slr[BB] = {0, 3};
  float xsr[BB * BC], ysr[BB * BC];
  for (int b = 0; b < BB; b++)
    for (int c = 0; c < BC; c++) xsr[b * BC + c] = xs[(BB - 1 - b) * BC + c];
  tp_block_batch_t pres = {BB, BT - 1, NULL, NULL, 1, 0, sl, NULL, 0}, decs = {BB, 1, pos, NULL, 1, 0, slr, NULL, 0};
  bad += tp_block_cache(blk, BB + 2, BT + 2) != TP_SUCCESS ||
         tp_block_forward(blk, F2(yp, BB * (BT - 1), BC), F2(xp, BB * (BT - 1), BC), &pre, NULL) != TP_SUCCESS ||
         tp_block_forward(blk, F2(yp, BB * (BT - 1), BC), F2(xp, BB * (BT - 1), BC), &pres, NULL) != TP_SUCCESS ||
         tp_block_forward(blk, F2(ysr, BB, BC), F2(xsr, BB, BC), &decs, NULL) != TP_SUCCESS;
  for (int b = 0; b < BB; b++)
    for (int c = 0; c < BC; c++) bad += fabsf(ysr[b * BC + c] - y[((BB - 1 - b) * BT + BT - 1) * BC + c]) > 1e-5f;
  /* one shared inference workspace for two blocks of the same weights (the caller's reference
   * dropped at once: the blocks keep theirs): each decodes as the block alone did, a backward
   * after an inference forward is refused, a training forward still uses the block's own arena */
  tp_block_t b2 = NULL;
  tp_workspace_t w = NULL;
  bad += tp_block_create(&b2, comm, &cfg) != TP_SUCCESS || tp_workspace_create(&w, TP_DEVICE_CPU, 0) != TP_SUCCESS;
  if (b2 && w) {
    bad += tp_block_set_workspace(blk, w) != TP_SUCCESS || tp_block_set_workspace(b2, w) != TP_SUCCESS;
    bad += tp_block_get_workspace(b2) != w || tp_workspace_bytes(w) != 0;
    tp_workspace_destroy(w);
    tp_block_t both[2] = {blk, b2};
    for (int i = 0; i < 2; i++) {
      float ys2[BB * BC];
      bad +=
          tp_block_cache(both[i], BB, BT + 2) != TP_SUCCESS ||
          tp_block_forward(both[i], F2(yp, BB * (BT - 1), BC), F2(xp, BB * (BT - 1), BC), &pre, NULL) != TP_SUCCESS ||
          tp_block_forward(both[i], F2(ys2, BB, BC), F2(xs, BB, BC), &dec, NULL) != TP_SUCCESS;
      for (int j = 0; j < BB * BC; j++) bad += ys2[j] != ys[j];
      bad += tp_block_backward(both[i], F2(dx, BB, BC), F2(dy, BB, BC), NULL) != TP_ERR_INVALID_USAGE;
    }
    /* the prefill's activations and the projections' all-reduced outputs lived there */
    tp_layer_memory_t wm;
    memset(&wm, 0, sizeof wm);
    wm.size = sizeof wm;
    bad += tp_workspace_memory(tp_block_get_workspace(blk), &wm) != TP_SUCCESS || wm.workspace == 0 || wm.comm == 0 ||
           tp_workspace_bytes(tp_block_get_workspace(blk)) != wm.workspace + wm.comm;
    wm.size = 3;
    bad += tp_workspace_memory(tp_block_get_workspace(blk), &wm) != TP_ERR_INVALID_ARGUMENT;
    float y2[NX], dx2[NX];
    bad += tp_block_forward(b2, F2(y2, BB * BT, BC), F2(x, BB * BT, BC), &bt, NULL) != TP_SUCCESS ||
           tp_block_backward(b2, F2(dx2, BB * BT, BC), F2(dy, BB * BT, BC), NULL) != TP_SUCCESS;
    for (int j = 0; j < NX; j++) bad += y2[j] != y[j];
    bad += tp_block_set_workspace(b2, NULL) != TP_SUCCESS || tp_block_get_workspace(b2) != NULL;
  }
  tp_block_destroy(b2);
  if (!plain_mode && !check_zero_copy) bad += quant_block_grads(comm);
  bad += check_mode(comm, n);
  if (bad) fprintf(stderr, "block rank %d of %d: %s\n", r, n, tp_last_error());
  if (r == 0) {
    float *o = block_out + (plain_mode * 3 + n - 1) * (2 * NX + BB * BC);
    memcpy(o, y, sizeof y);
    memcpy(o + NX, dx, sizeof dx);
    memcpy(o + 2 * NX, ys, sizeof ys);
  }
  tp_block_destroy(blk);
  tp_comm_destroy(comm);
  return bad ? 1 : 0;
}

/* Sizes and positions at the edges: every call is refused with INVALID_ARGUMENT and a
 * sentence naming the argument, or succeeds on an empty batch; never a write out of bounds
 * (ASan), a signed overflow or a NULL to memcpy (UBSan), or a read of a freed layer. */
#define EXPECT(call, st, word)                                                                             \
  do {                                                                                                     \
    tp_status_t got_ = (call);                                                                             \
    if (got_ != (st) || ((st) != TP_SUCCESS && !strstr(tp_last_error(), (word)))) {                        \
      fprintf(stderr, "sizes rank %d line %d: %s -> %s (%s), expected %s with '%s'\n", r, __LINE__, #call, \
              tp_status_name(got_), tp_last_error(), tp_status_name(st), (word));                          \
      bad++;                                                                                               \
    }                                                                                                      \
  } while (0)

/* The block's sizes: dimensions whose products overflow, a KV cache that would wrap, positions
 * and cache slots past its end, tensors of the wrong shape, dtype, device or layout, empty batches.
 * Returns the number of failed checks. */
static int sizes_block(tp_comm_t comm, int n, int r) {
  int bad = 0;
  const int64_t big = INT64_MAX;
  /* block: dimensions whose products overflow */
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  tp_block_t blk = NULL;
  cfg.hidden = 8, cfg.heads = big, cfg.kv_heads = 1, cfg.head_dim = big, cfg.ffn_hidden = 8;
  EXPECT(tp_block_create(&blk, comm, &cfg), TP_ERR_INVALID_ARGUMENT, "head_dim");
  int64_t hp[2] = {big, 2 - big};
  cfg.heads = 2, cfg.kv_heads = 2, cfg.head_dim = 2, cfg.head_partition = hp;
  if (n == 2) EXPECT(tp_block_create(&blk, comm, &cfg), TP_ERR_INVALID_ARGUMENT, "head_partition");
  cfg.head_partition = NULL, cfg.rope_theta = 100.0f;
  cfg.heads = 2 * n; /* nq = 2 heads of D = 2 on every rank */
  if (tp_block_create(&blk, comm, &cfg) != TP_SUCCESS) return fprintf(stderr, "block: %s\n", tp_last_error()), 1;
  /* the KV cache: batch x max_len x K/V width must not wrap (2^58 x 64 x 4 wrapped to 0) */
  EXPECT(tp_block_cache(blk, (int64_t)1 << 58, 64), TP_ERR_INVALID_ARGUMENT, "batch");
  EXPECT(tp_block_cache(blk, (int64_t)1 << 40, (int64_t)1 << 40), TP_ERR_INVALID_ARGUMENT, "max_len");
  EXPECT(tp_block_cache(blk, INT32_MAX, INT32_MAX), TP_ERR_INVALID_ARGUMENT, "too large");
  EXPECT(tp_block_cache(blk, 0, 8), TP_ERR_INVALID_ARGUMENT, "batch");
  EXPECT(tp_block_cache(blk, 1, -1), TP_ERR_INVALID_ARGUMENT, "max_len");
  EXPECT(tp_block_cache(blk, 2, 8), TP_SUCCESS, "");
  /* positions: pos0 + T must not wrap past the cache's end (2^63 - 1 + 2 wrapped negative) */
  float x[2 * 3 * 8], y[2 * 3 * 8];
  for (int i = 0; i < 2 * 3 * 8; i++) x[i] = (float)sin(0.3 * i);
  int64_t pos[2] = {big - 1, 0};
  tp_block_batch_t bt = {2, 2, pos, NULL, 1, 0, NULL, NULL, 0};
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "pos0");
  pos[0] = -3;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, ">= 0");
  pos[0] = 7;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "past the KV cache");
  pos[0] = 6, pos[1] = 6; /* the last two slots */
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_SUCCESS, "");
  /* cache slots: inside the cache's 2 sequences, none twice, only with the cache */
  int64_t slots[2] = {1, 2};
  pos[0] = pos[1] = 0, bt.slots = slots;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "slots[1] = 2");
  slots[1] = INT64_MIN;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "outside");
  slots[1] = 1;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT,
         "slots[0] and slots[1] are both 1");
  slots[0] = 1, slots[1] = 0;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_SUCCESS, "");
  bt.use_cache = 0;
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "need use_cache");
  bt.use_cache = 1, bt.slots = NULL;
  tp_block_batch_t nc = {1, 3, pos, NULL, 0, 0, NULL, NULL, 0};
  pos[0] = big - 2;
  EXPECT(tp_block_forward(blk, F2(y, 3, 8), F2(x, 3, 8), &nc, NULL), TP_ERR_INVALID_ARGUMENT, "pos0");
  tp_block_batch_t many = {1, 1 << 20, NULL, NULL, 0, 1, NULL, NULL, 0}; /* probabilities of 2^20 x 2^20 x 2 heads */
  EXPECT(tp_block_forward(blk, F2(y, 1 << 20, 8), F2(x, 1 << 20, 8), &many, NULL), TP_ERR_INVALID_ARGUMENT,
         "B x heads x T x T");
  tp_block_batch_t rows = {(int64_t)1 << 32, (int64_t)1 << 32, NULL, NULL, 0, 0, NULL, NULL, 0};
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), F2(x, 4, 8), &rows, NULL), TP_ERR_INVALID_ARGUMENT, "out of range");
  /* the tensors: rows, columns, dtype, device and layout are checked, naming the argument */
  bt.pos0 = NULL, bt.use_cache = 0;
  EXPECT(tp_block_forward(blk, F2(y, 3, 8), F2(x, 3, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "x must have shape");
  EXPECT(tp_block_forward(blk, F2(y, 4, 7), F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "y must have shape");
  tp_tensor xi = tp_tensor_2d(x, TP_INT32, 4, 8), xd = tp_tensor_2d(x, TP_FLOAT32, 4, 8), xt = xd;
  xd.device = TP_DEVICE_CUDA;
  xt.strides[0] = 1, xt.strides[1] = 4; /* a transposed view */
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), &xi, &bt, NULL), TP_ERR_INVALID_ARGUMENT, "float32");
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), &xd, &bt, NULL), TP_ERR_INVALID_ARGUMENT, "x is cuda:0 memory");
  EXPECT(tp_block_forward(blk, F2(y, 4, 8), &xt, &bt, NULL), TP_ERR_INVALID_ARGUMENT, "contiguous");
  EXPECT(tp_block_forward(blk, NULL, F2(x, 4, 8), &bt, NULL), TP_ERR_INVALID_ARGUMENT, "NULL argument");
  /* empty batches: empty in, empty out, NULL data included (the collectives still run) */
  tp_block_batch_t e1 = {0, 3, NULL, NULL, 0, 1, NULL, NULL, 0}, e2 = {2, 0, NULL, NULL, 0, 1, NULL, NULL, 0};
  tp_block_batch_t e3 = {0, 0, NULL, NULL, 1, 0, NULL, NULL, 0};
  EXPECT(tp_block_forward(blk, F2(NULL, 0, 8), F2(NULL, 0, 8), &e1, NULL), TP_SUCCESS, "");
  EXPECT(tp_block_backward(blk, F2(NULL, 0, 8), F2(NULL, 0, 8), NULL), TP_SUCCESS, "");
  EXPECT(tp_block_forward(blk, F2(NULL, 0, 8), F2(NULL, 0, 8), &e2, NULL), TP_SUCCESS, "");
  EXPECT(tp_block_backward(blk, F2(NULL, 0, 8), F2(NULL, 0, 8), NULL), TP_SUCCESS, "");
  EXPECT(tp_block_forward(blk, F2(NULL, 0, 8), F2(NULL, 0, 8), &e3, NULL), TP_SUCCESS, "");
  tp_block_destroy(blk);
  return bad;
}

static int run_sizes(int n, int r, const char *job) {
  tp_comm_t comm = open_comm(n, r, job);
  if (!comm) return 1;
  int bad = 0;
  const int64_t big = INT64_MAX;
  /* linear: a shard too large is refused with its sizes (the message was read from the freed layer) */
  tp_linear_config_t lc = TP_LINEAR_CONFIG_INITIALIZER;
  tp_parallel_linear_t lin = NULL;
  lc.in_features = (int64_t)1 << 30, lc.out_features = (int64_t)1 << 30;
  EXPECT(tp_parallel_linear_create(&lin, comm, &lc), TP_ERR_INVALID_ARGUMENT, "too large");
  lc.out_features = big, lc.gated = 1;
  EXPECT(tp_parallel_linear_create(&lin, comm, &lc), TP_ERR_INVALID_ARGUMENT, "at most");
  int64_t huge_part[2] = {big, big};
  lc.in_features = 4, lc.out_features = 4, lc.gated = 0, lc.partition = huge_part;
  if (n == 2) EXPECT(tp_parallel_linear_create(&lin, comm, &lc), TP_ERR_INVALID_ARGUMENT, "partition");
  tp_embedding_config_t ec = TP_EMBEDDING_CONFIG_INITIALIZER;
  tp_vocab_embedding_t emb = NULL;
  ec.num_embeddings = 4, ec.embedding_dim = 2, ec.partition = huge_part;
  if (n == 2) EXPECT(tp_vocab_embedding_create(&emb, comm, &ec), TP_ERR_INVALID_ARGUMENT, "partition");
  bad += sizes_block(comm, n, r);
  float x[2 * 3 * 8], y[2 * 3 * 8];
  for (int i = 0; i < 2 * 3 * 8; i++) x[i] = (float)sin(0.3 * i), y[i] = 0.0f;
  tp_mlp_config_t mc = TP_MLP_CONFIG_INITIALIZER;
  tp_parallel_mlp_t mlp;
  mc.hidden = 3, mc.ffn_hidden = 5;
  if (tp_parallel_mlp_create(&mlp, comm, &mc) != TP_SUCCESS) return fprintf(stderr, "mlp: %s\n", tp_last_error()), 1;
  EXPECT(tp_parallel_mlp_forward(mlp, F2(NULL, 0, 3), F2(NULL, 0, 3), NULL), TP_SUCCESS, "");
  EXPECT(tp_parallel_mlp_backward(mlp, F2(NULL, 0, 3), F2(NULL, 0, 3), NULL), TP_SUCCESS, "");
  tp_tensor yb = tp_tensor_2d(y, TP_FLOAT32, 1, 3), xb = tp_tensor_2d(x, TP_FLOAT32, 1, 3);
  yb.shape[0] = xb.shape[0] = big; /* a view of 2^63 - 1 rows (tp_tensor_2d's strides would overflow) */
  yb.strides[0] = xb.strides[0] = 3;
  EXPECT(tp_parallel_mlp_forward(mlp, &yb, &xb, NULL), TP_ERR_INVALID_ARGUMENT, "rows");
  EXPECT(tp_parallel_mlp_forward(mlp, F2(y, 2, 3), F2(x, 2, 4), NULL), TP_ERR_INVALID_ARGUMENT, "mlp forward: x");
  tp_parallel_mlp_destroy(mlp);
  lc.partition = NULL, lc.kind = TP_ROW_PARALLEL, lc.input_is_parallel = 0;
  if (tp_parallel_linear_create(&lin, comm, &lc) != TP_SUCCESS) return fprintf(stderr, "lin: %s\n", tp_last_error()), 1;
  EXPECT(tp_parallel_linear_forward(lin, F2(NULL, 0, 4), F2(NULL, 0, 4), NULL), TP_SUCCESS, "");
  EXPECT(tp_parallel_linear_backward(lin, F2(NULL, 0, 4), F2(NULL, 0, 4), NULL), TP_SUCCESS, "");
  EXPECT(tp_parallel_linear_forward(lin, F2(y, 2, 4), F2(x, 2, 5), NULL), TP_ERR_INVALID_ARGUMENT,
         "linear forward: x must have shape [rows, 4]");
  EXPECT(tp_parallel_linear_backward(lin, F2(y, 2, 4), F2(x, 2, 4), NULL), TP_ERR_INVALID_ARGUMENT, "rows");
  tp_parallel_linear_destroy(lin);
  ec.partition = NULL;
  tp_vocab_xent_t xent;
  if (tp_vocab_embedding_create(&emb, comm, &ec) != TP_SUCCESS || tp_vocab_xent_create(&xent, comm, NULL) != TP_SUCCESS)
    return fprintf(stderr, "vocab: %s\n", tp_last_error()), 1;
  EXPECT(tp_vocab_embedding_forward(emb, F2(NULL, 0, 2), I1(NULL, 0), NULL), TP_SUCCESS, "");
  EXPECT(tp_vocab_embedding_backward(emb, F2(NULL, 0, 2), NULL), TP_SUCCESS, "");
  int64_t toks[2] = {1, 4};
  EXPECT(tp_vocab_embedding_forward(emb, F2(y, 2, 2), I1(toks, 2), NULL), TP_ERR_INVALID_ARGUMENT,
         "token 4 (position 1) is out of range");
  EXPECT(tp_vocab_embedding_forward(emb, F2(y, 2, 2), F1(x, 2), NULL), TP_ERR_INVALID_ARGUMENT, "tokens must be int64");
  tp_tensor badtok = tp_tensor_1d(toks, TP_INT64, 2);
  badtok.device = (tp_device_t)77; /* a device number that is no tp_device_t: named, not 'invalid:0' */
  EXPECT(tp_vocab_embedding_forward(emb, F2(y, 2, 2), &badtok, NULL), TP_ERR_INVALID_ARGUMENT,
         "embedding forward: tokens has device 77, which is not a tp_device_t");
  EXPECT(tp_vocab_xent_forward(xent, F1(NULL, 0), F2(NULL, 0, 2), I1(NULL, 0), -1, -100, NULL, NULL, NULL), TP_SUCCESS,
         "");
  EXPECT(tp_vocab_xent_backward(xent, F2(NULL, 0, 2), NULL, 1.0f, NULL), TP_SUCCESS, "");
  float lg[2] = {0.5f, 1.0f}, loss[1];
  int64_t tg[1] = {1};
  if (n == 1)
    EXPECT(tp_vocab_xent_forward(xent, F1(loss, 1), F2(lg, 1, 2), I1(tg, 1), big, -100, NULL, NULL, NULL),
           TP_ERR_INVALID_ARGUMENT, "vocab_offset");
  if (n == 1)
    EXPECT(tp_vocab_xent_forward(xent, F1(loss, 1), F2(lg, 1, 2), I1(toks + 1, 1), -1, -100, NULL, NULL, NULL),
           TP_ERR_INVALID_ARGUMENT, "target 4 (row 0) is out of range");
  tp_xent_config_t xc = TP_XENT_CONFIG_INITIALIZER;
  tp_vocab_xent_t x2 = NULL;
  xc.device = TP_DEVICE_CUDA; /* this build has no CUDA: refused at create, naming the device */
  EXPECT(tp_vocab_xent_create(&x2, comm, &xc), TP_ERR_UNSUPPORTED, "device cuda is not available");
  tp_linear_config_t dc = TP_LINEAR_CONFIG_INITIALIZER;
  tp_parallel_linear_t l2 = NULL;
  dc.in_features = dc.out_features = 4, dc.device_id = 3;
  EXPECT(tp_parallel_linear_create(&l2, comm, &dc), TP_ERR_INVALID_ARGUMENT, "linear: device_id 3 is out of range");
  dc.device_id = 0, dc.device = (tp_device_t)7;
  EXPECT(tp_parallel_linear_create(&l2, comm, &dc), TP_ERR_INVALID_ARGUMENT, "not a tp_device_t");
  tp_block_config_t bc = TP_BLOCK_CONFIG_INITIALIZER;
  tp_block_t b2 = NULL;
  bc.hidden = 4, bc.heads = 2, bc.head_dim = 2, bc.ffn_hidden = 4, bc.device = TP_DEVICE_CUDA;
  EXPECT(tp_block_create(&b2, comm, &bc), TP_ERR_UNSUPPORTED, "block: device cuda");
  tp_vocab_xent_destroy(xent);
  tp_vocab_embedding_destroy(emb);
  tp_comm_destroy(comm);
  return bad ? 1 : 0;
}

/* tp_partition: the cases of tests/nn/test_layers.py::test_partition, and its errors. */
#define PCHK(failed)                                                            \
  do {                                                                          \
    if (failed) fprintf(stderr, "partition line %d failed\n", __LINE__), bad++; \
  } while (0)

static int run_partition(void) {
  int bad = 0;
  int64_t s[8], o[9];
  const int64_t e1[] = {4, 3, 3}, e2[] = {3, 3, 3, 3, 0}, e3[] = {75, 25};
  PCHK(tp_partition(10, 3, NULL, 1, s, o) != TP_SUCCESS || memcmp(s, e1, sizeof e1) || o[1] != 4 || o[3] != 10);
  PCHK(tp_partition(12, 5, NULL, 3, s, o) != TP_SUCCESS || memcmp(s, e2, sizeof e2) || o[3] != 9 || o[4] != 12 ||
       o[5] != 12);
  double w3[] = {3, 1}, w4[] = {1.7, 1, 1, 0.3}, wneg[] = {1, -1};
  PCHK(tp_partition(100, 2, w3, 1, s, o) != TP_SUCCESS || memcmp(s, e3, sizeof e3));
  PCHK(tp_partition(1001, 4, w4, 1, s, o) != TP_SUCCESS || o[4] != 1001 || !(s[0] > s[1] && s[1] > s[3]));
  PCHK(tp_partition(10, 3, NULL, 4, s, o) != TP_ERR_INVALID_ARGUMENT ||
       strcmp(tp_last_error(), "partition: n=10 is not a multiple of align=4") != 0);
  PCHK(tp_partition(10, 2, wneg, 1, s, o) != TP_ERR_INVALID_ARGUMENT ||
       strcmp(tp_last_error(),
              "partition: weights must be 2 finite non-negative numbers with a positive sum, got "
              "[1.0, -1.0]") != 0);
  PCHK(tp_partition(-1, 2, NULL, 1, s, o) != TP_ERR_INVALID_ARGUMENT ||
       strcmp(tp_last_error(), "partition: n must be an integer >= 0, got -1") != 0);
  /* given sizes: checked, offsets written */
  const int64_t given[] = {2, 0, 5};
  PCHK(tp_partition_sizes(7, 3, given, s, o, "t: partition", "n") != TP_SUCCESS || o[2] != 2 || o[3] != 7);
  PCHK(tp_partition_sizes(8, 3, given, s, o, "t: partition", "n") != TP_ERR_INVALID_ARGUMENT ||
       strcmp(tp_last_error(), "t: partition sums to 7 but n is 8") != 0);
  if (bad) fprintf(stderr, "partition: %d checks failed (%s)\n", bad, tp_last_error());
  printf("partition: %s\n", bad ? "FAILED" : "ok");
  return !bad;
}

static int run_world(int n, int (*fn)(int, int, const char *), const char *name) {
  char job[64];
  snprintf(job, sizeof job, "clayers%d_%s_%d", (int)getpid(), name, n);
  pid_t pids[3];
  for (int r = 0; r < n; r++)
    if ((pids[r] = fork()) == 0) {
      alarm(60);
      _exit(fn(n, r, job));
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

/* Quantized weights from C (a GGUF loader's view): raw Q8_0 / Q4_1 rows written into each
 * rank's shard (column parallel: whole rows; row parallel: each row's blocks of its slice),
 * forward against a double reference of the dequantized blocks, backward's dx too; the
 * layers hold no weight gradient. */
enum { QK = 96, QN = 5, QM = 3 }; /* 3 blocks of 32 per row */

static uint8_t qblock_byte(int fmt, int row, int blk, int i) {
  return (uint8_t)((row * 31 + blk * 7 + i * 13 + fmt) % 251);
}

/* One full row of fmt (TP_Q8_0 or TP_Q4_1) into out (row bytes) and its values into v[QK]. */
static void make_qrow(tp_dtype_t fmt, int row, uint8_t *out, double *v) {
  size_t bb = fmt == TP_Q8_0 ? 34 : 20;
  for (int b = 0; b < QK / 32; b++) {
    uint8_t *p = out + (size_t)b * bb;
    uint16_t d = tp_float_to_half(0.01f * (float)(1 + (row + b) % 5)), m = tp_float_to_half(-0.05f * (float)(b + 1));
    memcpy(p, &d, 2);
    double dd = tp_half_to_float(d), mm = tp_half_to_float(m);
    if (fmt == TP_Q8_0) {
      for (int i = 0; i < 32; i++) {
        int8_t q = (int8_t)(qblock_byte(8, row, b, i) - 125);
        memcpy(p + 2 + i, &q, 1);
        v[b * 32 + i] = dd * q;
      }
    } else {
      memcpy(p + 2, &m, 2);
      for (int i = 0; i < 16; i++) {
        uint8_t q = qblock_byte(4, row, b, i);
        p[4 + i] = q;
        v[b * 32 + i] = dd * (q & 15) + mm;
        v[b * 32 + 16 + i] = dd * (q >> 4) + mm;
      }
    }
  }
}

static int run_quant(int n, int r, const char *job) {
  tp_comm_t comm = open_comm(n, r, job);
  if (!comm) return 1;
  int bad = 0;
  tp_dtype_t fmts[2] = {TP_Q8_0, TP_Q4_1};
  for (int fi = 0; fi < 2; fi++) {
    tp_dtype_t fmt = fmts[fi];
    size_t rb = 0, bb = fmt == TP_Q8_0 ? 34 : 20;
    tp_weight_row_bytes(fmt, QK, &rb);
    uint8_t full[QN][3 * 34];
    double W[QN][QK];
    for (int i = 0; i < QN; i++) make_qrow(fmt, i, full[i], W[i]);
    int64_t part[3] = {QK, 0, 0};
    if (n == 2) part[0] = 64, part[1] = 32;              /* uneven, whole blocks */
    if (n == 3) part[0] = 32, part[1] = 0, part[2] = 64; /* one rank holds none */
    for (int kind = 0; kind < 2; kind++) {
      tp_linear_config_t lc = TP_LINEAR_CONFIG_INITIALIZER;
      lc.kind = kind ? TP_ROW_PARALLEL : TP_COLUMN_PARALLEL;
      lc.in_features = QK, lc.out_features = QN, lc.bias = 0, lc.weight_dtype = fmt;
      lc.gather_output = !kind, lc.input_is_parallel = 0, lc.partition = kind ? part : NULL;
      tp_parallel_linear_t L;
      tp_linear_info_t li;
      if (tp_parallel_linear_create(&L, comm, &lc) != TP_SUCCESS || tp_parallel_linear_info(L, &li) != TP_SUCCESS)
        return fprintf(stderr, "quant linear: %s\n", tp_last_error()), 1;
      if (li.grad_weight) bad |= fprintf(stderr, "quant linear: a weight gradient was allocated\n") > 0;
      uint8_t *w = li.weight;
      if (!kind) {
        for (int i = 0; i < li.local; i++) memcpy(w + (size_t)i * rb, full[li.offset + i], rb);
      } else {
        size_t lb = (size_t)li.local / 32 * bb;
        for (int i = 0; i < QN; i++) memcpy(w + (size_t)i * lb, full[i] + (size_t)li.offset / 32 * bb, lb);
      }
      float x[QM * QK], y[QM * QN], dy[QM * QN], dx[QM * QK];
      for (int i = 0; i < QM * QK; i++) x[i] = (float)sin(0.3 * i + 0.1);
      for (int i = 0; i < QM * QN; i++) dy[i] = (float)cos(0.7 * i);
      if (tp_parallel_linear_forward(L, F2(y, QM, QN), F2(x, QM, QK), NULL) != TP_SUCCESS ||
          tp_parallel_linear_backward(L, F2(dx, QM, QK), F2(dy, QM, QN), NULL) != TP_SUCCESS)
        return fprintf(stderr, "quant step: %s\n", tp_last_error()), 1;
      /* frozen: neither backward nor alloc_grads gives the quantized weight a gradient */
      if (tp_parallel_linear_alloc_grads(L) != TP_SUCCESS || tp_parallel_linear_alloc_grads(L) != TP_SUCCESS ||
          tp_parallel_linear_info(L, &li) != TP_SUCCESS || li.grad_weight || li.grad_bias)
        bad |=
            fprintf(stderr, "quant linear: a weight gradient after backward / alloc_grads (%s)\n", tp_last_error()) > 0;
      for (int m = 0; m < QM; m++) {
        for (int o = 0; o < QN; o++) {
          double ref = 0;
          for (int k = 0; k < QK; k++) ref += x[m * QK + k] * W[o][k];
          if (fabs(y[m * QN + o] - ref) > 1e-4 * (1 + fabs(ref))) bad = 1;
        }
        for (int k = 0; k < QK; k++) {
          double ref = 0;
          for (int o = 0; o < QN; o++) ref += dy[m * QN + o] * W[o][k];
          if (fabs(dx[m * QK + k] - ref) > 1e-4 * (1 + fabs(ref))) bad = 1;
        }
      }
      tp_parallel_linear_destroy(L);
    }
  }
  /* a row-parallel split off the blocks is refused, naming them */
  if (n == 2) {
    int64_t off[2] = {48, 48};
    tp_linear_config_t lc = TP_LINEAR_CONFIG_INITIALIZER;
    lc.kind = TP_ROW_PARALLEL, lc.in_features = QK, lc.out_features = QN, lc.weight_dtype = TP_Q4_1;
    lc.partition = off;
    tp_parallel_linear_t L;
    if (tp_parallel_linear_create(&L, comm, &lc) != TP_ERR_INVALID_ARGUMENT || !strstr(tp_last_error(), "blocks of 32"))
      bad |= fprintf(stderr, "quant: a split off the blocks was not refused (%s)\n", tp_last_error()) > 0;
  }
  tp_comm_destroy(comm);
  if (bad) fprintf(stderr, "quant: rank %d of %d: wrong results\n", r, n);
  return bad;
}

int main(void) {
  int passed = 0, failed = 0;
  size_t per = 2 * BB * BT * BC + BB * BC;
  block_out = mmap(NULL, 6 * per * sizeof(float), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (block_out == MAP_FAILED) return perror("mmap"), 1;
  run_partition() ? passed++ : failed++;
  for (int n = 1; n <= 3; n++) {
    run_world(n, run_rank, "mlp") ? passed++ : failed++;
    run_world(n, run_vocab, "vocab") ? passed++ : failed++;
    run_world(n, run_block, "block") ? passed++ : failed++;
    if (n <= 2) run_world(n, run_sizes, "sizes") ? passed++ : failed++;
    run_world(n, run_quant, "quant") ? passed++ : failed++;
  }
  int same = 1;
  for (int n = 2; n <= 3; n++)
    for (size_t i = 0; i < per; i++)
      same &= fabsf(block_out[(n - 1) * per + i] - block_out[i]) <= 1e-5f * (1 + fabsf(block_out[i]));
  printf("block: the same y, dx and decode output at world 1, 2, 3: %s\n", same ? "ok" : "FAILED");
  same ? passed++ : failed++;
  /* the same again in plain memory (the registered-memory fallback) at world 2 and 3 */
  setenv("TPCORE_SHM_SMALL", "0", 1);
  check_zero_copy = 1;
  run_world(2, run_block, "zero_copy_block") ? passed++ : failed++; /* registered: zero-copy collectives */
  setenv("TPCORE_REGISTERED_MEMORY", "0", 1);
  plain_mode = 1;
  for (int n = 2; n <= 3; n++) {
    run_world(n, run_rank, "plain_mlp") ? passed++ : failed++;
    run_world(n, run_vocab, "plain_vocab") ? passed++ : failed++;
    run_world(n, run_block, "plain_block") ? passed++ : failed++;
  }
  unsetenv("TPCORE_REGISTERED_MEMORY");
  unsetenv("TPCORE_SHM_SMALL");
  same = 1;
  for (int n = 2; n <= 3; n++)
    for (size_t i = 0; i < per; i++) {
      float a = block_out[(3 + n - 1) * per + i], b = block_out[(n - 1) * per + i];
      same &= fabsf(a - b) <= 1e-6f * (1 + fabsf(b));
    }
  printf("block: plain memory gives the registered run's numbers at world 2, 3: %s\n", same ? "ok" : "FAILED");
  same ? passed++ : failed++;
  munmap(block_out, 6 * per * sizeof(float));
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
