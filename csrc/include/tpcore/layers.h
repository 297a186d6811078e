/*
 * Tensor-parallel layers (Megatron semantics), float32.  M = rows (tokens).
 *
 * Column parallel: W (out x in) split along out; rank r holds rows
 *   [offset, offset + local) of W and of b.  forward: y_r = x W_r^T + b_r, then
 *   (gather_output) all-gather along the last dimension.  backward: dx = sum over
 *   ranks of dy_r W_r (all-reduce: the conjugate of the identity at the entry).
 * Row parallel: W split along in; rank r holds columns [offset, offset + local).
 *   forward: y = all-reduce(x_r W_r^T) + b, bias added once after the reduce
 *   (x_r is this rank's slice of x: given as is when input_is_parallel, else cut
 *   from the full x).  backward: dx_r = dy W_r (all-gathered when the input was
 *   not parallel); the all-reduce's conjugate is the identity.
 * Backward accumulates into grad_weight / grad_bias and needs the last forward.
 * The layers keep their collective buffers in the communicator's registered
 * memory, so their all-reduce / all-gather take the zero-copy path; on a backend
 * without it (tp_comm_mem_alloc says TP_ERR_UNSUPPORTED, e.g. shm with
 * TPCORE_REGISTERED_MEMORY=0) they use plain device memory instead.
 * Initialisation: W and b ~ U(-1/sqrt(in), 1/sqrt(in)) (PyTorch nn.Linear),
 * drawn per element of the full tensor from (seed, tensor, index): a layer has
 * the same logical weights at every world size and partition.
 *
 * Devices and streams: every layer lives on one device (config .device/.device_id,
 * default the CPU; a device this process lacks is refused at create).  All its
 * bytes come from the device table (include/tpcore/device.h): parameters and
 * gradients in one allocation, workspaces in one arena grown only when a larger
 * batch arrives.  Calls take tp_tensor views on that device and a tp_stream_t
 * (NULL: the default stream; on the CPU every call has finished when it returns).
 * Activations are float32, 2-D [M, cols] and C-contiguous, M = shape[0]; token and
 * target ids are 1-D int64 [M].  A bad tensor is refused with an argument error
 * naming the call and the argument.
 * Shards split with tp_partition_sizes (include/tpcore/partition.h).
 *
 * Low-precision weights (config .weight_dtype = TP_BFLOAT16 / TP_FLOAT16; linear, MLP,
 * block projections, embedding table): the weight is stored in that dtype (half the
 * bytes: what decode reads per token), everything else stays float32 and every product
 * is accumulated in float32 (the CPU widens the weight, x stays float32; CUDA rounds x
 * and dy to the weight dtype for one tensor-core GEMM).  The weight holds the float32
 * layer's initial values rounded to nearest even.  Gradients are float32 ("main grads"):
 * mixed-precision training keeps float32 master weights and optimizer state outside the
 * layer (python/tpcore/optim.py) and writes the rounded master back (tp_convert).
 */
#ifndef TPCORE_LAYERS_H
#define TPCORE_LAYERS_H

#include "tpcore/comm.h"
#include "tpcore/device.h"
#include "tpcore/kernels.h"
#include "tpcore/partition.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_parallel_linear *tp_parallel_linear_t;

typedef enum { TP_COLUMN_PARALLEL = 0, TP_ROW_PARALLEL = 1 } tp_parallel_kind_t;

typedef struct {
  size_t size; /* sizeof(tp_linear_config_t) */
  tp_parallel_kind_t kind;
  int64_t in_features, out_features;
  int bias;                 /* 1: with bias                                    */
  int gather_output;        /* column: all-gather the output                   */
  int input_is_parallel;    /* row: x arrives already split                     */
  const int64_t *partition; /* world sizes of the split dimension; NULL: even   */
  uint64_t seed;
  int gated;          /* column: W is [gate; up] (2 * out_features rows); a rank
                                  holds its gate rows and its up rows and outputs
                                  [gate_r | up_r] per row, from one GEMM (SwiGLU)      */
  tp_device_t device; /* where parameters, workspaces and tensors live (CPU) */
  int device_id;
  tp_dtype_t weight_dtype; /* TP_FLOAT32 (default), TP_BFLOAT16 or TP_FLOAT16: the weight's
                                  storage; arithmetic, activations, bias and gradients stay
                                  float32 (see "Low-precision weights" above) */
} tp_linear_config_t;

