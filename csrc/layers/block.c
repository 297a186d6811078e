/* The tensor-parallel Transformer block (see tpcore/layers.h): norms, attention with
 * this rank's heads (attention.c), the parallel MLP, residuals; a KV cache for decoding. */
#include <limits.h>
#include <math.h>

#include "block_impl.h"
#include "layer_kernels.h"

void tp_block_destroy(tp_block_t k) {
  if (!k) return;
  tp_parallel_mlp_destroy(k->mlp);
  tp_parallel_linear_destroy(k->out);
  tp_reg_release(&k->red);
  tp_reg_release(&k->kvred);
  tp_reg_release(&k->qkred);
  tp_arena_release(&k->params);
  tp_arena_release(&k->grads);
  tp_arena_release(&k->ws);
  tp_block_cache_release(k);
  tp_arena_release(&k->lpws);
  tp_arena_release(&k->ropet);
  tp_workspace_destroy(k->shared);
  tp_host_free(k);
}

static int finite_nonneg(float v) { return isfinite(v) && v >= 0.0f; }

/* The families' options: each in range and consistent with the rest of the config. */
static tp_status_t check_families(const tp_block_config_t *cfg) {
  if (cfg->bias_parts &&
      (cfg->bias_parts & ~(TP_BIAS_QKV | TP_BIAS_OUT | TP_BIAS_MLP | TP_BIAS_SET) || !(cfg->bias_parts & TP_BIAS_SET)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block: bias_parts must be 0 or TP_BIAS_SET with TP_BIAS_QKV/OUT/MLP bits, got %d",
                        cfg->bias_parts);
  if (cfg->qk_norm && cfg->norm != TP_NORM_RMS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: qk_norm needs the RMS norm (norm = TP_NORM_RMS)");
  if (cfg->post_norms && (!cfg->pre_norm || cfg->attention_only))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: post_norms need a pre-norm block with its MLP");
  if (!finite_nonneg(cfg->attn_scale) || !finite_nonneg(cfg->attn_softcap) || !finite_nonneg(cfg->rope_factor) ||
      !isfinite(cfg->rope_theta))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block: attn_scale (%g), attn_softcap (%g) and rope_factor (%g) must be finite and >= 0 "
                        "(0: off), rope_theta (%g) finite",
                        (double)cfg->attn_scale, (double)cfg->attn_softcap, (double)cfg->rope_factor,
                        (double)cfg->rope_theta);
  if (cfg->sliding_window < 0 || (cfg->sliding_window > 0 && !cfg->causal))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block: sliding_window must be >= 0 (0: none) and needs causal attention, got %lld",
                        (long long)cfg->sliding_window);
  if ((cfg->rope_inv_freq || cfg->rope_factor > 0) && !(cfg->rope_theta > 0))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block: rope_inv_freq and rope_factor need rotary positions (rope_theta > 0)");
  for (int64_t i = 0; cfg->rope_inv_freq && i < cfg->head_dim / 2; i++)
    if (!finite_nonneg(cfg->rope_inv_freq[i]))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: rope_inv_freq[%lld] = %g is not finite and >= 0",
                          (long long)i, (double)cfg->rope_inv_freq[i]);
  return TP_SUCCESS;
}

static tp_status_t check_config(const tp_block_config_t *cfg) {
  for (int i = 0; i < 4; i++)
    TP_CHECK(tp_lk_check_wdtype("block", cfg->weight_dtypes_set ? cfg->weight_dtypes[i] : cfg->weight_dtype));
  int64_t C = cfg->hidden, H = cfg->heads, Hk = cfg->kv_heads ? cfg->kv_heads : cfg->heads, D = cfg->head_dim;
  if (C < 1 || H < 1 || D < 1 || (cfg->ffn_hidden < 1 && !cfg->attention_only))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: hidden, heads, head_dim and ffn_hidden must be >= 1");
  if (Hk < 1 || Hk > H || H % Hk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: heads (%lld) must be a multiple of kv_heads (%lld)",
                        (long long)H, (long long)Hk);
  if (cfg->rope_theta > 0 && D % 2)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: rotary positions need an even head_dim, got %lld",
                        (long long)D);
  if ((unsigned)cfg->norm > TP_NORM_RMS || (unsigned)cfg->activation > TP_ACT_LAST)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: unknown norm or activation");
  TP_CHECK(check_families(cfg));
  /* GEMM dimensions go to BLAS as 32-bit ints: hidden and the QKV width (heads + 2 kv_heads) x head_dim */
  int64_t qkv_w;
  if (C > INT_MAX / 4 || H > INT_MAX / 4 || Hk > INT_MAX / 4 || D > INT_MAX / 4 ||
      !tp_mul_count(H + 2 * Hk, D, &qkv_w) || qkv_w > INT_MAX / 4)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block: hidden (%lld) and (heads + 2 kv_heads) x head_dim ((%lld + "
                        "2 x %lld) x %lld) must each be at most %d (BLAS uses 32-bit dimensions)",
                        (long long)C, (long long)H, (long long)Hk, (long long)D, INT_MAX / 4);
  int64_t wel;
  if (!tp_numel2(qkv_w, C, &wel))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block: the QKV weight of %lld x %lld (hidden %lld, heads %lld, "
                        "kv_heads %lld, head_dim %lld) is too large: at most 2^40 elements",
                        (long long)qkv_w, (long long)C, (long long)C, (long long)H, (long long)Hk, (long long)D);
  return tp_layer_device("block", cfg->device, cfg->device_id);
}

/* The block's own parameters, in their arena order: [QKV weight (bytes) | QKV bias | norm1 w |
 * norm1 b | norm2 w | norm2 b | q_norm w | k_norm w | attn_post_norm w, b | mlp_post_norm w, b]. */
enum { NP = 12 };

/* Their sizes, and those of their gradients: [dQKV weight (none when quantized: frozen) | the
 * rest's].  A missing tensor has 0 elements; has[i]: whether tensor i exists (a shard of 0
 * heads has an empty QKV). */
