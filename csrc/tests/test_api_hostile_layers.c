/* Hostile arguments to every public layer call (tpcore/layers.h); see test_api_hostile.c. */
#include <math.h>

#include "test_api_hostile.h"

/* ------------------------------------------------------------------- layers */

typedef struct {
  void *layer;
  int kind; /* 0 linear fwd x, 1 linear fwd y, 2 linear bwd dy, 3 linear bwd dx, ... */
  const tp_tensor *a, *b;
} lctx;

static tp_status_t layer_call(const tp_tensor *t, void *ctx) {
  lctx *c = ctx;
  switch (c->kind) {
    case 0: return tp_parallel_linear_forward(c->layer, c->a, t, NULL);
    case 1: return tp_parallel_linear_forward(c->layer, t, c->a, NULL);
    case 2: return tp_parallel_linear_backward(c->layer, c->a, t, NULL);
    case 3: return tp_parallel_linear_backward(c->layer, t, c->a, NULL);
    case 4: return tp_parallel_mlp_forward(c->layer, c->a, t, NULL);
    case 5: return tp_parallel_mlp_forward(c->layer, t, c->a, NULL);
    case 6: return tp_parallel_mlp_backward(c->layer, c->a, t, NULL);
    case 7: return tp_parallel_mlp_backward(c->layer, t, c->a, NULL);
    case 8: return tp_vocab_embedding_forward(c->layer, c->a, t, NULL);
    case 9: return tp_vocab_embedding_forward(c->layer, t, c->a, NULL);
    case 10: return tp_vocab_embedding_backward(c->layer, t, NULL);
    case 11: return tp_vocab_xent_forward(c->layer, c->a, t, c->b, -1, -100, NULL, NULL, NULL);
    case 12: return tp_vocab_xent_forward(c->layer, c->a, c->b, t, -1, -100, NULL, NULL, NULL);
    case 13: return tp_vocab_xent_forward(c->layer, t, c->a, c->b, -1, -100, NULL, NULL, NULL);
    case 14: return tp_vocab_xent_backward(c->layer, t, c->a, 1.0f, NULL);
    case 15: return tp_vocab_xent_backward(c->layer, c->a, t, 1.0f, NULL);
  }
  return TP_ERR_INTERNAL;
}
static void layer_variants(const char *op, const char *arg, void *layer, int kind, tp_tensor good, const tp_tensor *a,
                           const tp_tensor *b, int line) {
  lctx c = {layer, kind, a, b};
  hostile_variants(op, arg, good, layer_call, &c, line);
}