#define TP_LINEAR_CONFIG_INITIALIZER \
  {sizeof(tp_linear_config_t), TP_COLUMN_PARALLEL, 0, 0, 1, 0, 1, NULL, 0, 0, TP_DEVICE_CPU, 0, TP_FLOAT32}

typedef struct {
  void *weight;                          /* this rank's weight shard, in weight_dtype */
  float *bias, *grad_weight, *grad_bias; /* float32 (bias NULL if none; the gradients NULL until the
                                          * first backward or alloc_grads, grad_weight always when quantized) */
  int64_t weight_rows, weight_cols, bias_len;
  int64_t offset, local;  /* this rank's slice of the split dimension */
  int64_t x_cols, y_cols; /* columns of forward's input and output on this rank */
  tp_dtype_t weight_dtype;
} tp_linear_info_t;

/* Collective over comm (every rank, same config but for its own rank). */
TP_API tp_status_t tp_parallel_linear_create(tp_parallel_linear_t *out, tp_comm_t comm, const tp_linear_config_t *cfg);
TP_API void tp_parallel_linear_destroy(tp_parallel_linear_t layer);
TP_API tp_status_t tp_parallel_linear_info(tp_parallel_linear_t layer, tp_linear_info_t *info);
/* y[M, y_cols] from x[M, x_cols].  Collective when the layer communicates. */
TP_API tp_status_t tp_parallel_linear_forward(tp_parallel_linear_t layer, const tp_tensor *y, const tp_tensor *x,
                                              tp_stream_t stream);
/* dx[M, x_cols] from dy[M, y_cols], for the last forward's input; accumulates grads. */
TP_API tp_status_t tp_parallel_linear_backward(tp_parallel_linear_t layer, const tp_tensor *dx, const tp_tensor *dy,
                                               tp_stream_t stream);

/* The Transformer MLP split over ranks: column-parallel fc1 (gated for SwiGLU), the
 * activation on this rank's columns, row-parallel fc2 (input_is_parallel).  One
 * all-reduce in forward (fc2's) and one in backward (fc1's input gradient).
 * partition splits ffn_hidden; fc1 is seeded with seed, fc2 with seed + 1.
 * Activations and their gradients live in workspaces reused across steps. */
typedef struct tp_parallel_mlp *tp_parallel_mlp_t;

typedef struct {
  size_t size; /* sizeof(tp_mlp_config_t) */
  int64_t hidden, ffn_hidden;
  tp_activation_t activation;
  int bias;
  const int64_t *partition;
  uint64_t seed;
  tp_device_t device;
  int device_id;
  tp_dtype_t weight_dtype; /* fc1 and fc2 weights (float32 default) */
  int weight_dtypes_set;   /* 1: fc1 and fc2 take weight_dtypes[0] and [1] instead */
  tp_dtype_t weight_dtypes[2];
} tp_mlp_config_t;

#define TP_MLP_CONFIG_INITIALIZER                                                              \
  {                                                                                            \
    sizeof(tp_mlp_config_t), 0, 0, TP_ACT_GELU, 1, NULL, 0, TP_DEVICE_CPU, 0, TP_FLOAT32, 0, { \
      TP_FLOAT32, TP_FLOAT32                                                                   \
    }                                                                                          \
  }