static void param_sizes(tp_block_t k, size_t wbytes, int64_t n[NP], int64_t g[NP], int has[NP]) {
  int64_t C = k->C, D = k->D, W = k->W, b = k->qkv_bias, nb = k->cfg.norm == TP_NORM_LAYER;
  int64_t qk = k->cfg.qk_norm != 0, pn = k->cfg.post_norms != 0;
  int64_t v[NP] = {(int64_t)wbytes, b ? W : 0, C,      nb ? C : 0,  C,      nb ? C : 0,
                   qk * D,          qk * D,    pn * C, pn * nb * C, pn * C, pn * nb * C};
  int h[NP] = {!tp_weight_is_quantized(k->Wqkv.dt),
               (int)b,
               1,
               (int)nb,
               1,
               (int)nb,
               (int)qk,
               (int)qk,
               (int)pn,
               (int)(pn * nb),
               (int)pn,
               (int)(pn * nb)};
  for (int i = 0; i < NP; i++) n[i] = g[i] = v[i], has[i] = h[i];
  g[0] = h[0] ? W * C : 0;
}

/* The QKV shard, the norms: one allocation; seeded nn.Linear-style init from (seed, tensor,
 * index of the full tensor): the same logical block at every world size and head partition. */
static tp_status_t make_params(tp_block_t k) {
  int64_t C = k->C, D = k->D, H = k->H, Hk = k->Hk, W = k->W, b = k->qkv_bias;
  size_t total = 0, wbytes = 0;
  int64_t n[NP], g[NP];
  int has[NP];
  TP_CHECK(tp_lk_wbytes("block", "the QKV weight", k->Wqkv.dt, W, C, &wbytes));
  param_sizes(k, wbytes, n, g, has);
  for (int i = 0; i < NP; i++) tp_arena_add_n(&total, n[i], i == 0 ? 1 : sizeof(float)); /* bounded by check_config */
  tp_status_t st = tp_arena_reserve(&k->params, total, "parameters");
  if (st == TP_ERR_NOMEM) /* block_create prefixes "block" */
    return tp_set_error(st,
                        "out of memory for the parameters (a QKV shard of %lld x %lld in %s and the norms: %zu "
                        "bytes of %s memory)",
                        (long long)W, (long long)C, tp_dtype_name(k->Wqkv.dt), total, tp_device_name(k->params.device));
  TP_CHECK(st);
  float *wq = NULL;
  float **p[NP] = {&wq,     &k->bqkv, &k->n1w, &k->n1b, &k->n2w, &k->n2b,
                   &k->qnw, &k->knw,  &k->n3w, &k->n3b, &k->n4w, &k->n4b};
  for (int i = 0; i < NP; i++) {
    float *s = tp_arena_take_n(&k->params, n[i], i == 0 ? 1 : sizeof(float));
    *p[i] = has[i] || i == 0 ? s : NULL; /* biases only when the config has them */
  }
  k->Wqkv.p = wq;
  TP_CHECK(lk_zero(&k->lk, k->params.base, k->params.cap, NULL));
  /* the shard's rows [its Q heads | its K heads | its V heads]: three runs of whole rows of
   * the full [Q | K | V] weight (tensor 10) and bias (11) */
  float bq = 1.0f / sqrtf((float)C);
  int64_t row0[3] = {k->q0 * D, H * D + k->k0 * D, (H + Hk) * D + k->k0 * D},
          rows[3] = {k->nq * D, k->nk * D, k->nk * D};
  int64_t at = 0;
  for (int p = 0; p < 3; at += rows[p], p++) {
    TP_CHECK(
        lk_init_w(&k->lk, &k->Wqkv, at * C, rows[p] * C, C, 0, k->cfg.seed, 10, (uint64_t)(row0[p] * C), bq, NULL));
    if (b) TP_CHECK(lk_init_uniform(&k->lk, k->bqkv + at, rows[p], k->cfg.seed, 11, (uint64_t)row0[p], bq, NULL));
  }
  TP_CHECK(lk_fill(&k->lk, k->n1w, 1.0f, C, NULL));
  TP_CHECK(lk_fill(&k->lk, k->n2w, 1.0f, C, NULL));
  for (int i = 6; i < NP; i++) /* the families' norm weights: 1 (their biases 0) */
    if (has[i] && (i < 8 || i % 2 == 0)) TP_CHECK(lk_fill(&k->lk, *p[i], 1.0f, n[i], NULL));
  TP_CHECK(tp_device_sync(k->dev, k->dev_id, NULL));
  tp_arena_release(&k->lpws); /* the init scratch of a 16-bit QKV weight */
  return TP_SUCCESS;
}