void test_linear(tp_comm_t comm, tp_parallel_kind_t kind) {
  const char *nm = kind == TP_COLUMN_PARALLEL ? "column" : "row";
  tp_linear_config_t cfg = TP_LINEAR_CONFIG_INITIALIZER;
  cfg.kind = kind, cfg.in_features = K, cfg.out_features = N;
  tp_parallel_linear_t L = NULL;
  /* hostile configs */
  ARG(tp_parallel_linear_create(NULL, comm, &cfg), "linear", "out");
  ARG(tp_parallel_linear_create(&L, comm, NULL), "linear", "config");
  BAD(tp_parallel_linear_create(&L, NULL, &cfg), ANY_ERR, "linear", "comm");
  tp_linear_config_t c2 = cfg;
  c2.size = 3;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_parallel_linear_create(&L, comm, &c2), TP_ERR_UNSUPPORTED, "linear", "cuda");
  c2 = cfg, c2.device = (tp_device_t)17;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device");
  c2 = cfg, c2.device = (tp_device_t)-1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device");
  c2 = cfg, c2.device_id = 1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device_id");
  c2 = cfg, c2.device_id = -1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device_id");
  c2 = cfg, c2.kind = (tp_parallel_kind_t)7;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "kind");
  c2 = cfg, c2.in_features = -1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "in_features");
  c2 = cfg, c2.out_features = INT64_MIN;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "out_features");
  for (int h = 0; h < 3; h++) {
    c2 = cfg, c2.in_features = HUGE_DIMS[h];
    ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "in_features");
    c2 = cfg, c2.out_features = HUGE_DIMS[h];
    ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "out_features");
  }
  c2 = cfg, c2.in_features = (int64_t)1 << 30, c2.out_features = (int64_t)1 << 30; /* 2^60 weights */
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", NULL);
  const int64_t badpart[1] = {99}, negpart[1] = {-1};
  c2 = cfg, c2.partition = badpart;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "partition");
  c2 = cfg, c2.partition = negpart;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "partition");
  TRUE(L == NULL);
  /* zero-size layer: in = out = 0 */
  c2 = cfg, c2.in_features = 0, c2.out_features = 0;
  tp_parallel_linear_t Z = NULL;
  tp_status_t zs = tp_parallel_linear_create(&Z, comm, &c2);
  if (zs == TP_SUCCESS) {
    OK(tp_parallel_linear_forward(Z, P(T2(NULL, 3, 0)), P(T2(NULL, 3, 0)), NULL));
    OK(tp_parallel_linear_backward(Z, P(T2(NULL, 3, 0)), P(T2(NULL, 3, 0)), NULL));
    tp_parallel_linear_destroy(Z);
  } else {
    ARG(zs, "linear", "features");
  }
  OK(tp_parallel_linear_create(&L, comm, &cfg));
  if (!L) return;
  tp_linear_info_t info;
  OK(tp_parallel_linear_info(L, &info));
  ARG(tp_parallel_linear_info(L, NULL), "linear", "info");
  ARG(tp_parallel_linear_info(NULL, &info), "linear", "layer");
  tp_tensor x = T2(xa, M, K), y = T2(ya, M, N), dx = T2(ga, M, K), dy = T2(ya + 1024, M, N);
  /* backward before any forward */
  BAD(tp_parallel_linear_backward(L, &dx, &dy, NULL), ANY_ERR, "linear backward", "forward");
  /* forward on hostile tensors */
  layer_variants("linear forward", "x", L, 0, x, &y, NULL, __LINE__);
  layer_variants("linear forward", "y", L, 1, y, &x, NULL, __LINE__);
  ARG(tp_parallel_linear_forward(L, P(T2(ya, M + 1, N)), &x, NULL), "linear forward", "y");
  ARG(tp_parallel_linear_forward(L, &y, P(T2(xa, M, K + 1)), NULL), "linear forward", "x");
  ARG(tp_parallel_linear_forward(L, P(T2(ya, (int64_t)1 << 31, N)), P(T2(xa, (int64_t)1 << 31, K)), NULL),
      "linear forward", NULL);
  ARG(tp_parallel_linear_forward(NULL, &y, &x, NULL), "linear forward", "layer");
  /* a failed forward leaves no forward behind: backward after a refused first forward */
  BAD(tp_parallel_linear_backward(L, &dx, &dy, NULL), ANY_ERR, "linear backward", "forward");
  /* zero rows */
  OK(tp_parallel_linear_forward(L, P(T2(NULL, 0, N)), P(T2(NULL, 0, K)), NULL));
  OK(tp_parallel_linear_backward(L, P(T2(NULL, 0, K)), P(T2(NULL, 0, N)), NULL));
  /* growing then shrinking M: the arena reused */
  static const int64_t Ms[] = {1, 7, 33, 2, 64, 5, 1};
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    int64_t m = Ms[i];
    for (int64_t j = 0; j < m * K; j++) xa[j] = (float)((j % 7) - 3) * 0.1f;
    OK(tp_parallel_linear_forward(L, P(T2(ya, m, N)), P(T2(xa, m, K)), NULL));
    OK(tp_parallel_linear_backward(L, P(T2(ga, m, K)), P(T2(ya + 1024 * 2, m, N)), NULL));
    /* backward with a different M than the last forward */
    ARG(tp_parallel_linear_backward(L, P(T2(ga, m + 1, K)), P(T2(ya + 1024 * 2, m + 1, N)), NULL), "linear backward",
        NULL);
  }
  OK(tp_parallel_linear_forward(L, &y, &x, NULL));
  layer_variants("linear backward", "dy", L, 2, dy, &dx, NULL, __LINE__);
  layer_variants("linear backward", "dx", L, 3, dx, &dy, NULL, __LINE__);
  ARG(tp_parallel_linear_backward(NULL, &dx, &dy, NULL), "linear backward", "layer");
  tp_parallel_linear_destroy(L);
  tp_parallel_linear_destroy(NULL);
  printf("linear %s: done\n", nm);
}