TP_API tp_status_t tp_parallel_mlp_create(tp_parallel_mlp_t *out, tp_comm_t comm, const tp_mlp_config_t *cfg);
TP_API void tp_parallel_mlp_destroy(tp_parallel_mlp_t mlp);
/* The two linear layers (owned by the MLP): which 0 = fc1, 1 = fc2; NULL otherwise. */
TP_API tp_parallel_linear_t tp_parallel_mlp_layer(tp_parallel_mlp_t mlp, int which);
/* y[M, hidden] from x[M, hidden] (replicated on every rank). */
TP_API tp_status_t tp_parallel_mlp_forward(tp_parallel_mlp_t mlp, const tp_tensor *y, const tp_tensor *x,
                                           tp_stream_t stream);
/* dx[M, hidden] from dy[M, hidden] for the last forward; accumulates the layers' grads. */
TP_API tp_status_t tp_parallel_mlp_backward(tp_parallel_mlp_t mlp, const tp_tensor *dx, const tp_tensor *dy,
                                            tp_stream_t stream);

/* Vocab-parallel embedding (Megatron): the table (num_embeddings x dim) split along
 * the vocabulary; rank r holds rows [offset, offset + local).  forward looks up the
 * tokens this rank owns, zeros the others and all-reduces (in registered memory),
 * so every rank gets the full [M, dim] output.  backward scatter-adds the
 * (replicated) output gradient into this rank's rows.  Initialisation N(0, 1)
 * (torch.nn.Embedding), per element of the full table from (seed, index). */
typedef struct tp_vocab_embedding *tp_vocab_embedding_t;

typedef struct {
  size_t size; /* sizeof(tp_embedding_config_t) */
  int64_t num_embeddings, embedding_dim;
  const int64_t *partition; /* world sizes of the vocabulary split; NULL: even */
  uint64_t seed;
  tp_device_t device;
  int device_id;
  tp_dtype_t weight_dtype; /* the table (float32 default; bfloat16 / float16 storage) */
} tp_embedding_config_t;

#define TP_EMBEDDING_CONFIG_INITIALIZER {sizeof(tp_embedding_config_t), 0, 0, NULL, 0, TP_DEVICE_CPU, 0, TP_FLOAT32}

typedef struct {
  void *weight;       /* [local, dim] in weight_dtype */
  float *grad_weight; /* [local, dim] float32; NULL until backward / alloc_grads, or quantized */
  int64_t offset, local, dim, num_embeddings;
  tp_dtype_t weight_dtype;
} tp_embedding_info_t;

TP_API tp_status_t tp_vocab_embedding_create(tp_vocab_embedding_t *out, tp_comm_t comm,
                                             const tp_embedding_config_t *cfg);
TP_API void tp_vocab_embedding_destroy(tp_vocab_embedding_t emb);
TP_API tp_status_t tp_vocab_embedding_info(tp_vocab_embedding_t emb, tp_embedding_info_t *info);
/* y[M, dim] (float32) for tokens[M] (int64) in [0, num_embeddings) (the same on every
 * rank).  Collective. */
TP_API tp_status_t tp_vocab_embedding_forward(tp_vocab_embedding_t emb, const tp_tensor *y, const tp_tensor *tokens,
                                              tp_stream_t stream);
/* grad_weight += scatter of dy[M, dim] onto the last forward's tokens.  Local. */
TP_API tp_status_t tp_vocab_embedding_backward(tp_vocab_embedding_t emb, const tp_tensor *dy, tp_stream_t stream);

/* Vocab-parallel softmax cross-entropy (Megatron): each rank holds the logits of its
 * vocabulary shard [lo, lo + V); no rank holds the full logits.  forward: one max
 * all-reduce (row maxima, the shard widths and a check that every rank got the same
 * targets, packed together), then one sum all-reduce of (sum of exp, target logit)
 * per row.  Rows whose target equals ignore_index have loss 0 and no gradient.
 * backward needs no communication: dlogits = (softmax - onehot) * scale * dloss[m].
 * The logits passed to forward must stay alive and unchanged until backward. */
typedef struct tp_vocab_xent *tp_vocab_xent_t;

