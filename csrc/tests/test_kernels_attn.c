/* Parity cases of the attention entries: training layouts (fused QKV rows, padded
 * leading dimensions, key masks, causal, grouped-query heads, a rank's heads starting
 * mid-group), decoding over a KV cache (q_pos, k_len; kv_slot: rows mapped to cache
 * sequences), logit soft-capping, sliding windows, a ring cache (kv_ring: read after
 * wrap-around, against the reference over the same keys in a linear cache) and a paged cache
 * (kv_block_table: shuffled blocks, holes), against a double reference. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "test_kernels.h"

typedef struct {
  int64_t B, Tq, Tk, Hq, Hk, D, group, q_head0, k_head0;
  int causal, mask, decode; /* decode: q_pos/k_len of a cache; mask: a random key mask */
  int64_t slots;            /* decode: a cache of this many sequences, read through kv_slot (0: B, none) */
  float cap;                /* softcap (0: off) */
  int64_t window, ring;     /* sliding window; decode: a ring of this many rows holds the Tk positions */
} acfg;

static const acfg AC[] = {
    {2, 67, 67, 4, 2, 6, 0, 0, 0, 1, 1, 0, 0, 0.0f, 0, 0}, /* causal training over two query blocks, masked keys, GQA */
    {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0.0f, 0, 0},   /* the smallest */
    {3, 5, 5, 3, 3, 5, 0, 0, 0, 0, 0, 0, 0, 0.0f, 0, 0},   /* non-causal, MHA */
    {2, 9, 9, 4, 2, 4, 3, 2, 0, 1, 1, 0, 0, 0.0f, 0, 0},   /* heads 2..5 of 6 in groups of 3: starts mid-group */
    {3, 2, 13, 4, 2, 8, 0, 0, 0, 1, 0, 1, 0, 0.0f, 0, 0},  /* decode: 2 new tokens per sequence over a cache of 13 */
    {1, 70, 80, 2, 1, 3, 0, 0, 0, 1, 0, 1, 0, 0.0f, 0, 0}, /* a prefill continuing at position 10 */
    {0, 4, 4, 2, 2, 2, 0, 0, 0, 1, 0, 0, 0, 0.0f, 0, 0},   /* no sequences */
    {2, 0, 0, 2, 1, 2, 0, 0, 0, 1, 0, 0, 0, 0.0f, 0, 0},   /* no tokens */
    {2, 3, 600, 4, 2, 8, 0, 0, 0, 1, 0, 1, 0, 0.0f, 0,
     0}, /* decode over a long cache (CUDA: split-K), k_len 600 and 103 */
    {1, 20, 20, 2, 2, 100, 0, 0, 0, 1, 1, 0, 0, 0.0f, 0, 0}, /* a head size between the fused kernels' templates */
    {1, 18, 18, 3, 1, 200, 0, 0, 0, 0, 0, 0, 0, 0.0f, 0, 0}, /* a large head size, MQA */
    {3, 2, 13, 4, 2, 8, 0, 0, 0, 1, 0, 1, 5, 0.0f, 0, 0},    /* decode through kv_slot: 3 rows over 5 cache sequences */
    {2, 3, 600, 4, 2, 8, 0, 0, 0, 1, 0, 1, 3, 0.0f, 0, 0},   /* the same over a long cache (CUDA: split-K) */
    {1, 70, 80, 2, 1, 3, 0, 0, 0, 1, 0, 1, 2, 0.0f, 0, 0},   /* a prefill into one of two cache sequences */
    /* soft-capping and sliding windows: causal over two query blocks with masked keys and
     * GQA, a window over T, window 1, non-causal, mid-group heads, decode over a cache */
    {2, 67, 67, 4, 2, 6, 0, 0, 0, 1, 1, 0, 0, 3.0f, 9, 0},
    {1, 20, 20, 2, 1, 5, 0, 0, 0, 1, 0, 0, 0, 2.5f, 100, 0},
    {2, 9, 9, 2, 2, 4, 0, 0, 0, 1, 0, 0, 0, 0.0f, 1, 0},
    {2, 11, 11, 2, 1, 4, 0, 0, 0, 0, 1, 0, 0, 4.0f, 3, 0},
    {2, 9, 9, 4, 2, 4, 3, 2, 0, 1, 1, 0, 0, 1.5f, 4, 0},
    {1, 130, 130, 2, 1, 3, 0, 0, 0, 1, 0, 0, 0, 0.0f, 70, 0},
    {3, 2, 13, 4, 2, 8, 0, 0, 0, 1, 0, 1, 0, 2.0f, 4, 0},
    /* a ring cache: positions 0..39 through a ring of 9 rows (window 7 + Tq 3 - 1), per
     * sequence after wrap-around or not; through kv_slot; decode over a ring of 520 keys
     * (CUDA: split-K) */
    {3, 3, 40, 4, 2, 8, 0, 0, 0, 1, 0, 1, 0, 3.0f, 7, 9},
    {2, 3, 40, 2, 1, 5, 0, 0, 0, 1, 0, 1, 3, 0.0f, 6, 10},
    {2, 1, 1500, 2, 1, 8, 0, 0, 0, 1, 0, 1, 0, 0.0f, 512, 520},
};
#define NAC (sizeof AC / sizeof AC[0])