tp_status_t tp_block_create(tp_block_t *out, tp_comm_t comm, const tp_block_config_t *cfg) {
  TP_NONNULL("block", out, "out");
  TP_NONNULL("block", comm, "comm");
  TP_NONNULL("block", cfg, "config");
  *out = NULL;
  if (cfg->size != sizeof(tp_block_config_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: config built for another tpcore version");
  TP_CHECK(check_config(cfg));
  int rank, world;
  tp_comm_rank(comm, &rank);
  tp_comm_size(comm, &world);
  tp_block_t k;
  size_t hbytes = sizeof *k + (size_t)(2 * world + 1) * sizeof(int64_t);
  TP_CHECK(tp_host_zalloc(hbytes, (void **)&k, "block"));
  k->out_part = (int64_t *)(k + 1);
  int64_t *hoff = k->out_part + world; /* world + 1 head offsets */
  k->comm = comm;
  k->cfg = *cfg;
  k->cfg.head_partition = k->cfg.ffn_partition = NULL;
  k->rank = rank, k->world = world;
  k->dev = cfg->device, k->dev_id = cfg->device_id;
  tp_arena_init(&k->params, k->dev, k->dev_id);
  tp_arena_init(&k->grads, k->dev, k->dev_id);
  tp_arena_init(&k->ws, k->dev, k->dev_id);
  tp_arena_init(&k->cache, k->dev, k->dev_id);
  tp_arena_init(&k->lpws, k->dev, k->dev_id);
  tp_dtype_t dts[4];
  for (int i = 0; i < 4; i++) dts[i] = cfg->weight_dtypes_set ? cfg->weight_dtypes[i] : cfg->weight_dtype;
  k->Wqkv.dt = dts[0];
  k->Wqkv.lpws = &k->lpws;
  tp_status_t st = tp_lk_init(&k->lk, "block", k->dev, k->dev_id);
  if (st != TP_SUCCESS) {
    tp_block_destroy(k);
    return st;
  }
  int64_t C = cfg->hidden, H = cfg->heads, Hk = cfg->kv_heads ? cfg->kv_heads : cfg->heads, D = cfg->head_dim;
  k->C = C, k->D = D, k->H = H, k->Hk = Hk, k->group = H / Hk;
  int parts = cfg->bias_parts ? cfg->bias_parts : (cfg->bias ? TP_BIAS_QKV | TP_BIAS_OUT | TP_BIAS_MLP : 0);
  k->qkv_bias = (parts & TP_BIAS_QKV) != 0, k->out_bias = (parts & TP_BIAS_OUT) != 0;
  k->mlp_bias = (parts & TP_BIAS_MLP) != 0;
  k->cfg.rope_inv_freq = NULL; /* the caller's array: copied below */
  tp_arena_init(&k->ropet, k->dev, k->dev_id);
  st = tp_block_set_rope(k, cfg->rope_inv_freq, cfg->rope_factor > 0 ? cfg->rope_factor : 1.0f);
  if (st != TP_SUCCESS) {
    tp_block_destroy(k);
    return st;
  }
  /* whole query heads per rank; the KV heads their groups use */
  st = tp_partition_sizes(H, world, cfg->head_partition, k->out_part, hoff, "block: head_partition", "heads");
  if (st != TP_SUCCESS) {
    tp_block_destroy(k);
    return st;
  }
  int64_t prev_end = -1;
  for (int p = 0; p < world; p++) {
    int64_t n = k->out_part[p], sum = hoff[p];
    if (n > 0) {
      int64_t kb = sum / k->group, ke = (sum + n - 1) / k->group + 1;
      if (kb < prev_end) k->kv_replicated = 1;
      prev_end = ke;
      if (p == rank) k->k0 = kb, k->nk = ke - kb;
    }
    k->out_part[p] = n * D; /* the output projection's columns (bounded: H x D <= INT_MAX / 4) */
  }
  k->q0 = hoff[rank], k->nq = k->out_part[rank] / D;
  k->W = (k->nq + 2 * k->nk) * D;
  k->A = k->nq * D;
  st = make_params(k);
  /* the output projection: row parallel over the heads, input_is_parallel, nn.Linear init
   * with the block's own tensor ids (12, 13) */
  tp_linear_config_t oc = TP_LINEAR_CONFIG_INITIALIZER;
  oc.kind = TP_ROW_PARALLEL;
  oc.in_features = H * D;
  oc.out_features = C;
  oc.bias = k->out_bias;
  oc.input_is_parallel = 1;
  oc.partition = k->out_part;
  oc.seed = cfg->seed;
  oc.device = cfg->device;
  oc.device_id = cfg->device_id;
  oc.weight_dtype = dts[1];
  if (st == TP_SUCCESS) st = tp_parallel_linear_create_ids(&k->out, comm, &oc, 12, 13);
  if (st == TP_SUCCESS) tp_parallel_linear_set_region(k->out, "attention"); /* its all-reduce: the attention's */
  if (st == TP_SUCCESS && !cfg->attention_only) {
    tp_mlp_config_t mc = TP_MLP_CONFIG_INITIALIZER;
    mc.hidden = C;
    mc.ffn_hidden = cfg->ffn_hidden;
    mc.activation = cfg->activation;
    mc.bias = k->mlp_bias;
    mc.partition = cfg->ffn_partition;
    mc.seed = cfg->seed + 100;
    mc.device = cfg->device;
    mc.device_id = cfg->device_id;
    mc.weight_dtype = dts[2];
    mc.weight_dtypes_set = 1;
    mc.weight_dtypes[0] = dts[2], mc.weight_dtypes[1] = dts[3];
    st = tp_parallel_mlp_create(&k->mlp, comm, &mc);
  }
  if (st != TP_SUCCESS) {
    tp_error_prefix("block");
    tp_block_destroy(k);
    return st;
  }
  *out = k;
  return TP_SUCCESS;
}

tp_status_t tp_block_set_rope(tp_block_t k, const float *inv_freq, float factor) {
  TP_NONNULL("block set_rope", k, "block");
  if (!(k->cfg.rope_theta > 0) && (inv_freq || factor != 1.0f))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block set_rope: the block has no rotary positions");
  if (!isfinite(factor) || !(factor > 0))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block set_rope: factor must be finite and > 0, got %g",
                        (double)factor);
  int64_t half = k->D / 2;
  for (int64_t i = 0; inv_freq && i < half; i++)
    if (!finite_nonneg(inv_freq[i]))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block set_rope: inv_freq[%lld] = %g is not finite and >= 0",
                          (long long)i, (double)inv_freq[i]);
  k->rope_factor = factor;
  if (!inv_freq) {
    k->rope_freq = NULL;
    return TP_SUCCESS;
  }
  if (!k->ropet.base) TP_CHECK(tp_arena_reserve(&k->ropet, (size_t)half * sizeof(float), "block rope frequencies"));
  k->rope_freq = (float *)k->ropet.base;
  TP_CHECK(tp_device_copy(k->dev, k->rope_freq, TP_DEVICE_CPU, inv_freq, (size_t)half * sizeof(float), NULL));
  return tp_device_sync(k->dev, k->dev_id, NULL);
}