void test_mlp(tp_comm_t comm) {
  tp_mlp_config_t cfg = TP_MLP_CONFIG_INITIALIZER;
  cfg.hidden = K, cfg.ffn_hidden = 6;
  tp_parallel_mlp_t m = NULL;
  ARG(tp_parallel_mlp_create(NULL, comm, &cfg), "mlp", "out");
  ARG(tp_parallel_mlp_create(&m, comm, NULL), "mlp", "config");
  tp_mlp_config_t c2 = cfg;
  c2.size = 1;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_parallel_mlp_create(&m, comm, &c2), TP_ERR_UNSUPPORTED, "mlp", "cuda");
  c2 = cfg, c2.device = (tp_device_t)3;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "device");
  c2 = cfg, c2.device_id = 2;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "device_id");
  c2 = cfg, c2.activation = (tp_activation_t)42;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "activation");
  c2 = cfg, c2.hidden = -3;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "features");
  for (int h = 0; h < 3; h++) {
    c2 = cfg, c2.ffn_hidden = HUGE_DIMS[h];
    ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", NULL);
    c2 = cfg, c2.hidden = HUGE_DIMS[h];
    ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", NULL);
  }
  const int64_t badpart[1] = {7};
  c2 = cfg, c2.partition = badpart;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "partition");
  TRUE(m == NULL);
  OK(tp_parallel_mlp_create(&m, comm, &cfg));
  if (!m) return;
  TRUE(tp_parallel_mlp_layer(m, 0) != NULL && tp_parallel_mlp_layer(m, 1) != NULL);
  TRUE(tp_parallel_mlp_layer(m, 2) == NULL && tp_parallel_mlp_layer(m, -1) == NULL);
  TRUE(tp_parallel_mlp_layer(NULL, 0) == NULL);
  tp_tensor x = T2(xa, M, K), y = T2(ya, M, K), dx = T2(ga, M, K), dy = T2(ya + 1024, M, K);
  BAD(tp_parallel_mlp_backward(m, &dx, &dy, NULL), ANY_ERR, "mlp backward", "forward");
  layer_variants("mlp forward", "x", m, 4, x, &y, NULL, __LINE__);
  layer_variants("mlp forward", "y", m, 5, y, &x, NULL, __LINE__);
  ARG(tp_parallel_mlp_forward(m, P(T2(ya, M, K)), P(T2(xa, M + 2, K)), NULL), "mlp forward", NULL);
  ARG(tp_parallel_mlp_forward(m, P(T2(ya, (int64_t)1 << 31, K)), P(T2(xa, (int64_t)1 << 31, K)), NULL), "mlp forward",
      NULL);
  ARG(tp_parallel_mlp_forward(NULL, &y, &x, NULL), "mlp forward", NULL);
  BAD(tp_parallel_mlp_backward(m, &dx, &dy, NULL), ANY_ERR, "mlp backward", "forward");
  OK(tp_parallel_mlp_forward(m, P(T2(NULL, 0, K)), P(T2(NULL, 0, K)), NULL));
  OK(tp_parallel_mlp_backward(m, P(T2(NULL, 0, K)), P(T2(NULL, 0, K)), NULL));
  static const int64_t Ms[] = {2, 40, 1, 64, 3};
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    int64_t mm = Ms[i];
    OK(tp_parallel_mlp_forward(m, P(T2(ya, mm, K)), P(T2(xa, mm, K)), NULL));
    OK(tp_parallel_mlp_backward(m, P(T2(ga, mm, K)), P(T2(ya + 1024 * 2, mm, K)), NULL));
    ARG(tp_parallel_mlp_backward(m, P(T2(ga, mm + 1, K)), P(T2(ya + 1024 * 2, mm + 1, K)), NULL), "mlp backward", NULL);
  }
  OK(tp_parallel_mlp_forward(m, &y, &x, NULL));
  layer_variants("mlp backward", "dy", m, 6, dy, &dx, NULL, __LINE__);
  layer_variants("mlp backward", "dx", m, 7, dx, &dy, NULL, __LINE__);
  tp_parallel_mlp_destroy(m);
  tp_parallel_mlp_destroy(NULL);
  printf("mlp: done\n");
}

