/* The block's KV cache: per sequence (tp_block_cache: batch sequences of max_len rows, a ring
 * of min(max_len, 2 window) rows on a sliding-window layer) or paged (tp_block_cache_paged: a
 * pool of num_blocks blocks of block_size rows that forwards address through a block table),
 * the checks of a paged forward's table, and the high-water marks tp_block_memory reports. */
#include <limits.h>
#include <stdlib.h>

#include "block_impl.h"
#include "layer_kernels.h"

void tp_block_cache_release(tp_block_t k) {
  tp_arena_release(&k->cache);
  if (k->kv_end) tp_host_free(k->kv_end);
  k->kv_end = NULL;
  k->kc = k->vc = NULL, k->cb = k->clen = k->crows = 0, k->paged = 0;
}

/* A new allocation of seqs x rows K and V rows of this rank's heads (the old one goes first),
 * zeroed, with seqs high-water marks; what: the sentence's start for an error. */
static tp_status_t cache_alloc(tp_block_t k, int64_t seqs, int64_t rows, const char *what) {
  int64_t n;
  if (!tp_numel3(seqs, rows, k->nk * k->D, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: %lld x %lld rows x %lld K/V values per token is too large: at most 2^40 elements", what,
                        (long long)seqs, (long long)rows, (long long)(k->nk * k->D));
  size_t total = 0;
  tp_arena_add_n(&total, n, sizeof(float));
  tp_arena_add_n(&total, n, sizeof(float));
  tp_block_cache_release(k);
  tp_status_t st = tp_arena_reserve(&k->cache, total, what);
  if (st == TP_SUCCESS) st = lk_zero(&k->lk, k->cache.base, total, NULL);
  if (st == TP_SUCCESS) st = tp_host_zalloc((size_t)seqs * sizeof(int64_t), (void **)&k->kv_end, what);
  if (st != TP_SUCCESS) {
    tp_block_cache_release(k);
    return tp_set_error(TP_ERR_NOMEM, "%s: out of memory for %lld x %lld rows (2 x %lld floats)", what, (long long)seqs,
                        (long long)rows, (long long)n);
  }
  k->kc = tp_arena_take_n(&k->cache, n, sizeof(float));
  k->vc = tp_arena_take_n(&k->cache, n, sizeof(float));
  k->cb = seqs, k->crows = rows;
  return TP_SUCCESS;
}

tp_status_t tp_block_cache(tp_block_t k, int64_t batch, int64_t max_len) {
  TP_NONNULL("block cache", k, "block");
  /* max_len is the leading dimension of the attention's score GEMMs: a 32-bit int */
  if (batch < 1 || batch > INT_MAX || max_len < 1 || max_len > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block cache: batch and max_len must be in [1, %d], got batch %lld "
                        "and max_len %lld",
                        INT_MAX, (long long)batch, (long long)max_len);
  /* a sliding window keeps a ring of min(max_len, 2 window) rows: a forward of T <= rows - window + 1
   * tokens finds the window of each of its queries intact after writing its own keys */
  int64_t W = k->cfg.sliding_window, rows = W > 0 && max_len > 2 * W ? 2 * W : max_len;
  TP_CHECK(cache_alloc(k, batch, rows, "block cache"));
  k->clen = max_len;
  return TP_SUCCESS;
}

tp_status_t tp_block_cache_paged(tp_block_t k, int64_t num_blocks, int64_t block_size) {
  TP_NONNULL("block cache_paged", k, "block");
  if (num_blocks < 1 || num_blocks > INT_MAX || block_size < 1 || block_size > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block cache_paged: num_blocks and block_size must be in [1, %d], got num_blocks %lld and "
                        "block_size %lld",
                        INT_MAX, (long long)num_blocks, (long long)block_size);
  TP_CHECK(cache_alloc(k, num_blocks, block_size, "block cache_paged"));
  k->clen = block_size, k->paged = 1;
  return TP_SUCCESS;
}

static int by_value(const void *x, const void *y) {
  const int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
  return (a > b) - (a < b);
}

/* No two tokens of the forward write one row of the pool (rows: scratch of B x T). */
static tp_status_t distinct_writes(tp_block_t k, const tp_block_batch_t *bt, int64_t *rows) {
  int64_t n = 0, bs = k->crows, cols = bt->block_cols;
  for (int64_t b = 0; b < bt->B; b++)
    for (int64_t t = 0, p0 = bt->pos0 ? bt->pos0[b] : 0; t < bt->T; t++) {
      int64_t p = p0 + t, e = p / bs < cols ? bt->block_table[b * cols + p / bs] : -1;
      if (e >= 0) rows[n++] = e * bs + p % bs;
    }
  qsort(rows, (size_t)n, sizeof *rows, by_value);
  for (int64_t i = 1; i < n; i++)
    if (rows[i] == rows[i - 1])
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "block forward: two tokens of the batch would write row %lld of KV block %lld (block_table "
                          "gives one block to two positions)",
                          (long long)(rows[i] % bs), (long long)(rows[i] / bs));
  return TP_SUCCESS;
}