/* The block's own gradients (QKV, norms), zeroed: one allocation, on demand. */
static tp_status_t ensure_grads(tp_block_t k) {
  if (k->grads.base) return TP_SUCCESS;
  size_t total = 0, wbytes = 0;
  int64_t n[NP], g[NP];
  int has[NP];
  TP_CHECK(tp_lk_wbytes("block", "the QKV weight", k->Wqkv.dt, k->W, k->C, &wbytes)); /* checked at create */
  param_sizes(k, wbytes, n, g, has);
  for (int i = 0; i < NP; i++)
    if (!tp_arena_add_n(&total, g[i], sizeof(float)))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "the gradients of a QKV shard of %lld x %lld overflow a "
                          "size",
                          (long long)k->W, (long long)k->C);
  tp_status_t st = tp_arena_reserve(&k->grads, total, "gradients");
  if (st == TP_SUCCESS) st = lk_zero(&k->lk, k->grads.base, k->grads.cap, NULL);
  if (st == TP_SUCCESS) st = tp_device_sync(k->dev, k->dev_id, NULL);
  if (st != TP_SUCCESS) {
    tp_arena_release(&k->grads);
    if (st != TP_ERR_NOMEM) return st;
    return tp_set_error(TP_ERR_NOMEM,
                        "out of memory for the gradients of the QKV shard (%lld x %lld) and the "
                        "norms (%zu bytes of %s memory)",
                        (long long)k->W, (long long)k->C, total, tp_device_name(k->dev));
  }
  float **p[NP] = {&k->dwqkv, &k->dbqkv, &k->dn1w, &k->dn1b, &k->dn2w, &k->dn2b,
                   &k->dqnw,  &k->dknw,  &k->dn3w, &k->dn3b, &k->dn4w, &k->dn4b};
  for (int i = 0; i < NP; i++) {
    float *s = tp_arena_take_n(&k->grads, g[i], sizeof(float));
    *p[i] = has[i] ? s : NULL; /* a quantized QKV weight (frozen) and missing biases have none */
  }
  return TP_SUCCESS;
}

tp_status_t tp_block_alloc_grads(tp_block_t k) {
  TP_NONNULL("block alloc_grads", k, "block");
  tp_status_t st = ensure_grads(k);
  if (st == TP_SUCCESS) st = tp_parallel_linear_alloc_grads(k->out);
  if (st == TP_SUCCESS && k->mlp) st = tp_parallel_mlp_alloc_grads(k->mlp);
  if (st != TP_SUCCESS) tp_error_prefix("block");
  return st;
}

tp_status_t tp_block_info(tp_block_t k, tp_block_info_t *info) {
  TP_NONNULL("block", k, "block");
  TP_NONNULL("block", info, "info");
  info->q0 = k->q0, info->nq = k->nq, info->k0 = k->k0, info->nk = k->nk;
  info->cache_batch = k->cb, info->cache_len = k->clen;
  info->kv_replicated = k->kv_replicated;
  info->cache_block_size = k->paged ? k->crows : 0;
  return TP_SUCCESS;
}

int tp_block_params(tp_block_t k, tp_param_t *out, int max) {
  if (!k) return 0;
  tp_linear_info_t o, f1, f2;
  memset(&f1, 0, sizeof f1);
  memset(&f2, 0, sizeof f2);
  tp_parallel_linear_info(k->out, &o);
  if (k->mlp) {
    tp_parallel_linear_info(tp_parallel_mlp_layer(k->mlp, 0), &f1);
    tp_parallel_linear_info(tp_parallel_mlp_layer(k->mlp, 1), &f2);
  }
  tp_param_t all[] = {
      {"norm1.weight", k->n1w, k->dn1w, 1, k->C, 0, TP_FLOAT32},
      {"norm1.bias", k->n1b, k->dn1b, 1, k->C, 0, TP_FLOAT32},
      {"attn.qkv.weight", k->Wqkv.p, k->dwqkv, 2, k->W, k->C, k->Wqkv.dt},
      {"attn.qkv.bias", k->bqkv, k->dbqkv, 1, k->W, 0, TP_FLOAT32},
      {"attn.out.weight", o.weight, o.grad_weight, 2, o.weight_rows, o.weight_cols, o.weight_dtype},
      {"attn.out.bias", o.bias, o.grad_bias, 1, o.bias_len, 0, TP_FLOAT32},
      {"norm2.weight", k->n2w, k->dn2w, 1, k->C, 0, TP_FLOAT32},
      {"norm2.bias", k->n2b, k->dn2b, 1, k->C, 0, TP_FLOAT32},
      {"attn.q_norm.weight", k->qnw, k->dqnw, 1, k->D, 0, TP_FLOAT32},
      {"attn.k_norm.weight", k->knw, k->dknw, 1, k->D, 0, TP_FLOAT32},
      {"attn_post_norm.weight", k->n3w, k->dn3w, 1, k->C, 0, TP_FLOAT32},
      {"attn_post_norm.bias", k->n3b, k->dn3b, 1, k->C, 0, TP_FLOAT32},
      {"mlp_post_norm.weight", k->n4w, k->dn4w, 1, k->C, 0, TP_FLOAT32},
      {"mlp_post_norm.bias", k->n4b, k->dn4b, 1, k->C, 0, TP_FLOAT32},
      {"mlp.fc1.weight", f1.weight, f1.grad_weight, 2, f1.weight_rows, f1.weight_cols, f1.weight_dtype},
      {"mlp.fc1.bias", f1.bias, f1.grad_bias, 1, f1.bias_len, 0, TP_FLOAT32},
      {"mlp.fc2.weight", f2.weight, f2.grad_weight, 2, f2.weight_rows, f2.weight_cols, f2.weight_dtype},
      {"mlp.fc2.bias", f2.bias, f2.grad_bias, 1, f2.bias_len, 0, TP_FLOAT32},
  };
  int n = 0;
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    if (!all[i].data || (k->cfg.attention_only && strncmp(all[i].name, "attn.", 5) != 0)) continue;
    if (n < max) out[n] = all[i];
    n++;
  }
  return n;
}