typedef struct {       /* host copies of one case's inputs and the args that point at them */
  tp_attention_args a; /* a ring case: a.Tk positions of a linear cache (the reference's) */
  int64_t ring;        /* the ring the device reads (rkc, rvc: [cache sequences, ring, Hk D]) */
  float *qkv, *kc, *vc, *o, *rkc, *rvc;
  int64_t *qpos, *klen, *slot;
  uint8_t *mask;
  int64_t W, nqkv, nkv, no;
} ainst;

static int64_t kv_head(const tp_attention_args *a, int64_t h) {
  return a->group ? (a->q_head0 + h) / a->group - a->k_head0 : h / (a->Hq / a->Hk);
}

static int visible(const tp_attention_args *a, int64_t b, int64_t i, int64_t j) {
  int64_t n = a->k_len ? a->k_len[b] : a->Tk;
  if (j >= n || j >= a->Tk) return 0;
  if (a->key_mask && !a->key_mask[b * a->Tk + j]) return 0;
  int64_t p = (a->q_pos ? a->q_pos[b] : 0) + i;
  if (a->window && j <= p - a->window) return 0;
  return !a->causal || j <= p;
}

static void make(const acfg *c, ainst *x) {
  memset(x, 0, sizeof *x);
  tp_attention_args *a = &x->a;
  a->B = c->B, a->Tq = c->Tq, a->Tk = c->Tk, a->Hq = c->Hq, a->Hk = c->Hk, a->D = c->D;
  a->group = c->group, a->q_head0 = c->q_head0, a->k_head0 = c->k_head0, a->causal = c->causal;
  a->softcap = c->cap, a->window = c->window, x->ring = c->ring;
  a->scale = (float)(1.0 / sqrt((double)c->D));
  a->device = DEV;
  x->W = (c->Hq + 2 * c->Hk) * c->D + 1; /* a fused QKV row, padded */
  x->nqkv = c->B * c->Tq * x->W + 1;
  x->qkv = rnd(x->nqkv, -1, 1);
  a->q_ld = x->W, a->o_ld = c->Hq * c->D + 2;
  x->no = c->B * c->Tq * a->o_ld + 1;
  x->o = rnd(x->no, -1, 1);
  if (c->decode) { /* a cache [B, Tk, Hk D]; sequence b's queries start at q_pos[b] */
    a->kv_ld = c->Hk * c->D, a->kv_bstride = c->Tk * a->kv_ld;
    x->nkv = (c->slots ? c->slots : c->B) * a->kv_bstride + 1;
    if (c->slots) { /* the first B of a shuffled permutation: distinct slots, any order, some unused */
      x->slot = hmem((size_t)c->slots * 8);
      for (int64_t i = 0; i < c->slots; i++) x->slot[i] = i;
      for (int64_t i = c->slots - 1; i > 0; i--) {
        int64_t j = rnd_int(0, i + 1), t = x->slot[i];
        x->slot[i] = x->slot[j], x->slot[j] = t;
      }
      a->kv_batch = c->slots;
    }
    x->kc = rnd(x->nkv, -1, 1), x->vc = rnd(x->nkv, -1, 1);
    x->qpos = hmem((size_t)c->B * 8 + 8), x->klen = hmem((size_t)c->B * 8 + 8);
    for (int64_t b = 0; b < c->B; b++) {
      x->qpos[b] = c->Tk == 13    ? (int64_t[]){0, 5, 11}[b % 3]
                   : c->Tk == 600 ? (int64_t[]){597, 100}[b % 2]
                   : c->ring      ? (int64_t[]){c->Tk - c->Tq, 2, 20}[b % 3] /* wrapped, not yet, wrapped */
                                  : c->Tk - c->Tq;
      x->klen[b] = x->qpos[b] + c->Tq;
    }
    if (c->ring) { /* the ring after writing positions 0 .. k_len[b] - 1 in order: row p % ring holds the last */
      int64_t nseq = c->slots ? c->slots : c->B, nr = nseq * c->ring * a->kv_ld + 1;
      x->rkc = rnd(nr, -1, 1), x->rvc = rnd(nr, -1, 1);
      for (int64_t b = 0; b < c->B; b++) {
        int64_t sq = x->slot ? x->slot[b] : b;
        for (int64_t p = 0; p < x->klen[b]; p++)
          for (int64_t e = 0; e < a->kv_ld; e++) {
            x->rkc[(sq * c->ring + p % c->ring) * a->kv_ld + e] = x->kc[sq * a->kv_bstride + p * a->kv_ld + e];
            x->rvc[(sq * c->ring + p % c->ring) * a->kv_ld + e] = x->vc[sq * a->kv_bstride + p * a->kv_ld + e];
          }
      }
    }
  } else {
    a->kv_ld = x->W, a->kv_bstride = c->Tq * x->W;
  }
  if (c->mask) {
    x->mask = hmem((size_t)(c->B * c->Tk) + 1);
    for (int64_t i = 0; i < c->B * c->Tk; i++) x->mask[i] = rnd_int(0, 10) != 0;
    for (int64_t j = 0; j < 3 && j < c->Tk && c->B > 1; j++) x->mask[c->Tk + j] = 0; /* rows that see no key */
  }
}