typedef struct {
  size_t size; /* sizeof(tp_xent_config_t) */
  tp_device_t device;
  int device_id;
} tp_xent_config_t;

#define TP_XENT_CONFIG_INITIALIZER {sizeof(tp_xent_config_t), TP_DEVICE_CPU, 0}

/* cfg NULL: the defaults (CPU). */
TP_API tp_status_t tp_vocab_xent_create(tp_vocab_xent_t *out, tp_comm_t comm, const tp_xent_config_t *cfg);
TP_API void tp_vocab_xent_destroy(tp_vocab_xent_t xent);
/* losses[M] (float32) from logits[M, V] (float32, V = this rank's shard width, M =
 * shape[0]) and targets[M] (int64, global ids).  vocab_offset < 0: the shards lie in
 * rank order (lo = the widths of the lower ranks).  *valid (may be NULL) = rows not
 * ignored; *vocab (may be NULL) = the full vocabulary size.  Host integers: the
 * call has finished (the stream synchronised) when they are written. */
TP_API tp_status_t tp_vocab_xent_forward(tp_vocab_xent_t xent, const tp_tensor *losses, const tp_tensor *logits,
                                         const tp_tensor *targets, int64_t vocab_offset, int64_t ignore_index,
                                         int64_t *valid, int64_t *vocab, tp_stream_t stream);
/* dlogits[M, V] for the last forward; dloss[M] per row (NULL: all 1) times scale. */
TP_API tp_status_t tp_vocab_xent_backward(tp_vocab_xent_t xent, const tp_tensor *dlogits, const tp_tensor *dloss,
                                          float scale, tp_stream_t stream);

/* A Transformer block split over ranks (Megatron): attention with the heads split
 * (fused QKV: one column-parallel GEMM; output projection row-parallel) and the
 * parallel MLP, with residuals and norms.  pre_norm: x + attn(norm1(x)), then
 * + mlp(norm2(.)) (GPT-2, Llama); otherwise norm1(x + attn(x)), norm2(. + mlp(.))
 * (BERT).  Exactly one all-reduce after attention and one after the MLP in forward,
 * and their mirrors (at the QKV and fc1 inputs) in backward.
 * Heads: rank r holds query heads [q0, q0 + nq) (head_partition: whole heads per rank,
 * any sizes); grouped-query attention (kv_heads < heads, heads % kv_heads == 0): a rank
 * holds the KV heads its query heads use, so a KV head is split with its group, or
 * replicated on every rank that needs it (then backward sums that head's weight
 * gradients over those ranks: one more all-reduce, only in that layout).
 * Full-tensor layouts (what load/gather use): qkv weight rows [Q (heads*D) | K (kv*D) |
 * V (kv*D)] x hidden; out weight hidden x heads*D.  The shard holds rows [its Q heads |
 * its K heads | its V heads]. */
typedef struct tp_block *tp_block_t;

typedef enum { TP_NORM_LAYER = 0, TP_NORM_RMS = 1 } tp_norm_t;