void test_vocab(tp_comm_t comm) {
  enum { V = 6, C = 4 };
  tp_embedding_config_t cfg = TP_EMBEDDING_CONFIG_INITIALIZER;
  cfg.num_embeddings = V, cfg.embedding_dim = C;
  tp_vocab_embedding_t e = NULL;
  ARG(tp_vocab_embedding_create(NULL, comm, &cfg), "embedding", "out");
  ARG(tp_vocab_embedding_create(&e, comm, NULL), "embedding", "config");
  tp_embedding_config_t c2 = cfg;
  c2.size = 0;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_vocab_embedding_create(&e, comm, &c2), TP_ERR_UNSUPPORTED, "embedding", "cuda");
  c2 = cfg, c2.device = (tp_device_t)100;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "device");
  c2 = cfg, c2.device_id = INT_MAX;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "device_id");
  c2 = cfg, c2.num_embeddings = -1;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "num_embeddings");
  c2 = cfg, c2.embedding_dim = -1;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "embedding_dim");
  for (int h = 1; h < 3; h++) { /* 2^31 rows of 4 would be a valid (32 GiB) table */
    c2 = cfg, c2.num_embeddings = HUGE_DIMS[h];
    ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", NULL);
    c2 = cfg, c2.embedding_dim = HUGE_DIMS[h];
    ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", NULL);
  }
  const int64_t badpart[1] = {V - 1};
  c2 = cfg, c2.partition = badpart;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "partition");
  TRUE(e == NULL);
  OK(tp_vocab_embedding_create(&e, comm, &cfg));
  if (!e) return;
  tp_embedding_info_t info;
  ARG(tp_vocab_embedding_info(e, NULL), "embedding", "info");
  OK(tp_vocab_embedding_info(e, &info));
  for (int i = 0; i < M; i++) tok[i] = i;
  tp_tensor t = I1(tok, M), y = T2(ya, M, C), dy = T2(ga, M, C);
  BAD(tp_vocab_embedding_backward(e, &dy, NULL), ANY_ERR, "embedding backward", "forward");
  layer_variants("embedding forward", "tokens", e, 8, t, &y, NULL, __LINE__);
  layer_variants("embedding forward", "y", e, 9, y, &t, NULL, __LINE__);
  ARG(tp_vocab_embedding_forward(e, P(T2(ya, M + 1, C)), &t, NULL), "embedding forward", "y");
  /* token ids outside [0, V) */
  tok[1] = V;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = -1;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = INT64_MIN;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = INT64_MAX;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = 1;
  BAD(tp_vocab_embedding_backward(e, &dy, NULL), ANY_ERR, "embedding backward", "forward");
  OK(tp_vocab_embedding_forward(e, P(T2(NULL, 0, C)), P(I1(NULL, 0)), NULL));
  OK(tp_vocab_embedding_backward(e, P(T2(NULL, 0, C)), NULL));
  static const int64_t Ms[] = {1, 50, 2, 64, 3};
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    int64_t m = Ms[i];
    for (int64_t j = 0; j < m; j++) tok[j] = j % V;
    OK(tp_vocab_embedding_forward(e, P(T2(ya, m, C)), P(I1(tok, m)), NULL));
    OK(tp_vocab_embedding_backward(e, P(T2(ga, m, C)), NULL));
    ARG(tp_vocab_embedding_backward(e, P(T2(ga, m + 1, C)), NULL), "embedding backward", "dy");
  }
  for (int i = 0; i < M; i++) tok[i] = i;
  OK(tp_vocab_embedding_forward(e, &y, &t, NULL));
  lctx lc = {e, 10, NULL, NULL};
  hostile_variants("embedding backward", "dy", dy, layer_call, &lc, __LINE__);
  tp_vocab_embedding_destroy(e);
  tp_vocab_embedding_destroy(NULL);

  /* cross-entropy */
  tp_xent_config_t xc = TP_XENT_CONFIG_INITIALIZER;
  tp_vocab_xent_t x = NULL;
  ARG(tp_vocab_xent_create(NULL, comm, &xc), "cross-entropy", "out");
  tp_xent_config_t x2 = xc;
  x2.size = 2;
  ARG(tp_vocab_xent_create(&x, comm, &x2), "cross-entropy", "config");
  x2 = xc, x2.device = TP_DEVICE_CUDA;
  BAD(tp_vocab_xent_create(&x, comm, &x2), TP_ERR_UNSUPPORTED, "cross-entropy", "cuda");
  x2 = xc, x2.device = (tp_device_t)-9;
  ARG(tp_vocab_xent_create(&x, comm, &x2), "cross-entropy", "device");
  x2 = xc, x2.device_id = -2;
  ARG(tp_vocab_xent_create(&x, comm, &x2), "cross-entropy", "device_id");
  TRUE(x == NULL);
  OK(tp_vocab_xent_create(&x, comm, NULL));
  if (!x) return;
  static float logits[64 * V], losses[64], dl[64 * V], dloss[64];
  for (int i = 0; i < 64 * V; i++) logits[i] = (float)(i % 5) * 0.3f;
  for (int i = 0; i < M; i++) tok[i] = i, dloss[i] = 1.0f;
  tp_tensor lg = T2(logits, M, V), tg = I1(tok, M), ls = T1(losses, M), dlg = T2(dl, M, V), dls = T1(dloss, M);
  BAD(tp_vocab_xent_backward(x, &dlg, &dls, 1.0f, NULL), ANY_ERR, "cross-entropy backward", "forward");
  layer_variants("cross-entropy forward", "logits", x, 11, lg, &ls, &tg, __LINE__);
  ARG(tp_vocab_xent_forward(x, &ls, P(T2(logits, -1, V)), &tg, -1, -100, NULL, NULL, NULL), "cross-entropy forward",
      "logits");
  ARG(tp_vocab_xent_forward(x, &ls, P(T2(logits, M, INT64_MAX)), &tg, -1, -100, NULL, NULL, NULL),
      "cross-entropy forward", "logits");
  layer_variants("cross-entropy forward", "targets", x, 12, tg, &ls, &lg, __LINE__);
  layer_variants("cross-entropy forward", "losses", x, 13, ls, &lg, &tg, __LINE__);
  ARG(tp_vocab_xent_forward(x, &ls, &lg, P(I1(tok, M + 1)), -1, -100, NULL, NULL, NULL), "cross-entropy forward",
      "targets");
  tok[2] = V; /* past the vocabulary */
  ARG(tp_vocab_xent_forward(x, &ls, &lg, &tg, -1, -100, NULL, NULL, NULL), "cross-entropy", "target");
  tok[2] = INT64_MIN;
  ARG(tp_vocab_xent_forward(x, &ls, &lg, &tg, -1, -100, NULL, NULL, NULL), "cross-entropy", "target");
  tok[2] = 2;
  ARG(tp_vocab_xent_forward(x, &ls, &lg, &tg, INT64_MAX, -100, NULL, NULL, NULL), "cross-entropy forward",
      "vocab_offset");
  BAD(tp_vocab_xent_backward(x, &dlg, &dls, 1.0f, NULL), ANY_ERR, "cross-entropy backward", "forward");
  int64_t valid = -1, vocab = -1;
  OK(tp_vocab_xent_forward(x, P(T1(NULL, 0)), P(T2(NULL, 0, V)), P(I1(NULL, 0)), -1, -100, &valid, &vocab, NULL));
  TRUE(valid == 0);
  OK(tp_vocab_xent_backward(x, P(T2(NULL, 0, V)), NULL, 1.0f, NULL));
  static const int64_t Mx[] = {1, 60, 2, 64, 3};
  for (size_t i = 0; i < sizeof Mx / sizeof Mx[0]; i++) {
    int64_t m = Mx[i];
    for (int64_t j = 0; j < m; j++) tok[j] = j % V, dloss[j] = 1.0f;
    OK(tp_vocab_xent_forward(x, P(T1(losses, m)), P(T2(logits, m, V)), P(I1(tok, m)), -1, -100, &valid, &vocab, NULL));
    TRUE(valid == m && vocab == V);
    OK(tp_vocab_xent_backward(x, P(T2(dl, m, V)), P(T1(dloss, m)), 1.0f, NULL));
    ARG(tp_vocab_xent_backward(x, P(T2(dl, m + 1, V)), NULL, 1.0f, NULL), "cross-entropy backward", "dlogits");
  }
  for (int i = 0; i < M; i++) tok[i] = i;
  OK(tp_vocab_xent_forward(x, &ls, &lg, &tg, -1, -100, NULL, NULL, NULL));
  layer_variants("cross-entropy backward", "dlogits", x, 14, dlg, &dls, NULL, __LINE__);
  {
    /* dloss: optional (NULL = all ones), the rest hostile */
    lctx c = {x, 15, &dlg, NULL};
    OK(tp_vocab_xent_backward(x, &dlg, NULL, 1.0f, NULL));
    tp_tensor bad[] = {with_data(dls, NULL),   with_dtype(dls, TP_FLOAT64),      with_ndim(dls, 9),
                       with_ndim(dls, 2),      with_shape(dls, 0, -1),           with_shape(dls, 0, INT64_MAX),
                       with_stride(dls, 0, 0), with_dev(dls, TP_DEVICE_CUDA, 0), with_dev(dls, (tp_device_t)11, 0)};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
      BAD(layer_call(&bad[i], &c), ANY_ERR, "cross-entropy backward", "dloss");
  }
  tp_vocab_xent_destroy(x);
  tp_vocab_xent_destroy(NULL);
  printf("vocab: done\n");
}

