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
 * memory, so their all-reduce / all-gather take the zero-copy path.
 * Initialisation: W and b ~ U(-1/sqrt(in), 1/sqrt(in)) (PyTorch nn.Linear),
 * drawn per element of the full tensor from (seed, tensor, index): a layer has
 * the same logical weights at every world size and partition.
 */
#ifndef TPCORE_LAYERS_H
#define TPCORE_LAYERS_H

#include "tpcore/comm.h"
#include "tpcore/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_parallel_linear *tp_parallel_linear_t;

typedef enum { TP_COLUMN_PARALLEL = 0, TP_ROW_PARALLEL = 1 } tp_parallel_kind_t;

typedef struct {
  size_t size;                 /* sizeof(tp_linear_config_t) */
  tp_parallel_kind_t kind;
  int64_t in_features, out_features;
  int bias;                    /* 1: with bias                                    */
  int gather_output;           /* column: all-gather the output                   */
  int input_is_parallel;       /* row: x arrives already split                     */
  const int64_t *partition;    /* world sizes of the split dimension; NULL: even   */
  uint64_t seed;
  int gated;                   /* column: W is [gate; up] (2 * out_features rows); a rank
                                  holds its gate rows and its up rows and outputs
                                  [gate_r | up_r] per row, from one GEMM (SwiGLU)      */
} tp_linear_config_t;

#define TP_LINEAR_CONFIG_INITIALIZER \
  { sizeof(tp_linear_config_t), TP_COLUMN_PARALLEL, 0, 0, 1, 0, 1, NULL, 0, 0 }

typedef struct {
  float *weight, *bias, *grad_weight, *grad_bias; /* this rank's shard (bias NULL if none) */
  int64_t weight_rows, weight_cols, bias_len;
  int64_t offset, local;       /* this rank's slice of the split dimension */
  int64_t x_cols, y_cols;      /* columns of forward's input and output on this rank */
} tp_linear_info_t;

/* Collective over comm (every rank, same config but for its own rank). */
TP_API tp_status_t tp_parallel_linear_create(tp_parallel_linear_t *out, tp_comm_t comm,
                                             const tp_linear_config_t *cfg);
TP_API void tp_parallel_linear_destroy(tp_parallel_linear_t layer);
TP_API tp_status_t tp_parallel_linear_info(tp_parallel_linear_t layer, tp_linear_info_t *info);
/* y[M, y_cols] from x[M, x_cols].  Collective when the layer communicates. */
TP_API tp_status_t tp_parallel_linear_forward(tp_parallel_linear_t layer, float *y, const float *x,
                                              int64_t M);
/* dx[M, x_cols] from dy[M, y_cols], for the last forward's input; accumulates grads. */
TP_API tp_status_t tp_parallel_linear_backward(tp_parallel_linear_t layer, float *dx, const float *dy,
                                               int64_t M);

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
} tp_mlp_config_t;

#define TP_MLP_CONFIG_INITIALIZER { sizeof(tp_mlp_config_t), 0, 0, TP_ACT_GELU, 1, NULL, 0 }

TP_API tp_status_t tp_parallel_mlp_create(tp_parallel_mlp_t *out, tp_comm_t comm, const tp_mlp_config_t *cfg);
TP_API void tp_parallel_mlp_destroy(tp_parallel_mlp_t mlp);
/* The two linear layers (owned by the MLP). */
TP_API tp_parallel_linear_t tp_parallel_mlp_layer(tp_parallel_mlp_t mlp, int which);
/* y[M, hidden] from x[M, hidden] (replicated on every rank). */
TP_API tp_status_t tp_parallel_mlp_forward(tp_parallel_mlp_t mlp, float *y, const float *x, int64_t M);
/* dx[M, hidden] from dy[M, hidden] for the last forward; accumulates the layers' grads. */
TP_API tp_status_t tp_parallel_mlp_backward(tp_parallel_mlp_t mlp, float *dx, const float *dy, int64_t M);

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
} tp_embedding_config_t;

#define TP_EMBEDDING_CONFIG_INITIALIZER { sizeof(tp_embedding_config_t), 0, 0, NULL, 0 }

typedef struct {
  float *weight, *grad_weight; /* [local, dim] */
  int64_t offset, local, dim, num_embeddings;
} tp_embedding_info_t;

TP_API tp_status_t tp_vocab_embedding_create(tp_vocab_embedding_t *out, tp_comm_t comm,
                                             const tp_embedding_config_t *cfg);
TP_API void tp_vocab_embedding_destroy(tp_vocab_embedding_t emb);
TP_API tp_status_t tp_vocab_embedding_info(tp_vocab_embedding_t emb, tp_embedding_info_t *info);
/* y[M, dim] for tokens[M] in [0, num_embeddings) (the same on every rank).  Collective. */
TP_API tp_status_t tp_vocab_embedding_forward(tp_vocab_embedding_t emb, float *y, const int64_t *tokens, int64_t M);
/* grad_weight += scatter of dy[M, dim] onto the last forward's tokens.  Local. */
TP_API tp_status_t tp_vocab_embedding_backward(tp_vocab_embedding_t emb, const float *dy, int64_t M);

/* Vocab-parallel softmax cross-entropy (Megatron): each rank holds the logits of its
 * vocabulary shard [lo, lo + V); no rank holds the full logits.  forward: one max
 * all-reduce (row maxima, the shard widths and a check that every rank got the same
 * targets, packed together), then one sum all-reduce of (sum of exp, target logit)
 * per row.  Rows whose target equals ignore_index have loss 0 and no gradient.
 * backward needs no communication: dlogits = (softmax - onehot) * scale * dloss[m].
 * The logits passed to forward must stay alive and unchanged until backward. */
typedef struct tp_vocab_xent *tp_vocab_xent_t;

TP_API tp_status_t tp_vocab_xent_create(tp_vocab_xent_t *out, tp_comm_t comm);
TP_API void tp_vocab_xent_destroy(tp_vocab_xent_t xent);
/* losses[M] from logits[M, V] and targets[M] (global ids).  vocab_offset < 0: the
 * shards lie in rank order (lo = the widths of the lower ranks).  *valid (may be
 * NULL) = rows not ignored; *vocab (may be NULL) = the full vocabulary size. */
TP_API tp_status_t tp_vocab_xent_forward(tp_vocab_xent_t xent, float *losses, const float *logits,
                                         const int64_t *targets, int64_t M, int64_t V, int64_t vocab_offset,
                                         int64_t ignore_index, int64_t *valid, int64_t *vocab);
/* dlogits[M, V] for the last forward; dloss[M] per row (NULL: all 1) times scale. */
TP_API tp_status_t tp_vocab_xent_backward(tp_vocab_xent_t xent, float *dlogits, const float *dloss, float scale);

#ifdef __cplusplus
}
#endif
#endif