typedef struct {
  size_t size; /* sizeof(tp_block_config_t) */
  int64_t hidden, heads, kv_heads, head_dim, ffn_hidden;
  tp_norm_t norm;
  float eps;
  tp_activation_t activation;
  int pre_norm;
  int bias; /* biases of the QKV, output and MLP projections */
  int causal;
  float rope_theta;              /* > 0: rotary positions on Q and K */
  const int64_t *head_partition; /* query heads per rank; NULL: even (whole heads) */
  const int64_t *ffn_partition;  /* MLP columns per rank; NULL: even */
  uint64_t seed;
  int attention_only; /* ParallelAttention: y = attn(x), no norms, MLP or residual */
  tp_device_t device;
  int device_id;
  tp_dtype_t weight_dtype; /* the QKV, output and MLP weights (float32 default); norm
                                      weights and biases stay float32 */
  int weight_dtypes_set;   /* 1: the QKV, output, fc1 and fc2 weights take
                                      weight_dtypes[0..3] instead (a GGUF file's mix) */
  tp_dtype_t weight_dtypes[4];
  /* The model families' options (0 / NULL: off, as before) ------------------------------ */
  int bias_parts;             /* 0: `bias` for every projection; else TP_BIAS_SET | the TP_BIAS_* parts that have one
                     (Qwen2: TP_BIAS_SET | TP_BIAS_QKV) and `bias` is ignored */
  int qk_norm;                /* an RMS norm over each head's head_dim values of Q and of K before the rotary
                     embedding (Qwen3, Gemma 3): weights "attn.q_norm.weight", "attn.k_norm.weight"
                     [head_dim], replicated; norm must be TP_NORM_RMS */
  int post_norms;             /* pre_norm only: x + norm3(attn(norm1(x))) = h, then h + norm4(mlp(norm2(h))) (Gemma
                     2/3): "attn_post_norm.*", "mlp_post_norm.*" [hidden] */
  float attn_scale;           /* > 0: the attention scores' scale (Gemma: query_pre_attn_scalar^-1/2); 0: 1/sqrt(D) */
  float attn_softcap;         /* > 0: scores -> cap * tanh(scores / cap) before the mask (Gemma 2) */
  int64_t sliding_window;     /* > 0: a query at position p sees the keys at p - window < j <= p; the KV cache
                             then holds a ring of min(max_len, 2 window) rows per sequence */
  const float *rope_inv_freq; /* host [head_dim / 2]: the rotary frequencies (rope scaling; copied at create,
                                 tp_block_set_rope changes them); NULL: rope_theta's 1 / theta^(2i / D) */
  float rope_factor;          /* > 0: cos and sin scaled by it (YaRN, LongRoPE); 0: 1 */
} tp_block_config_t;

enum { TP_BIAS_QKV = 1, TP_BIAS_OUT = 2, TP_BIAS_MLP = 4, TP_BIAS_SET = 8 };

#define TP_BLOCK_CONFIG_INITIALIZER                  \
  {sizeof(tp_block_config_t),                        \
   0,                                                \
   0,                                                \
   0,                                                \
   0,                                                \
   0,                                                \
   TP_NORM_LAYER,                                    \
   1e-5f,                                            \
   TP_ACT_GELU,                                      \
   1,                                                \
   1,                                                \
   1,                                                \
   0.0f,                                             \
   NULL,                                             \
   NULL,                                             \
   0,                                                \
   0,                                                \
   TP_DEVICE_CPU,                                    \
   0,                                                \
   TP_FLOAT32,                                       \
   0,                                                \
   {TP_FLOAT32, TP_FLOAT32, TP_FLOAT32, TP_FLOAT32}, \
   0,                                                \
   0,                                                \
   0,                                                \
   0.0f,                                             \
   0.0f,                                             \
   0,                                                \
   NULL,                                             \
   0.0f}

/* Metadata of a forward, in host memory (the block copies what it needs). */
typedef struct {
  int64_t B, T;            /* rows of x = B * T (B sequences of T tokens)            */
  const int64_t *pos0;     /* [B] position of each sequence's first token (NULL: 0)  */
  const uint8_t *key_mask; /* [B, T] 1 = a token to attend to (NULL: all); no cache   */
  int use_cache;           /* K/V go to the cache at pos0[b] + t, attention over it  */
  int need_backward;       /* keep what backward needs                               */
  /* [B] the KV-cache sequence of each batch row (NULL: row b uses cache sequence b): with
   * use_cache, row b writes and reads cache sequence slots[b] at pos0[b]; each slot in
   * [0, cache batch), none twice in one forward (continuous batching: a fixed pool of cache
   * sequences shared by the requests that come and go, python/tpcore/serve.py) */
  const int64_t *slots;
  /* [B, block_cols] with a paged cache (tp_block_cache_paged; required then, NULL otherwise;
   * slots must be NULL): row b's position p lives in block block_table[b * block_cols + p /
   * block_size] at row p % block_size.  An entry < 0 is no block: the K/V of positions there
   * are not written and keys there never read (a padding row is all < 0); every other entry
   * a block of the pool, [0, num_blocks).  A row with a block needs block_cols x block_size
   * >= pos0[b] + T; no two tokens of a forward may write one row of the pool. */
  const int64_t *block_table;
  int64_t block_cols;
} tp_block_batch_t;