/* The block of the hostile calls below: hidden BLK_C, BLK_HEADS heads of BLK_D, FFN BLK_FF. */
enum { BLK_C = 8, BLK_HEADS = 2, BLK_D = 4, BLK_FF = 12 };

static tp_block_config_t block_config(void) {
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  cfg.hidden = BLK_C, cfg.heads = BLK_HEADS, cfg.kv_heads = BLK_HEADS, cfg.head_dim = BLK_D, cfg.ffn_hidden = BLK_FF;
  return cfg;
}

/* Configurations the block refuses: nothing is created. */
static void block_bad_configs(tp_comm_t comm) {
  tp_block_config_t cfg = block_config();
  tp_block_t b = NULL;
  ARG(tp_block_create(NULL, comm, &cfg), "block", "out");
  ARG(tp_block_create(&b, comm, NULL), "block", "config");
  tp_block_config_t c2 = cfg;
  c2.size = 8;
  ARG(tp_block_create(&b, comm, &c2), "block", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_block_create(&b, comm, &c2), TP_ERR_UNSUPPORTED, "block", "cuda");
  c2 = cfg, c2.device = (tp_device_t)2;
  ARG(tp_block_create(&b, comm, &c2), "block", "device");
  c2 = cfg, c2.device_id = 5;
  ARG(tp_block_create(&b, comm, &c2), "block", "device_id");
  c2 = cfg, c2.heads = 3;
  ARG(tp_block_create(&b, comm, &c2), "block", "heads");
  c2 = cfg, c2.kv_heads = -1;
  ARG(tp_block_create(&b, comm, &c2), "block", "heads");
  c2 = cfg, c2.head_dim = -4;
  ARG(tp_block_create(&b, comm, &c2), "block", "head_dim");
  c2 = cfg, c2.norm = (tp_norm_t)9;
  ARG(tp_block_create(&b, comm, &c2), "block", "norm");
  c2 = cfg, c2.activation = (tp_activation_t)-1;
  ARG(tp_block_create(&b, comm, &c2), "block", "activation");
  c2 = cfg, c2.rope_theta = 1e4f, c2.head_dim = 3;
  ARG(tp_block_create(&b, comm, &c2), "block", "head_dim");
  for (int h = 0; h < 3; h++) {
    c2 = cfg, c2.hidden = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
    c2 = cfg, c2.head_dim = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
    c2 = cfg, c2.heads = HUGE_DIMS[h], c2.kv_heads = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
    c2 = cfg, c2.ffn_hidden = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
  }
  const int64_t badheads[1] = {BLK_HEADS + 1}, badffn[1] = {-BLK_FF};
  c2 = cfg, c2.head_partition = badheads;
  ARG(tp_block_create(&b, comm, &c2), "block", "head_partition");
  c2 = cfg, c2.ffn_partition = badffn;
  ARG(tp_block_create(&b, comm, &c2), "block", "partition");
  TRUE(b == NULL);
}