/* This forward's workspaces, one arena: activations for M rows, the positions of B
 * sequences, the key mask, the attention probabilities (B x nq x T x T) and the KV
 * snapshot when backward may follow, the attention kernels' scratch.  A forward without
 * need_backward takes no gradient buffers, and its MLP activations come from here too; it
 * carves the shared workspace when the block has one (tp_block_set_workspace). */
static tp_status_t workspaces(tp_block_t k, int64_t M, int64_t B, int64_t T, int use_cache, int need_backward) {
  int64_t C = k->C, W = k->W, A = k->A, bw = need_backward != 0, f1 = 0, f = 0;
  int64_t qh = k->cfg.qk_norm ? k->nq + k->nk : 0, pn = k->cfg.post_norms != 0;
  if (k->mlp && !bw) tp_parallel_mlp_widths(k->mlp, &f1, &f);
  float **fp[] = {&k->xs,    &k->s1,     &k->h1,    &k->s2,    &k->n1,    &k->n2,    &k->mo,     &k->dn,      &k->dh,
                  &k->dt,    &k->qkv,    &k->dqkv,  &k->ao,    &k->dao,   &k->mean1, &k->rstd1,  &k->mean2,   &k->rstd2,
                  &k->probs, &k->kvsnap, &k->mh,    &k->ma,    &k->qkin,  &k->qkout, &k->qkrstd, &k->qknsnap, &k->ra,
                  &k->pa,    &k->pm,     &k->mean3, &k->rstd3, &k->mean4, &k->rstd4};
  int64_t nf[] = {M * C,
                  M * C,
                  M * C,
                  M * C,
                  M * C,
                  M * C,
                  M * C,
                  bw * M * C,
                  bw * M * C,
                  bw * M * C,
                  M * W,
                  bw * M * W,
                  M * A,
                  bw * M * A,
                  M,
                  M,
                  M,
                  M,
                  bw ? tp_block_attention_kept(k, B, T) : 0, /* probs or lse */
                  bw && k->kv_replicated ? 2 * k->nk * k->D * (C + 1) : 0,
                  M * f1,
                  M * f,
                  M * qh * k->D,
                  M * qh * k->D,
                  M * qh,
                  bw * (qh ? 2 * k->D : 0),
                  bw * pn * M * C,
                  pn * M * C,
                  pn * M * C,
                  pn * M,
                  pn * M,
                  pn * M,
                  pn * M};
  enum { NF = sizeof nf / sizeof nf[0] };
  size_t abytes = tp_block_attention_workspace(k, B, T, use_cache, need_backward), total = 0;
  for (int i = 0; i < NF; i++)
    if (!tp_arena_add_n(&total, nf[i], sizeof(float)))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: %lld rows overflow a workspace size", (long long)M);
  tp_arena_add_n(&total, M, sizeof(int64_t));
  tp_arena_add_n(&total, B, sizeof(int64_t));
  tp_arena_add_n(&total, B, sizeof(int64_t));
  tp_arena_add_n(&total, B, sizeof(int64_t));
  tp_arena_add_n(&total, M, 1);
  if (k->bcols) tp_arena_add_n(&total, B * k->bcols, sizeof(int64_t)); /* the block table: B x cols <= 2^40 */
  if (!tp_arena_add(&total, abytes))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block: the attention workspace overflows a size");
  tp_arena_t *ws = !bw && k->shared ? &k->shared->arena : &k->ws;
  TP_CHECK(tp_arena_reserve(ws, total, "block"));
  for (int i = 0; i < NF; i++) *fp[i] = tp_arena_take_n(ws, nf[i], sizeof(float));
  k->pos = tp_arena_take_n(ws, M, sizeof(int64_t));
  k->pos0 = tp_arena_take_n(ws, B, sizeof(int64_t));
  k->klen = tp_arena_take_n(ws, B, sizeof(int64_t));
  k->slot = tp_arena_take_n(ws, B, sizeof(int64_t));
  k->mask = tp_arena_take_n(ws, M, 1);
  k->btab = k->bcols ? tp_arena_take_n(ws, B * k->bcols, sizeof(int64_t)) : NULL;
  k->attn_ws = tp_arena_take(ws, abytes);
  k->attn_ws_bytes = abytes;
  return TP_SUCCESS;
}

tp_status_t tp_workspace_create(tp_workspace_t *out, tp_device_t device, int device_id) {
  TP_NONNULL("workspace", out, "out");
  *out = NULL;
  TP_CHECK(tp_layer_device("workspace", device, device_id));
  tp_workspace_t w;
  TP_CHECK(tp_host_zalloc(sizeof *w, (void **)&w, "workspace"));
  tp_arena_init(&w->arena, device, device_id);
  w->refs = 1;
  *out = w;
  return TP_SUCCESS;
}

static void workspace_retain(tp_workspace_t w) { __atomic_add_fetch(&w->refs, 1, __ATOMIC_RELAXED); }