/* {B, T, pos0, key_mask, use_cache, need_backward, slots, block_table, block_cols} */
#define TP_BLOCK_BATCH_INITIALIZER {0, 0, NULL, NULL, 0, 0, NULL, NULL, 0}

typedef struct {
  const char *name; /* "norm1.weight", "attn.qkv.weight", "mlp.fc1.bias", ...  */
  void *data;       /* in dtype */
  float *grad;      /* float32; NULL until backward / alloc_grads, or quantized */
  int ndim;         /* 1: a vector of rows entries; 2: rows x cols */
  int64_t rows, cols;
  tp_dtype_t dtype; /* float32, or the block's weight_dtype for a projection weight */
} tp_param_t;

typedef struct {
  int64_t q0, nq, k0, nk;         /* this rank's query heads and KV heads */
  int64_t cache_batch, cache_len; /* KV cache capacity (0 before tp_block_cache) */
  int kv_replicated;              /* some KV head lives on more than one rank */
  int64_t cache_block_size;       /* > 0: the cache is paged, cache_batch blocks of this many rows
                                     (= cache_len); 0: cache_batch sequences of cache_len */
} tp_block_info_t;

TP_API tp_status_t tp_block_create(tp_block_t *out, tp_comm_t comm, const tp_block_config_t *cfg);
TP_API void tp_block_destroy(tp_block_t blk);
TP_API tp_status_t tp_block_info(tp_block_t blk, tp_block_info_t *info);
/* The parameters of this rank's shard: up to max entries written; returns how many exist. */
TP_API int tp_block_params(tp_block_t blk, tp_param_t *out, int max);
/* (Re)allocate the KV cache for batch sequences of up to max_len tokens (contents reset). */
TP_API tp_status_t tp_block_cache(tp_block_t blk, int64_t batch, int64_t max_len);
/* (Re)allocate the KV cache as a paged pool (contents reset): num_blocks blocks of block_size
 * rows of this rank's K and V heads each (no ring: a sliding-window layer masks the keys
 * outside its window); forwards with use_cache then take a block table (tp_block_batch_t). */
TP_API tp_status_t tp_block_cache_paged(tp_block_t blk, int64_t num_blocks, int64_t block_size);
/* The rotary frequencies from now on (host [head_dim / 2], finite and >= 0; NULL: rope_theta's) and
 * the cos/sin scale (> 0): a rope scaling that depends on the sequence length (dynamic NTK,
 * LongRoPE) changes them between forwards.  The block must have rotary positions. */
TP_API tp_status_t tp_block_set_rope(tp_block_t blk, const float *inv_freq, float factor);
/* y[B*T, hidden] from x[B*T, hidden].  Collective. */
TP_API tp_status_t tp_block_forward(tp_block_t blk, const tp_tensor *y, const tp_tensor *x,
                                    const tp_block_batch_t *batch, tp_stream_t stream);
/* dx[M, hidden] from dy[M, hidden] for the last forward (need_backward; M must be its B * T);
 * accumulates the gradients.  Collective. */
TP_API tp_status_t tp_block_backward(tp_block_t blk, const tp_tensor *dx, const tp_tensor *dy, tp_stream_t stream);