/* Forward and backward on hostile batches, tensors and sizes, and the rules between them. */
static void block_bad_calls(tp_block_t b) {
  tp_block_info_t info;
  ARG(tp_block_info(b, NULL), "block", "info");
  OK(tp_block_info(b, &info));
  tp_param_t prm[32];
  int np = tp_block_params(b, prm, 32);
  TRUE(np > 0 && np <= 32);
  TRUE(tp_block_params(b, NULL, 0) == np);
  TRUE(tp_block_params(b, prm, -1) == np);
  TRUE(tp_block_params(NULL, prm, 32) <= 0);
  tp_block_batch_t bt = {1, M, NULL, NULL, 0, 1, NULL, NULL, 0};
  tp_tensor x = T2(xa, M, BLK_C), y = T2(ya, M, BLK_C), dx = T2(ga, M, BLK_C), dy = T2(ya + 1024, M, BLK_C);
  for (int i = 0; i < 64 * 64; i++) xa[i] = (float)((i % 9) - 4) * 0.1f, ya[i] = (float)((i % 5) - 2) * 0.1f;
  BAD(tp_block_backward(b, &dx, &dy, NULL), ANY_ERR, "block backward", "forward");
  /* hostile batches */
  ARG(tp_block_forward(b, &y, &x, NULL, NULL), "block forward", "batch");
  tp_block_batch_t b2 = bt;
  b2.B = -1;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", NULL);
  b2 = bt, b2.B = 3, b2.T = 2; /* B * T != rows */
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", NULL);
  b2 = bt, b2.B = INT64_MAX, b2.T = INT64_MAX;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", NULL);
  b2 = bt, b2.use_cache = 1; /* no cache allocated yet */
  BAD(tp_block_forward(b, &y, &x, &b2, NULL), ANY_ERR, "block forward", "cache");
  int64_t pos0[1] = {-1};
  b2 = bt, b2.pos0 = pos0;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", "pos0");
  pos0[0] = INT64_MAX;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", "pos0");
  ARG(tp_block_forward(NULL, &y, &x, &bt, NULL), "block forward", NULL);
  /* hostile tensors */
  {
    struct {
      const char *arg;
      tp_tensor good;
      int which;
    } v[] = {{"x", x, 0}, {"y", y, 1}};
    for (int i = 0; i < 2; i++) {
      tp_tensor t[] = {with_data(v[i].good, NULL),
                       with_dtype(v[i].good, TP_FLOAT16),
                       with_ndim(v[i].good, 9),
                       with_ndim(v[i].good, 0),
                       as3d(v[i].good),
                       with_shape(v[i].good, 1, BLK_C + 1),
                       with_shape(v[i].good, 0, -1),
                       with_shape(v[i].good, 1, INT64_MAX),
                       with_stride(v[i].good, 1, 0),
                       with_stride(v[i].good, 0, 0),
                       with_dev(v[i].good, TP_DEVICE_CUDA, 0),
                       with_dev(v[i].good, (tp_device_t)33, 0)};
      for (size_t j = 0; j < sizeof t / sizeof t[0]; j++) {
        tp_status_t st =
            v[i].which ? tp_block_forward(b, &t[j], &x, &bt, NULL) : tp_block_forward(b, &y, &t[j], &bt, NULL);
        BAD(st, ANY_ERR, "block forward", v[i].arg);
      }
    }
  }
  BAD(tp_block_backward(b, &dx, &dy, NULL), ANY_ERR, "block backward", "forward");
  /* zero rows */
  tp_block_batch_t bz = {0, 0, NULL, NULL, 0, 1, NULL, NULL, 0};
  OK(tp_block_forward(b, P(T2(NULL, 0, BLK_C)), P(T2(NULL, 0, BLK_C)), &bz, NULL));
  OK(tp_block_backward(b, P(T2(NULL, 0, BLK_C)), P(T2(NULL, 0, BLK_C)), NULL));
  /* growing and shrinking M */
  static const int64_t Ts[] = {1, 9, 2, 16, 3};
  for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
    tp_block_batch_t bb = {2, Ts[i], NULL, NULL, 0, 1, NULL, NULL, 0};
    int64_t m = 2 * Ts[i];
    OK(tp_block_forward(b, P(T2(ya + 2048, m, BLK_C)), P(T2(xa, m, BLK_C)), &bb, NULL));
    OK(tp_block_backward(b, P(T2(ga, m, BLK_C)), P(T2(ya, m, BLK_C)), NULL));
    ARG(tp_block_backward(b, P(T2(ga, m + 2, BLK_C)), P(T2(ya, m + 2, BLK_C)), NULL), "block backward", NULL);
  }
  /* forward without need_backward: backward refused */
  tp_block_batch_t nb = {1, M, NULL, NULL, 0, 0, NULL, NULL, 0};
  OK(tp_block_forward(b, &y, &x, &nb, NULL));
  BAD(tp_block_backward(b, &dx, &dy, NULL), ANY_ERR, "block backward", NULL);
  OK(tp_block_forward(b, &y, &x, &bt, NULL));
  {
    tp_tensor t[] = {with_data(dy, NULL),
                     with_dtype(dy, TP_INT32),
                     with_ndim(dy, 9),
                     with_ndim(dy, -1),
                     as3d(dy),
                     with_shape(dy, 1, BLK_C - 1),
                     with_shape(dy, 0, INT64_MIN),
                     with_stride(dy, 1, 3),
                     with_dev(dy, TP_DEVICE_CUDA, 0),
                     with_dev(dy, (tp_device_t)99, 0)};
    for (size_t j = 0; j < sizeof t / sizeof t[0]; j++) {
      BAD(tp_block_backward(b, &dx, &t[j], NULL), ANY_ERR, "block backward", "dy");
      BAD(tp_block_backward(b, &t[j], &dy, NULL), ANY_ERR, "block backward", "dx");
    }
  }
  ARG(tp_block_backward(NULL, &dx, &dy, NULL), "block backward", NULL);
}