void tp_workspace_destroy(tp_workspace_t w) {
  if (!w || __atomic_sub_fetch(&w->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
  tp_arena_release(&w->arena);
  tp_reg_release(&w->out);
  tp_host_free(w);
}

tp_workspace_t tp_block_get_workspace(tp_block_t k) { return k ? k->shared : NULL; }

size_t tp_workspace_bytes(tp_workspace_t w) { return w ? w->arena.cap + w->out.cap : 0; }

tp_status_t tp_workspace_memory(tp_workspace_t w, tp_layer_memory_t *mem) {
  TP_NONNULL("workspace memory", w, "workspace");
  TP_CHECK(tp_memory_begin("workspace memory", mem, w->arena.device, w->arena.device_id));
  mem->workspace = w->arena.cap;
  mem->comm = w->out.cap;
  return TP_SUCCESS;
}

/* An inference forward's projections write their collective output into the shared buffer:
 * the block consumes each before the next is written (the out projection's r before the MLP).
 * Only blocks of the communicator that first used it (registered memory belongs to one). */
static void lend_out(tp_block_t k, int on) {
  tp_workspace_t w = k->shared;
  if (on && (!w || (w->comm && w->comm != k->comm))) return;
  if (on && !w->comm) w->comm = k->comm;
  reg_buf *rb = on ? &w->out : NULL;
  tp_parallel_linear_borrow_out(k->out, rb);
  if (k->mlp) tp_parallel_linear_borrow_out(tp_parallel_mlp_layer(k->mlp, 1), rb);
}

tp_status_t tp_block_set_workspace(tp_block_t k, tp_workspace_t w) {
  TP_NONNULL("block set_workspace", k, "block");
  if (w && (w->arena.device != k->dev || w->arena.device_id != k->dev_id))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "block set_workspace: the workspace is on %s:%d, the block on %s:%d",
                        tp_device_name(w->arena.device), w->arena.device_id, tp_device_name(k->dev), k->dev_id);
  if (w) workspace_retain(w);
  tp_workspace_destroy(k->shared);
  k->shared = w;
  k->ready = 0; /* the last forward's activations may have lived in the old one */
  return TP_SUCCESS;
}

static tp_status_t norm_fwd(tp_block_t k, float *y, float *mean, float *rstd, const float *x, const float *w,
                            const float *b, int64_t M, tp_stream_t s) {
  if (k->cfg.norm == TP_NORM_RMS) return lk_rmsnorm_forward(&k->lk, y, rstd, x, w, M, k->C, k->cfg.eps, s);
  return lk_layernorm_forward(&k->lk, y, mean, rstd, x, w, b, M, k->C, k->cfg.eps, s);
}

static tp_status_t norm_bwd(tp_block_t k, float *dx, float *dw, float *db, const float *dy, const float *x,
                            const float *w, const float *mean, const float *rstd, int64_t M, tp_stream_t s) {
  if (k->cfg.norm == TP_NORM_RMS) return lk_rmsnorm_backward(&k->lk, dx, dw, dy, x, w, rstd, M, k->C, s);
  return lk_layernorm_backward(&k->lk, dx, dw, db, dy, x, w, mean, rstd, M, k->C, s);
}

/* The metadata of the batch onto the device: pos0 (host, or 0), then the positions of every
 * row and the keys per sequence from it; the key mask; the cache slots. */
static tp_status_t batch_metadata(tp_block_t k, const tp_block_batch_t *bt, int64_t B, int64_t T, tp_stream_t s) {
  if (bt->pos0) TP_CHECK(tp_device_copy(k->dev, k->pos0, TP_DEVICE_CPU, bt->pos0, (size_t)B * sizeof(int64_t), s));
  else TP_CHECK(lk_zero(&k->lk, k->pos0, (size_t)B * sizeof(int64_t), s));
  TP_CHECK(lk_positions(&k->lk, k->pos, k->klen, k->pos0, B, T, s));
  k->have_mask = bt->key_mask != NULL;
  if (k->have_mask) TP_CHECK(tp_device_copy(k->dev, k->mask, TP_DEVICE_CPU, bt->key_mask, (size_t)(B * T), s));
  k->have_slots = bt->slots != NULL && B > 0; /* checked: only with use_cache */
  if (k->have_slots)
    TP_CHECK(tp_device_copy(k->dev, k->slot, TP_DEVICE_CPU, bt->slots, (size_t)B * sizeof(int64_t), s));
  k->have_table = bt->block_table != NULL && B > 0; /* checked: exactly with a paged cache and use_cache */
  if (k->have_table)
    TP_CHECK(
        tp_device_copy(k->dev, k->btab, TP_DEVICE_CPU, bt->block_table, (size_t)(B * k->bcols) * sizeof(int64_t), s));
  return TP_SUCCESS;
}

/* mo = MLP(x): keeping what backward needs, or in the inference workspace */
static tp_status_t mlp_forward(tp_block_t k, const float *x, int need_backward, int64_t M, tp_stream_t s) {
  if (need_backward) return tp_parallel_mlp_forward_raw(k->mlp, k->mo, x, M, s);
  return tp_parallel_mlp_forward_nograd(k->mlp, k->mo, x, M, k->mh, k->ma, s);
}

static tp_status_t forward_impl(tp_block_t k, float *y, const float *x, const tp_block_batch_t *bt, tp_stream_t s) {
  int64_t B = bt->B, T = bt->T, M = B * T, C = k->C;
  size_t nb = (size_t)(M * C) * sizeof(float);
  if (M == 0) B = T = 0; /* an empty batch (2^40 sequences of 0 tokens ...) needs no per-sequence workspace */
  k->ready = 0;
  k->bcols = bt->block_table && B > 0 ? bt->block_cols : 0; /* the attention's Tk: bcols x block size */
  tp_status_t st = workspaces(k, M, B, T, bt->use_cache, bt->need_backward);
  if (st != TP_SUCCESS) {
    tp_comm_abort(k->comm, tp_last_error()); /* the peers would wait in the all-reduce */
    return st;
  }
  k->B = B, k->T = T;
  TP_CHECK(batch_metadata(k, bt, B, T, s));
  TP_CHECK(lk_copy(&k->lk, k->xs, x, nb, s));
  if (bt->need_backward) /* backward's QKV input gradient */
    TP_CHECK(tp_reg_ensure(k->comm, &k->red, nb, k->dev, k->dev_id));
  float *r;
  if (k->cfg.attention_only) {
    TP_CHECK(tp_block_attention_forward(k, &r, k->xs, bt->use_cache, bt->need_backward, s));
    TP_CHECK(lk_copy(&k->lk, y, r, nb, s));
  } else if (k->cfg.pre_norm && k->cfg.post_norms) { /* Gemma: norms on both branches' outputs too */
    TP_CHECK(norm_fwd(k, k->n1, k->mean1, k->rstd1, k->xs, k->n1w, k->n1b, M, s));
    TP_CHECK(tp_block_attention_forward(k, &r, k->n1, bt->use_cache, bt->need_backward, s));
    if (bt->need_backward) { /* r lives in the projection's collective buffer: kept for the norm's backward */
      TP_CHECK(lk_copy(&k->lk, k->ra, r, nb, s));
      r = k->ra;
    }
    TP_CHECK(norm_fwd(k, k->pa, k->mean3, k->rstd3, r, k->n3w, k->n3b, M, s));
    TP_CHECK(lk_add(&k->lk, k->h1, k->xs, k->pa, M * C, s));
    TP_CHECK(norm_fwd(k, k->n2, k->mean2, k->rstd2, k->h1, k->n2w, k->n2b, M, s));
    TP_CHECK(mlp_forward(k, k->n2, bt->need_backward, M, s));
    TP_CHECK(norm_fwd(k, k->pm, k->mean4, k->rstd4, k->mo, k->n4w, k->n4b, M, s));
    TP_CHECK(lk_add(&k->lk, y, k->h1, k->pm, M * C, s));
  } else if (k->cfg.pre_norm) {
    TP_CHECK(norm_fwd(k, k->n1, k->mean1, k->rstd1, k->xs, k->n1w, k->n1b, M, s));
    TP_CHECK(tp_block_attention_forward(k, &r, k->n1, bt->use_cache, bt->need_backward, s));
    TP_CHECK(lk_add(&k->lk, k->h1, k->xs, r, M * C, s));
    TP_CHECK(norm_fwd(k, k->n2, k->mean2, k->rstd2, k->h1, k->n2w, k->n2b, M, s));
    TP_CHECK(mlp_forward(k, k->n2, bt->need_backward, M, s));
    TP_CHECK(lk_add(&k->lk, y, k->h1, k->mo, M * C, s));
  } else {
    TP_CHECK(tp_block_attention_forward(k, &r, k->xs, bt->use_cache, bt->need_backward, s));
    TP_CHECK(lk_add(&k->lk, k->s1, k->xs, r, M * C, s));
    TP_CHECK(norm_fwd(k, k->h1, k->mean1, k->rstd1, k->s1, k->n1w, k->n1b, M, s));
    TP_CHECK(mlp_forward(k, k->h1, bt->need_backward, M, s));
    TP_CHECK(lk_add(&k->lk, k->s2, k->h1, k->mo, M * C, s));
    TP_CHECK(norm_fwd(k, y, k->mean2, k->rstd2, k->s2, k->n2w, k->n2b, M, s));
  }
  k->ready = bt->need_backward;
  if (bt->use_cache && T > 0 && k->paged) tp_block_paged_written(k, bt);
  else if (bt->use_cache && T > 0) /* the cache's high-water marks (tp_block_memory's cache_used) */
    for (int64_t b = 0; b < B; b++) {
      int64_t seq = bt->slots ? bt->slots[b] : b, end = (bt->pos0 ? bt->pos0[b] : 0) + T;
      if (end > k->kv_end[seq]) k->kv_end[seq] = end;
    }
  return TP_SUCCESS;
}

tp_status_t tp_block_forward(tp_block_t k, const tp_tensor *y, const tp_tensor *x, const tp_block_batch_t *bt,
                             tp_stream_t stream) {
  TP_NONNULL("block forward", k, "block");
  TP_CHECK(tp_check_stream("block forward", k->dev, stream));
  TP_NONNULL("block forward", bt, "batch");
  TP_NONNULL("block forward", x, "x");
  TP_NONNULL("block forward", y, "y");
  TP_CHECK(tp_block_check_batch(k, bt));
  int64_t M = bt->B * bt->T; /* checked */
  TP_CHECK(tp_check_matrix("block forward", "x", x, TP_FLOAT32, M, k->C, k->dev, k->dev_id, NULL));
  TP_CHECK(tp_check_matrix("block forward", "y", y, TP_FLOAT32, M, k->C, k->dev, k->dev_id, NULL));
  if (bt->need_backward) return forward_impl(k, y->data, x->data, bt, stream);
  lend_out(k, 1);
  tp_status_t st = forward_impl(k, y->data, x->data, bt, stream);
  lend_out(k, 0);
  return st;
}

static tp_status_t backward_impl(tp_block_t k, float *dx, const float *dy, tp_stream_t s) {
  int64_t M = k->B * k->T, C = k->C;
  if (k->cfg.attention_only) {
    TP_CHECK(lk_copy(&k->lk, k->dt, dy, (size_t)(M * C) * sizeof(float), s));
    return tp_block_attention_backward(k, dx, k->dt, k->xs, s);
  }
  if (k->cfg.pre_norm && k->cfg.post_norms) {
    TP_CHECK(norm_bwd(k, k->dt, k->dn4w, k->dn4b, dy, k->mo, k->n4w, k->mean4, k->rstd4, M, s)); /* d mlp out */
    TP_CHECK(tp_parallel_mlp_backward_raw(k->mlp, k->dn, k->dt, M, s));                          /* d norm2 out */
    TP_CHECK(norm_bwd(k, k->dt, k->dn2w, k->dn2b, k->dn, k->h1, k->n2w, k->mean2, k->rstd2, M, s));
    TP_CHECK(lk_add(&k->lk, k->dh, dy, k->dt, M * C, s));                                           /* d h1 */
    TP_CHECK(norm_bwd(k, k->dt, k->dn3w, k->dn3b, k->dh, k->ra, k->n3w, k->mean3, k->rstd3, M, s)); /* d attn */
    TP_CHECK(tp_block_attention_backward(k, k->dn, k->dt, k->n1, s));                               /* d norm1 out */
    TP_CHECK(norm_bwd(k, k->dt, k->dn1w, k->dn1b, k->dn, k->xs, k->n1w, k->mean1, k->rstd1, M, s));
    return lk_add(&k->lk, dx, k->dh, k->dt, M * C, s);
  }
  if (k->cfg.pre_norm) {
    TP_CHECK(tp_parallel_mlp_backward_raw(k->mlp, k->dn, dy, M, s)); /* d norm2 out */
    TP_CHECK(norm_bwd(k, k->dt, k->dn2w, k->dn2b, k->dn, k->h1, k->n2w, k->mean2, k->rstd2, M, s));
    TP_CHECK(lk_add(&k->lk, k->dh, dy, k->dt, M * C, s));             /* d h1 */
    TP_CHECK(tp_block_attention_backward(k, k->dn, k->dh, k->n1, s)); /* d norm1 out */
    TP_CHECK(norm_bwd(k, k->dt, k->dn1w, k->dn1b, k->dn, k->xs, k->n1w, k->mean1, k->rstd1, M, s));
    return lk_add(&k->lk, dx, k->dh, k->dt, M * C, s);
  }
  TP_CHECK(norm_bwd(k, k->dt, k->dn2w, k->dn2b, dy, k->s2, k->n2w, k->mean2, k->rstd2, M, s)); /* d s2 */
  TP_CHECK(tp_parallel_mlp_backward_raw(k->mlp, k->dn, k->dt, M, s));
  TP_CHECK(lk_add(&k->lk, k->dh, k->dt, k->dn, M * C, s));                                        /* d h1 */
  TP_CHECK(norm_bwd(k, k->dt, k->dn1w, k->dn1b, k->dh, k->s1, k->n1w, k->mean1, k->rstd1, M, s)); /* d s1 */
  TP_CHECK(tp_block_attention_backward(k, k->dn, k->dt, k->xs, s));
  return lk_add(&k->lk, dx, k->dt, k->dn, M * C, s);
}

tp_status_t tp_block_backward(tp_block_t k, const tp_tensor *dx, const tp_tensor *dy, tp_stream_t stream) {
  TP_NONNULL("block backward", k, "block");
  TP_CHECK(tp_check_stream("block backward", k->dev, stream));
  TP_NONNULL("block backward", dx, "dx");
  TP_NONNULL("block backward", dy, "dy");
  if (!k->ready)
    return tp_set_error(TP_ERR_INVALID_USAGE, "block backward: called before forward (with need_backward)");
  int64_t M = k->B * k->T, rows = 0;
  TP_CHECK(tp_check_matrix("block backward", "dy", dy, TP_FLOAT32, -1, k->C, k->dev, k->dev_id, &rows));
  if (rows != M)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block backward: dy has %lld rows but the last forward had %lld "
                        "(B * T = %lld x %lld)",
                        (long long)rows, (long long)M, (long long)k->B, (long long)k->T);
  TP_CHECK(tp_check_matrix("block backward", "dx", dx, TP_FLOAT32, M, k->C, k->dev, k->dev_id, NULL));
  tp_status_t st = tp_block_alloc_grads(k); /* the first backward makes them */
  if (st != TP_SUCCESS) {
    tp_comm_abort(k->comm, tp_last_error()); /* on this rank only: the peers would wait in a collective */
    return st;
  }
  return backward_impl(k, dx->data, dy->data, stream);
}