/* ---- Memory of a layer, and gradients on demand ----------------------------------------
 *
 * Gradients are allocated on demand: a layer made for inference never holds them.  The
 * first backward allocates (zeroed) the gradient buffers of every weight that has one
 * (a quantized weight is frozen: none), as does tp_*_alloc_grads (idempotent; an optimizer
 * that wants the buffers before the first backward calls it).  Until then the info / params
 * calls give NULL gradient pointers.
 *
 * tp_*_memory fills a tp_layer_memory_t: the bytes this layer holds now, by kind, on its
 * device (each count the size of the live allocations, not a guess). */
typedef struct {
  size_t size;        /* sizeof(tp_layer_memory_t): set by the caller */
  tp_device_t device; /* where the bytes below live */
  int device_id;
  size_t params;     /* weights in their storage format, biases, norms */
  size_t grads;      /* gradient buffers (0 until the first backward or alloc_grads) */
  size_t workspace;  /* activation and scratch arenas, saved inputs, dequantized panels */
  size_t cache;      /* KV cache allocated (tp_block_cache) */
  size_t cache_used; /* of which holding tokens (the highest position written, per sequence) */
  size_t comm;       /* communication buffers (registered memory, or the plain fallback) */
} tp_layer_memory_t;

TP_API tp_status_t tp_parallel_linear_alloc_grads(tp_parallel_linear_t layer);
TP_API tp_status_t tp_parallel_mlp_alloc_grads(tp_parallel_mlp_t mlp);
TP_API tp_status_t tp_vocab_embedding_alloc_grads(tp_vocab_embedding_t emb);
TP_API tp_status_t tp_block_alloc_grads(tp_block_t blk);

TP_API tp_status_t tp_parallel_linear_memory(tp_parallel_linear_t layer, tp_layer_memory_t *mem);
TP_API tp_status_t tp_parallel_mlp_memory(tp_parallel_mlp_t mlp, tp_layer_memory_t *mem);
TP_API tp_status_t tp_vocab_embedding_memory(tp_vocab_embedding_t emb, tp_layer_memory_t *mem);
TP_API tp_status_t tp_vocab_xent_memory(tp_vocab_xent_t xent, tp_layer_memory_t *mem);
TP_API tp_status_t tp_block_memory(tp_block_t blk, tp_layer_memory_t *mem);

/* ---- A workspace shared by the blocks of one model, for inference ------------------------
 *
 * A forward without need_backward keeps nothing for later: its activations are dead once it
 * returns.  Blocks given one tp_workspace_t carve those forwards' activations (and their MLP's)
 * from it instead of from arenas of their own, so a model of L blocks holds one block's
 * inference activations, not L (a forward that keeps what backward needs still uses the
 * block's own arena); their output projections and fc2 write their all-reduced outputs into
 * its one communication buffer (registered memory of the first block's communicator; blocks
 * of another communicator keep their own), each consumed before the next layer writes it.  The blocks sharing a workspace must run one after another (as a
 * model's do; a CPU call has finished when it returns, a GPU block's kernels run in order on
 * its stream).  Reference counted: each block keeps a reference, tp_workspace_destroy drops
 * the caller's; the last one frees it. */
typedef struct tp_workspace *tp_workspace_t;
TP_API tp_status_t tp_workspace_create(tp_workspace_t *out, tp_device_t device, int device_id);
TP_API void tp_workspace_destroy(tp_workspace_t ws);
/* Bytes the workspace holds now (it grows to the largest forward that used it): the total, and
 * split into mem->workspace (activations) and mem->comm (the collective buffer). */
TP_API size_t tp_workspace_bytes(tp_workspace_t ws);
TP_API tp_status_t tp_workspace_memory(tp_workspace_t ws, tp_layer_memory_t *mem);
/* The block's inference forwards use ws (on the block's device; NULL: its own arena again). */
TP_API tp_status_t tp_block_set_workspace(tp_block_t blk, tp_workspace_t ws);
/* The block's shared workspace (NULL: none); the block keeps its reference. */
TP_API tp_workspace_t tp_block_get_workspace(tp_block_t blk);

#ifdef __cplusplus
}
#endif
#endif