/* Device copies of the inputs, pointed at by *d (a copy of x->a). */
static void to_device(const ainst *x, tp_attention_args *d, float **dqkv, float **dkc, float **dvc) {
  *d = x->a;
  *dqkv = DPUTF(x->qkv, x->nqkv);
  d->q = *dqkv;
  d->o = DPUTF(x->o, x->no);
  if (x->ring) { /* the ring, not the linear cache */
    int64_t nr = (x->slot ? x->a.kv_batch : x->a.B) * x->ring * x->a.kv_ld + 1;
    *dkc = DPUTF(x->rkc, nr), *dvc = DPUTF(x->rvc, nr);
    d->k = *dkc, d->v = *dvc;
    d->Tk = x->ring, d->kv_ring = x->ring, d->kv_bstride = x->ring * x->a.kv_ld;
    d->q_pos = DPUTI(x->qpos, x->a.B), d->k_len = DPUTI(x->klen, x->a.B);
    if (x->slot) d->kv_slot = DPUTI(x->slot, x->a.B);
  } else if (x->kc) {
    *dkc = DPUTF(x->kc, x->nkv), *dvc = DPUTF(x->vc, x->nkv);
    d->k = *dkc, d->v = *dvc;
    d->q_pos = DPUTI(x->qpos, x->a.B), d->k_len = DPUTI(x->klen, x->a.B);
    if (x->slot) d->kv_slot = DPUTI(x->slot, x->a.B);
  } else {
    *dkc = *dvc = NULL;
    d->k = *dqkv + x->a.Hq * x->a.D, d->v = *dqkv + (x->a.Hq + x->a.Hk) * x->a.D;
  }
  if (x->mask) d->key_mask = dput(x->mask, (size_t)(x->a.B * x->a.Tk));
}