/* The QKV shard, the norms and their gradients (params, grads), the output projection's and
 * the MLP's memory, the activation arena (workspace), the KV cache (cache; cache_used: every
 * sequence's K and V rows up to its highest position written) and the collective buffers. */
tp_status_t tp_block_memory(tp_block_t k, tp_layer_memory_t *mem) {
  TP_NONNULL("block memory", k, "block");
  TP_CHECK(tp_memory_begin("block memory", mem, k->dev, k->dev_id));
  size_t wbytes = 0, c4 = (size_t)k->C * sizeof(float), w4 = (size_t)k->W * sizeof(float);
  tp_lk_wbytes("block memory", "the QKV weight", k->Wqkv.dt, k->W, k->C, &wbytes); /* checked at create */
  size_t d4 = (size_t)k->D * sizeof(float);
  mem->params = tp_mem_tensor(k->Wqkv.p, wbytes) + tp_mem_tensor(k->bqkv, w4) + tp_mem_tensor(k->n1w, c4) +
                tp_mem_tensor(k->n1b, c4) + tp_mem_tensor(k->n2w, c4) + tp_mem_tensor(k->n2b, c4) +
                tp_mem_tensor(k->qnw, d4) + tp_mem_tensor(k->knw, d4) + tp_mem_tensor(k->n3w, c4) +
                tp_mem_tensor(k->n3b, c4) + tp_mem_tensor(k->n4w, c4) + tp_mem_tensor(k->n4b, c4) +
                tp_mem_tensor(k->rope_freq, d4 / 2);
  mem->grads = tp_mem_tensor(k->dwqkv, (size_t)(k->W * k->C) * sizeof(float)) + tp_mem_tensor(k->dbqkv, w4) +
               tp_mem_tensor(k->dn1w, c4) + tp_mem_tensor(k->dn1b, c4) + tp_mem_tensor(k->dn2w, c4) +
               tp_mem_tensor(k->dn2b, c4) + tp_mem_tensor(k->dqnw, d4) + tp_mem_tensor(k->dknw, d4) +
               tp_mem_tensor(k->dn3w, c4) + tp_mem_tensor(k->dn3b, c4) + tp_mem_tensor(k->dn4w, c4) +
               tp_mem_tensor(k->dn4b, c4);
  mem->workspace = k->ws.cap + k->lpws.cap;
  mem->cache = k->cache.cap;
  int64_t used = 0;
  for (int64_t s = 0; k->kv_end && s < k->cb; s++) used += k->kv_end[s] < k->crows ? k->kv_end[s] : k->crows;
  mem->cache_used = (size_t)used * 2 * (size_t)(k->nk * k->D) * sizeof(float); /* K and V */
  mem->comm = k->red.cap + k->kvred.cap + k->qkred.cap;
  tp_layer_memory_t sub;
  sub.size = sizeof sub;
  TP_CHECK(tp_parallel_linear_memory(k->out, &sub));
  tp_memory_add(mem, &sub);
  if (k->mlp) {
    TP_CHECK(tp_parallel_mlp_memory(k->mlp, &sub));
    tp_memory_add(mem, &sub);
  }
  return TP_SUCCESS;
}