/* The KV cache: hostile sizes and positions, shrinking and growing. */
static void block_bad_cache(tp_block_t b) {
  tp_block_info_t info;
  /* the cache */
  ARG(tp_block_cache(b, 0, 8), "block", "batch");
  ARG(tp_block_cache(b, -1, 8), "block", "batch");
  ARG(tp_block_cache(b, 1, 0), "block", "max_len");
  ARG(tp_block_cache(b, 1, INT64_MAX), "block", "max_len");
  ARG(tp_block_cache(b, INT64_MAX, 1), "block", "batch");
  ARG(tp_block_cache(b, (int64_t)1 << 31, 1), "block", "batch");
  ARG(tp_block_cache(b, INT_MAX, INT_MAX), "block", NULL); /* 2^62 x nk x BLK_D floats */
  ARG(tp_block_cache(NULL, 1, 8), "block", NULL);
  OK(tp_block_cache(b, 2, 8));
  tp_block_batch_t cb = {2, 3, NULL, NULL, 1, 0, NULL, NULL, 0};
  int64_t p0[2] = {0, 0};
  cb.pos0 = p0;
  OK(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cb, NULL));
  p0[0] = 6; /* 6 + 3 > max_len 8 */
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cb, NULL), "block forward", NULL);
  p0[0] = -1;
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cb, NULL), "block forward", "pos0");
  p0[0] = INT64_MAX;
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cb, NULL), "block forward", "pos0");
  p0[0] = 3;
  tp_block_batch_t cb3 = {3, 2, NULL, NULL, 1, 0, NULL, NULL, 0}; /* more sequences than the cache holds */
  int64_t p3[3] = {0, 0, 0};
  cb3.pos0 = p3;
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cb3, NULL), "block forward", NULL);
  uint8_t mask[6] = {1, 1, 1, 1, 1, 1};
  tp_block_batch_t cm = cb;
  cm.key_mask = mask; /* key_mask with the cache: refused */
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cm, NULL), "block forward", "key_mask");
  tp_block_batch_t cbb = cb;
  cbb.need_backward = 1;
  p0[0] = 0, p0[1] = 0;
  tp_status_t cst = tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cbb, NULL);
  if (cst != TP_SUCCESS) BAD(cst, ANY_ERR, "block forward", "cache");
  /* the cache shrinks and grows (reallocated, contents reset) */
  OK(tp_block_cache(b, 1, 2));
  OK(tp_block_info(b, &info));
  TRUE(info.cache_batch == 1 && info.cache_len == 2);
  OK(tp_block_cache(b, 4, 32));
  OK(tp_block_info(b, &info));
  TRUE(info.cache_batch == 4 && info.cache_len == 32 && info.cache_block_size == 0);
  /* a block table without a paged cache, then the paged cache's own refusals */
  int64_t tab[4] = {0, 1, 2, 3};
  tp_block_batch_t pb = cb;
  p0[0] = 0, p0[1] = 0;
  pb.block_table = tab, pb.block_cols = 2;
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL), "block forward", "block_table");
  ARG(tp_block_cache_paged(b, 0, 4), "block cache_paged", "num_blocks");
  ARG(tp_block_cache_paged(b, 4, 0), "block cache_paged", "block_size");
  ARG(tp_block_cache_paged(b, INT_MAX, INT_MAX), "block cache_paged", NULL);
  ARG(tp_block_cache_paged(NULL, 4, 4), "block cache_paged", NULL);
  OK(tp_block_cache_paged(b, 4, 2));
  OK(tp_block_info(b, &info));
  TRUE(info.cache_batch == 4 && info.cache_len == 2 && info.cache_block_size == 2);
  OK(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL)); /* rows 0-1 of blocks 0, 1 and 2, 3 */
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &cb, NULL), "block forward", "block_table");
  tab[3] = 4; /* outside the pool */
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL), "block forward", "block_table");
  tab[3] = 0; /* block 0 row 0 written twice */
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL), "block forward", "row 0 of KV block 0");
  tab[3] = 3, p0[1] = 2; /* 2 + 3 positions past 2 x 2 */
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL), "block forward", "block_table");
  tab[2] = tab[3] = -1; /* a padding row: nothing to cover */
  OK(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL));
  pb.block_cols = 0;
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL), "block forward", "block_cols");
  int64_t sl[2] = {0, 1};
  pb.block_cols = 2, pb.slots = sl;
  ARG(tp_block_forward(b, P(T2(ya, 6, BLK_C)), P(T2(xa, 6, BLK_C)), &pb, NULL), "block forward", "slots");
  OK(tp_block_cache(b, 4, 32)); /* back to a cache of sequences */
}