/* Host pointers of the same layout, for the reference. */
static tp_attention_args host_args(const ainst *x) {
  tp_attention_args a = x->a;
  a.q = x->qkv, a.o = x->o;
  a.k = x->kc ? x->kc : x->qkv + a.Hq * a.D;
  a.v = x->vc ? x->vc : x->qkv + (a.Hq + a.Hk) * a.D;
  a.q_pos = x->qpos, a.k_len = x->klen, a.key_mask = x->mask, a.kv_slot = x->slot;
  return a;
}

#define QAT(a, b, i, h) ((a)->q + ((b) * (a)->Tq + (i)) * (a)->q_ld + (h) * (a)->D)
#define KAT(a, p, b, j, g) \
  ((p) + ((a)->kv_slot ? (a)->kv_slot[b] : (b)) * (a)->kv_bstride + (j) * (a)->kv_ld + (g) * (a)->D)

/* P [B, Hq, Tq, Tk] and O (layout of o, other elements as in o) in double; mo: O's tolerance
 * scale; L [B, Hq, Tq] the log-sum-exp of each row's scaled scores (-inf: no visible key). */
static void reference_forward(const tp_attention_args *a, const float *o0, int64_t no, double *P, double *O, double *mo,
                              double *L) {
  for (int64_t i = 0; i < no; i++) O[i] = o0[i], mo[i] = 0;
  for (int64_t b = 0; b < a->B; b++)
    for (int64_t h = 0; h < a->Hq; h++)
      for (int64_t i = 0; i < a->Tq; i++) {
        int64_t g = kv_head(a, h);
        double *p = P + ((b * a->Hq + h) * a->Tq + i) * a->Tk, mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < a->Tk; j++) {
          p[j] = -INFINITY;
          if (!visible(a, b, i, j)) continue;
          double s = 0;
          for (int64_t d = 0; d < a->D; d++) s += (double)QAT(a, b, i, h)[d] * KAT(a, a->k, b, j, g)[d];
          p[j] = s * a->scale;
          if (a->softcap > 0) p[j] = a->softcap * tanh(p[j] / a->softcap);
          mx = fmax(mx, p[j]);
        }
        for (int64_t j = 0; j < a->Tk; j++) sum += p[j] == -INFINITY ? 0 : exp(p[j] - mx);
        L[(b * a->Hq + h) * a->Tq + i] = mx == -INFINITY ? -INFINITY : mx + log(sum);
        for (int64_t j = 0; j < a->Tk; j++) p[j] = p[j] == -INFINITY ? 0 : exp(p[j] - mx) / sum;
        double *orow = O + (b * a->Tq + i) * a->o_ld + h * a->D, *mrow = mo + (b * a->Tq + i) * a->o_ld + h * a->D;
        for (int64_t d = 0; d < a->D; d++) {
          orow[d] = 0, mrow[d] = 1;
          for (int64_t j = 0; j < a->Tk; j++) orow[d] += p[j] * KAT(a, a->v, b, j, g)[d];
        }
      }
}