/* A forward's block table against the cache: present exactly with a paged cache and
 * use_cache (slots then NULL); every entry < 0 or a block of the pool; a row with a block
 * covers pos0[b] + T; no row of the pool written twice.  pos0 (checked >= 0 and pos0 + T
 * representable before) and the table are host metadata. */
tp_status_t tp_block_check_paged(tp_block_t k, const tp_block_batch_t *bt) {
  if (bt->block_table && !bt->use_cache)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: block_table maps positions to blocks of a paged KV cache: it needs use_cache");
  if (!bt->use_cache || (!bt->block_table && !k->paged)) return TP_SUCCESS;
  if (!k->paged)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: block_table is for a paged KV cache (tp_block_cache_paged), and this block's "
                        "cache is %s",
                        k->kc ? "one of sequences (tp_block_cache)" : "not allocated");
  if (bt->slots)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: slots and block_table exclude each other (a paged cache has no sequences)");
  if (bt->B == 0) return TP_SUCCESS;
  if (!bt->block_table)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: the KV cache is paged (tp_block_cache_paged): a forward with use_cache needs "
                        "block_table");
  int64_t bs = k->crows, cols = bt->block_cols, span, n;
  if (cols < 1 || !tp_mul_count(cols, bs, &span) || span > INT_MAX || !tp_numel2(bt->B, cols, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "block forward: block_cols = %lld must be >= 1 with block_cols x block_size (%lld) at most %d "
                        "positions and B x block_cols at most 2^40",
                        (long long)cols, (long long)bs, INT_MAX);
  for (int64_t b = 0; b < bt->B; b++) {
    int any = 0;
    for (int64_t c = 0; c < cols; c++) {
      int64_t e = bt->block_table[b * cols + c];
      if (e >= k->cb)
        return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                            "block forward: block_table[%lld][%lld] = %lld is outside the paged KV cache's %lld blocks "
                            "[0, %lld) (< 0: no block)",
                            (long long)b, (long long)c, (long long)e, (long long)k->cb, (long long)k->cb);
      any |= e >= 0;
    }
    int64_t end = (bt->pos0 ? bt->pos0[b] : 0) + bt->T;
    if (any && end > span)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "block forward: row %lld reaches position %lld (pos0 + T) but block_table's %lld columns of "
                          "%lld rows cover %lld positions",
                          (long long)b, (long long)end, (long long)cols, (long long)bs, (long long)span);
  }
  if (bt->B * bt->T < 2) return TP_SUCCESS;
  size_t nbytes = 0;
  tp_arena_add_n(&nbytes, bt->B * bt->T, sizeof(int64_t)); /* B x T <= INT_MAX: checked */
  int64_t *rows;
  TP_CHECK(tp_host_zalloc(nbytes, (void **)&rows, "block forward: the block table check"));
  tp_status_t st = distinct_writes(k, bt, rows);
  tp_host_free(rows);
  return st;
}

void tp_block_paged_written(tp_block_t k, const tp_block_batch_t *bt) {
  int64_t bs = k->crows, cols = bt->block_cols;
  for (int64_t b = 0; b < bt->B; b++)
    for (int64_t t = 0, p0 = bt->pos0 ? bt->pos0[b] : 0; t < bt->T; t++) {
      int64_t p = p0 + t, e = p / bs < cols ? bt->block_table[b * cols + p / bs] : -1;
      if (e >= 0 && p % bs + 1 > k->kv_end[e]) k->kv_end[e] = p % bs + 1;
    }
}