/* The families' options: out of range, inconsistent with the rest, or NaN. */
static void block_bad_family_configs(tp_comm_t comm) {
  tp_block_config_t cfg = block_config(), c2;
  tp_block_t b = NULL;
  float nan = NAN, freq[64];
  for (int i = 0; i < 64; i++) freq[i] = 1.0f / (float)(i + 1);
  c2 = cfg, c2.bias_parts = TP_BIAS_QKV; /* without TP_BIAS_SET */
  ARG(tp_block_create(&b, comm, &c2), "block", "bias_parts");
  c2 = cfg, c2.bias_parts = 64 | TP_BIAS_SET;
  ARG(tp_block_create(&b, comm, &c2), "block", "bias_parts");
  c2 = cfg, c2.qk_norm = 1, c2.norm = TP_NORM_LAYER;
  ARG(tp_block_create(&b, comm, &c2), "block", "qk_norm");
  c2 = cfg, c2.post_norms = 1, c2.pre_norm = 0;
  ARG(tp_block_create(&b, comm, &c2), "block", "post_norms");
  c2 = cfg, c2.post_norms = 1, c2.attention_only = 1;
  ARG(tp_block_create(&b, comm, &c2), "block", "post_norms");
  c2 = cfg, c2.attn_softcap = nan;
  ARG(tp_block_create(&b, comm, &c2), "block", "attn_softcap");
  c2 = cfg, c2.attn_scale = -1.0f;
  ARG(tp_block_create(&b, comm, &c2), "block", "attn_scale");
  c2 = cfg, c2.attn_softcap = INFINITY;
  ARG(tp_block_create(&b, comm, &c2), "block", "attn_softcap");
  c2 = cfg, c2.sliding_window = -1;
  ARG(tp_block_create(&b, comm, &c2), "block", "sliding_window");
  c2 = cfg, c2.sliding_window = 4, c2.causal = 0;
  ARG(tp_block_create(&b, comm, &c2), "block", "causal");
  c2 = cfg, c2.rope_theta = 0.0f, c2.rope_inv_freq = freq;
  ARG(tp_block_create(&b, comm, &c2), "block", "rotary");
  c2 = cfg, c2.rope_theta = 1e4f, c2.rope_factor = nan;
  ARG(tp_block_create(&b, comm, &c2), "block", "rope_factor");
  freq[1] = nan;
  c2 = cfg, c2.rope_theta = 1e4f, c2.rope_inv_freq = freq;
  ARG(tp_block_create(&b, comm, &c2), "block", "rope_inv_freq[1]");
  freq[1] = -1.0f;
  ARG(tp_block_create(&b, comm, &c2), "block", "rope_inv_freq[1]");
  freq[1] = 0.5f;
  c2 = cfg, c2.rope_theta = 1e4f, c2.rope_inv_freq = freq, c2.rope_factor = 1.5f;
  OK(tp_block_create(&b, comm, &c2));
  if (b) {
    ARG(tp_block_set_rope(b, freq, 0.0f), "set_rope", "factor");
    ARG(tp_block_set_rope(b, freq, nan), "set_rope", "factor");
    freq[0] = INFINITY;
    ARG(tp_block_set_rope(b, freq, 1.0f), "set_rope", "inv_freq[0]");
    OK(tp_block_set_rope(b, NULL, 1.0f));
    tp_block_destroy(b);
    b = NULL;
  }
  c2 = cfg, c2.rope_theta = 0.0f;
  OK(tp_block_create(&b, comm, &c2));
  if (b) {
    ARG(tp_block_set_rope(b, NULL, 2.0f), "set_rope", "rotary");
    tp_block_destroy(b);
  }
  ARG(tp_block_set_rope(NULL, NULL, 1.0f), "set_rope", "block");
}

void test_block(tp_comm_t comm) {
  block_bad_configs(comm);
  block_bad_family_configs(comm);
  tp_block_config_t cfg = block_config();
  tp_block_t b = NULL;
  cfg.rope_theta = 1e4f;
  OK(tp_block_create(&b, comm, &cfg));
  if (!b) return;
  block_bad_calls(b);
  block_bad_cache(b);
  tp_block_destroy(b);
  tp_block_destroy(NULL);
  printf("block: done\n");
}