void case_attention_workspace(void) {
  for (size_t c = 0; c < NAC; c++) {
    ainst x;
    make(&AC[c], &x);
    static float stand_in; /* the workspace depends on which of probs and lse are kept */
    for (int bwd = 0; bwd < 4; bwd++) {
      x.a.lse = bwd & 2 ? &stand_in : NULL, x.a.probs = bwd & 2 ? NULL : &stand_in;
      size_t n = K->attention_workspace(&x.a, bwd & 1);
      if (x.a.B == 0 && n) fail("case %zu: no sequences need no workspace, got %zu bytes", c, n);
      if (n == SIZE_MAX) fail("case %zu: workspace size overflowed", c);
    }
  }
}

static void paged_forward(void);

void case_attention_forward(void) {
  for (size_t c = 0; c < NAC; c++)
    for (int mode = 0; mode < 5; mode++) { /* probs kept; no probs (scratch); no probs, a one-block
                                              workspace; lse kept (no probs); probs and lse kept */
      ainst x;
      make(&AC[c], &x);
      tp_attention_args ha = host_args(&x), d;
      int64_t np = x.a.B * x.a.Hq * x.a.Tq * x.a.Tk, nl = x.a.B * x.a.Hq * x.a.Tq;
      double *P = dz(np + 1), *O = dz(x.no), *mo = dz(x.no), *L = dz(nl + 1);
      reference_forward(&ha, x.o, x.no, P, O, mo, L);
      if (x.ring && (mode == 0 || mode == 4)) continue; /* a ring takes no probs */
      float *dqkv, *dkc, *dvc, *dp = mode == 0 || mode == 4 ? dmem((size_t)np * 4) : NULL;
      float *dl = mode >= 3 ? dmem((size_t)nl * 4) : NULL;
      to_device(&x, &d, &dqkv, &dkc, &dvc);
      d.probs = dp, d.lse = dl;
      size_t need = K->attention_workspace(&d, 0);
      if (mode == 2 && need) need = (size_t)(64 * (d.Tk ? d.Tk : 1)) * sizeof(float); /* the CPU's block */
      if (mode == 2 && strcmp(K->name, "cpu")) need = K->attention_workspace(&d, 0);
      void *ws = need ? dmem(need) : NULL;
      ok("attention_forward", K->attention_forward(NULL, &d, ws, need));
      float *got = hmem((size_t)(x.no > np ? (x.no > nl ? x.no : nl) : (np > nl ? np : nl)) * 4 + 4);
      GETF(got, d.o, x.no);
      /* scores: a D-term dot (<= (D + 2) u D scale), softmax with fexp (1e-7) and a float sum
       * over <= 80 keys: P within ~3e-6 relative; O = P V within ~1e-5 of |V| <= 1 */
      expect("o", got, O, x.no, 2e-5, 0, mo);
      if (dp) {
        GETF(got, dp, np);
        expect("probs", got, P, np, 1e-5, 0, NULL);
      }
      if (dl) { /* scores within (D + 2) u sqrt(D) <= 1e-6; log of a sum of fexp within ~1e-6 */
        GETF(got, dl, nl);
        expect("lse", got, L, nl, 1e-5, 1e-6, NULL);
      }
    }
  paged_forward();
}

/* A paged KV cache (kv_block_table): each decode case's cache (no ring) copied into a pool of
 * blocks of bs rows in a shuffled order, some blocks no block (-1: past k_len, and one hole
 * inside a row's keys, which the reference sees as masked keys), read against the reference
 * over the linear cache; probs kept or not, lse. */
static void paged_forward(void) {
  const int64_t sizes[3] = {1, 5, 16};
  for (size_t c = 0; c < NAC; c++)
    for (int si = 0; si < 3; si++) {
      if (!AC[c].decode || AC[c].ring) continue;
      ainst x;
      make(&AC[c], &x);
      tp_attention_args ha = host_args(&x), d;
      const int64_t B = x.a.B, Tk = x.a.Tk, ld = x.a.kv_ld, bs = sizes[si], cols = (Tk + bs - 1) / bs + 1;
      const int64_t nb = B * cols + 2;
      int64_t *tab = hmem((size_t)(B * cols) * 8 + 8), *perm = hmem((size_t)nb * 8);
      for (int64_t i = 0; i < nb; i++) perm[i] = i;
      for (int64_t i = nb - 1; i > 0; i--) {
        int64_t j = rnd_int(0, i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
      }
      uint8_t *mask = hmem((size_t)(B * Tk) + 1); /* the reference's view: the case's mask and the holes */
      for (int64_t i = 0; i < B * Tk; i++) mask[i] = x.mask ? x.mask[i] : 1;
      float *pk = rnd(nb * bs * ld, -1, 1), *pv = rnd(nb * bs * ld, -1, 1);
      for (int64_t b = 0; b < B; b++) {
        int64_t sq = x.slot ? x.slot[b] : b, hole = x.klen[b] > 2 * bs ? 1 : -1; /* block 1: a hole */
        for (int64_t col = 0; col < cols; col++) {
          int64_t e = col * bs < x.klen[b] && col != hole ? perm[b * cols + col] : -1;
          tab[b * cols + col] = e;
          for (int64_t r = 0; r < bs && col * bs + r < Tk; r++) {
            int64_t j = col * bs + r;
            if (e < 0) mask[b * Tk + j] = 0;
            else
              for (int64_t q = 0; q < ld; q++) {
                pk[(e * bs + r) * ld + q] = x.kc[sq * x.a.kv_bstride + j * ld + q];
                pv[(e * bs + r) * ld + q] = x.vc[sq * x.a.kv_bstride + j * ld + q];
              }
          }
        }
      }
      ha.key_mask = mask;
      int64_t np = B * x.a.Hq * x.a.Tq * Tk, nl = B * x.a.Hq * x.a.Tq;
      double *P = dz(np + 1), *O = dz(x.no), *mo = dz(x.no), *L = dz(nl + 1);
      reference_forward(&ha, x.o, x.no, P, O, mo, L);
      for (int mode = 0; mode < 3; mode++) { /* probs kept; scratch; lse kept */
        float *dqkv, *dkc, *dvc;
        to_device(&x, &d, &dqkv, &dkc, &dvc);
        d.k = DPUTF(pk, nb * bs * ld), d.v = DPUTF(pv, nb * bs * ld), d.kv_slot = NULL, d.kv_batch = nb;
        d.kv_bstride = bs * ld, d.kv_block_table = DPUTI(tab, B * cols), d.kv_block_cols = cols, d.kv_block_size = bs;
        d.probs = mode == 0 ? dmem((size_t)np * 4) : NULL, d.lse = mode == 2 ? dmem((size_t)nl * 4) : NULL;
        size_t need = K->attention_workspace(&d, 0);
        ok("attention_forward (paged)", K->attention_forward(NULL, &d, need ? dmem(need) : NULL, need));
        float *got = hmem((size_t)(x.no > np ? (x.no > nl ? x.no : nl) : (np > nl ? np : nl)) * 4 + 4);
        GETF(got, d.o, x.no);
        expect("o (paged)", got, O, x.no, 2e-5, 0, mo);
        if (d.probs) {
          GETF(got, d.probs, np);
          expect("probs (paged)", got, P, np, 1e-5, 0, NULL);
        }
        if (d.lse) {
          GETF(got, d.lse, nl);
          expect("lse (paged)", got, L, nl, 1e-5, 1e-6, NULL);
        }
      }
    }
}

/* The table's own forward keeps probs and lse; backward from each gives the same dq, dk, dv. */
static void backward_lse_equals_probs(void) {
  for (size_t c = 0; c < NAC; c++) {
    if (AC[c].decode) continue;
    ainst x;
    make(&AC[c], &x);
    tp_attention_args d;
    int64_t np = x.a.B * x.a.Hq * x.a.Tq * x.a.Tk, nl = x.a.B * x.a.Hq * x.a.Tq, D = x.a.D;
    float *dqkv, *dkc, *dvc;
    to_device(&x, &d, &dqkv, &dkc, &dvc);
    d.probs = dmem((size_t)np * 4), d.lse = dmem((size_t)nl * 4);
    size_t need = K->attention_workspace(&d, 0);
    ok("attention_forward (probs and lse)", K->attention_forward(NULL, &d, need ? dmem(need) : NULL, need));
    float *dout = DPUTF(rnd(x.no, -1, 1), x.no), *g[2];
    for (int m = 0; m < 2; m++) { /* 0: from probs, 1: from lse */
      tp_attention_args e = d;
      if (m) e.probs = NULL;
      else e.lse = NULL;
      float *dg = DPUTF(rnd(x.nqkv, -1, 1), x.nqkv);
      need = K->attention_workspace(&e, 1);
      ok("attention_backward", K->attention_backward(NULL, &e, dg, dg + x.a.Hq * D, dg + (x.a.Hq + x.a.Hk) * D, dout,
                                                     need ? dmem(need) : NULL, need));
      g[m] = hmem((size_t)x.nqkv * 4);
      GETF(g[m], dg, x.nqkv);
    }
    /* the columns no kernel writes (the padding, the garbage) differ: compare q, k, v columns;
     * the two differ by P's float rounding (recomputed vs kept): ~1e-6 of terms up to |dO| |V| */
    double *ref = dz(x.nqkv);
    for (int64_t i = 0; i < x.nqkv; i++) ref[i] = g[0][i];
    for (int64_t r = 0; r < x.a.B * x.a.Tq; r++)
      expect("dqkv from lse vs from probs", g[1] + r * x.W, ref + r * x.W, (x.a.Hq + 2 * x.a.Hk) * D, 1e-4, 1e-4, NULL);
  }
}

void case_attention_backward(void) {
  for (size_t c = 0; c < NAC; c++)
    for (int mode = 0; mode < 4; mode++) { /* probs: the asked workspace, one block of dP; the lse mode:
                                              the asked workspace, one block of dP and P */
      if (AC[c].decode) continue;          /* no backward through a cache */
      ainst x;
      make(&AC[c], &x);
      tp_attention_args ha = host_args(&x), d;
      const tp_attention_args *a = &ha;
      int64_t np = a->B * a->Hq * a->Tq * a->Tk, D = a->D;
      int64_t nl = a->B * a->Hq * a->Tq;
      double *P = dz(np + 1), *O = dz(x.no), *mo = dz(x.no), *L = dz(nl + 1);
      reference_forward(&ha, x.o, x.no, P, O, mo, L);
      float *pf = hmem((size_t)np * 4 + 4), *dout = rnd(x.no, -1, 1), *lf = hmem((size_t)nl * 4 + 4);
      for (int64_t i = 0; i < np; i++) pf[i] = (float)P[i]; /* the probs a forward kept */
      for (int64_t i = 0; i < nl; i++) lf[i] = (float)L[i]; /* or its log-sum-exp */
      /* dq, dk, dv in the layout of q, k, v (the fused rows): start from garbage, so that the
       * columns the kernel must not touch are checked too */
      float *g0 = rnd(x.nqkv, -1, 1);
      double *R = dz(x.nqkv), *mg = dz(x.nqkv);
      for (int64_t i = 0; i < x.nqkv; i++) R[i] = g0[i], mg[i] = 0;
      for (int64_t b = 0; b < a->B; b++) /* dK, dV of the keys are overwritten: zero them first */
        for (int64_t j = 0; j < a->Tk; j++)
          for (int64_t e = 0; e < 2 * a->Hk * D; e++) R[(b * a->Tk + j) * x.W + a->Hq * D + e] = 0;
      double *dp = dz(a->Tk + 1); /* a row of dP */
      for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->Hq; h++) {
          int64_t g = kv_head(a, h), qo = h * D, ko = a->Hq * D + g * D, vo = (a->Hq + a->Hk) * D + g * D;
          for (int64_t i = 0; i < a->Tq; i++) {
            const double *p = P + ((b * a->Hq + h) * a->Tq + i) * a->Tk;
            const float *dO = dout + (b * a->Tq + i) * a->o_ld + h * D;
            double dot = 0, adot = 0;
            for (int64_t j = 0; j < a->Tk; j++) {
              dp[j] = 0;
              for (int64_t d2 = 0; d2 < D; d2++) dp[j] += (double)dO[d2] * KAT(a, a->v, b, j, g)[d2];
              dot += dp[j] * p[j], adot += fabs(dp[j]) * p[j];
            }
            int64_t qi = (b * a->Tq + i) * x.W;
            if (!a->Tk)
              for (int64_t d2 = 0; d2 < D; d2++) R[qi + qo + d2] = 0;
            for (int64_t j = 0; j < a->Tk; j++) {
              double ds = p[j] * (dp[j] - dot) * a->scale, ms = p[j] * (fabs(dp[j]) + adot) * a->scale;
              if (a->softcap > 0 && p[j] != 0) { /* the cap's slope 1 - tanh^2 of the raw scaled score */
                double raw = 0;
                for (int64_t d2 = 0; d2 < D; d2++) raw += (double)QAT(a, b, i, h)[d2] * KAT(a, a->k, b, j, g)[d2];
                double t = tanh(raw * a->scale / a->softcap);
                ds *= 1 - t * t, ms *= 1 - t * t;
              }
              int64_t kj = (b * a->Tk + j) * x.W;
              for (int64_t d2 = 0; d2 < D; d2++) {
                if (j == 0) R[qi + qo + d2] = 0;
                R[qi + qo + d2] += ds * KAT(a, a->k, b, j, g)[d2], mg[qi + qo + d2] += ms;
                R[kj + ko + d2] += ds * QAT(a, b, i, h)[d2], mg[kj + ko + d2] += ms;
                R[kj + vo + d2] += p[j] * dO[d2], mg[kj + vo + d2] += p[j];
              }
            }
          }
        }
      float *dqkv, *dkc, *dvc;
      to_device(&x, &d, &dqkv, &dkc, &dvc);
      if (mode < 2) {
        d.probs = DPUTF(pf, np);
      } else { /* the lse mode: o is forward's output */
        float *of = hmem((size_t)x.no * 4);
        for (int64_t i = 0; i < x.no; i++) of[i] = (float)O[i];
        d.lse = DPUTF(lf, nl), d.o = DPUTF(of, x.no);
      }
      float *dg = DPUTF(g0, x.nqkv);
      size_t need = K->attention_workspace(&d, 1);
      if (mode % 2 && need && !strcmp(K->name, "cpu")) /* the CPU's one block (+1 in the lse mode, +1 with a cap) */
        need = (size_t)((mode == 3 ? 2 : 1) + (d.softcap > 0)) * (size_t)(64 * (d.Tk ? d.Tk : 1)) * sizeof(float);
      void *ws = need ? dmem(need) : NULL;
      ok("attention_backward",
         K->attention_backward(NULL, &d, dg, dg + a->Hq * D, dg + (a->Hq + a->Hk) * D, DPUTF(dout, x.no), ws, need));
      float *got = hmem((size_t)x.nqkv * 4);
      GETF(got, dg, x.nqkv);
      for (int64_t i = 0; i < x.nqkv; i++) mg[i] += 0.05; /* a floor: float rounding of terms near 0 */
      /* dP (a D-term dot) and the row dot in float: ~(D + Tk) u relative; dS, then sums over
       * keys (dq) or queries x heads (dk, dv) of terms bounded by mg: 2e-5 mg covers both */
      expect("dqkv", got, R, x.nqkv, 2e-5, 0, mg);
    }
  backward_lse_equals_probs();
}
