/*
 * C-level tests of the communicator, without Python: each world size 1..4 is
 * run as forked processes on one job id; every rank checks its results against
 * a reference it computes itself in double precision from the same
 * deterministic inputs every rank can generate.  Exit status 0 = all passed.
 * Prints one line per case and "N passed, N failed" at the end.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tpcore/comm.h"

static int g_fail = 0;
static char g_job[64];

#define EXPECT(cond, ...)                                                    \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "  rank check failed at %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                          \
      fprintf(stderr, "\n");                                                 \
      g_fail++;                                                              \
    }                                                                        \
  } while (0)

#define OK(call)                                                                                                   \
  do {                                                                                                             \
    tp_status_t st_ = (call);                                                                                      \
    if (st_ != TP_SUCCESS) {                                                                                       \
      fprintf(stderr, "  %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, tp_status_name(st_), tp_last_error()); \
      g_fail++;                                                                                                    \
      return;                                                                                                      \
    }                                                                                                              \
  } while (0)

/* Deterministic input value of element i on rank r for case `seed`: small
 * integers / 4, exact in every float type, non-zero. */
static double val(int seed, int r, size_t i) {
  uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ULL + (uint64_t)r * 0xBF58476D1CE4E5B9ULL + i * 0x94D049BB133111EBULL;
  x ^= x >> 31;
  x *= 0xD6E8FEB86969D7DULL;
  x ^= x >> 29;
  int v = (int)(x % 15) - 7;
  if (v == 0) v = 3;
  return v / 4.0;
}
static int is_float(tp_dtype_t d) { return d <= TP_BFLOAT16; }
static double ival(tp_dtype_t d, int seed, int r, size_t i) {
  double v = val(seed, r, i);
  if (is_float(d)) return v;
  v *= 4;
  if (d == TP_UINT8) v = fabs(v) + 1;
  return v;
}

static void store(void *buf, tp_dtype_t d, size_t i, double v) {
  switch (d) {
    case TP_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case TP_FLOAT64: ((double *)buf)[i] = v; break;
    case TP_FLOAT16: ((uint16_t *)buf)[i] = tp_float_to_half((float)v); break;
    case TP_BFLOAT16: ((uint16_t *)buf)[i] = tp_float_to_bf16((float)v); break;
    case TP_INT8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case TP_UINT8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case TP_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case TP_INT64: ((int64_t *)buf)[i] = (int64_t)v; break;
    default: break;
  }
}
static double load(const void *buf, tp_dtype_t d, size_t i) {
  switch (d) {
    case TP_FLOAT32: return ((const float *)buf)[i];
    case TP_FLOAT64: return ((const double *)buf)[i];
    case TP_FLOAT16: return tp_half_to_float(((const uint16_t *)buf)[i]);
    case TP_BFLOAT16: return tp_bf16_to_float(((const uint16_t *)buf)[i]);
    case TP_INT8: return ((const int8_t *)buf)[i];
    case TP_UINT8: return ((const uint8_t *)buf)[i];
    case TP_INT32: return ((const int32_t *)buf)[i];
    case TP_INT64: return (double)((const int64_t *)buf)[i];
    default: return NAN;
  }
}

/* Reference reduction of element i over ranks, with the dtype's wrap for ints. */
static double ref_reduce(tp_dtype_t d, tp_redop_t op, int seed, int n, size_t i) {
  double acc = ival(d, seed, 0, i);
  for (int r = 1; r < n; r++) {
    double v = ival(d, seed, r, i);
    switch (op) {
      case TP_SUM:
      case TP_AVG: acc += v; break;
      case TP_PROD: acc *= v; break;
      case TP_MIN: acc = v < acc ? v : acc; break;
      case TP_MAX: acc = v > acc ? v : acc; break;
      default: break;
    }
  }
  if (op == TP_AVG) acc = is_float(d) ? acc / n : trunc(acc / n);
  if (d == TP_INT8) acc = (double)(int8_t)(int64_t)acc;
  if (d == TP_UINT8) acc = (double)(uint8_t)(int64_t)acc;
  return acc;
}

static int close_enough(tp_dtype_t d, double got, double want) {
  double tol = d == TP_FLOAT16 || d == TP_BFLOAT16 ? 1e-2 : d == TP_FLOAT32 ? 1e-6 : 1e-12;
  if (!is_float(d)) return got == want;
  return fabs(got - want) <= tol * (1 + fabs(want));
}

static const size_t sizes[] = {0, 1, 7, 1021, 300007};

static void test_all_reduce(tp_comm_t c, int n, int r) {
  for (int d = 0; d < TP_NUM_DTYPES; d++) {
    for (int op = 0; op < TP_NUM_REDOPS; op++) {
      for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        size_t cnt = sizes[si];
        if (cnt > 2000 && !(op == TP_SUM || op == TP_MAX)) continue;
        size_t es = tp_dtype_size((tp_dtype_t)d);
        char *x = malloc(cnt * es + 1), *y = malloc(cnt * es + 1);
        int seed = d * 100 + op * 10 + (int)si;
        for (size_t i = 0; i < cnt; i++) store(x, (tp_dtype_t)d, i, ival((tp_dtype_t)d, seed, r, i));
        for (int inplace = 0; inplace < 2; inplace++) {
          void *out = inplace ? x : y;
          if (inplace == 1)
            for (size_t i = 0; i < cnt; i++) store(x, (tp_dtype_t)d, i, ival((tp_dtype_t)d, seed, r, i));
          OK(tp_all_reduce(x, out, cnt, (tp_dtype_t)d, (tp_redop_t)op, c, NULL));
          size_t bad = 0;
          for (size_t i = 0; i < cnt; i++)
            if (!close_enough((tp_dtype_t)d, load(out, (tp_dtype_t)d, i),
                              ref_reduce((tp_dtype_t)d, (tp_redop_t)op, seed, n, i)))
              bad++;
          EXPECT(bad == 0, "all_reduce %s %s count %zu inplace %d: %zu wrong", tp_dtype_name((tp_dtype_t)d),
                 tp_redop_name((tp_redop_t)op), cnt, inplace, bad);
        }
        free(x);
        free(y);
      }
    }
  }
}

static void test_gather_scatter(tp_comm_t c, int n, int r) {
  tp_dtype_t d = TP_FLOAT32;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    size_t base = sizes[si];
    size_t counts[4], displ[5] = {0}, total = 0;
    for (int p = 0; p < n; p++) {
      counts[p] = base + (size_t)p * (base % 5); /* uneven when base % 5 != 0 */
      displ[p + 1] = displ[p] + counts[p];
      total += counts[p];
    }
    float *x = malloc(total * 4 + 4), *y = malloc(total * 4 + 4);
    /* all_gather_v */
    for (size_t i = 0; i < counts[r]; i++) x[i] = (float)val(7, r, i);
    OK(tp_all_gather_v(x, y, counts, d, c, NULL));
    size_t bad = 0;
    for (int p = 0; p < n; p++)
      for (size_t i = 0; i < counts[p]; i++) bad += y[displ[p] + i] != (float)val(7, p, i);
    EXPECT(bad == 0, "all_gather_v base %zu: %zu wrong", base, bad);
    /* reduce_scatter_v */
    for (size_t i = 0; i < total; i++) x[i] = (float)val(8, r, i);
    OK(tp_reduce_scatter_v(x, y, counts, d, TP_SUM, c, NULL));
    bad = 0;
    for (size_t i = 0; i < counts[r]; i++) {
      double want = 0;
      for (int p = 0; p < n; p++) want += val(8, p, displ[r] + i);
      bad += !close_enough(d, y[i], want);
    }
    EXPECT(bad == 0, "reduce_scatter_v base %zu: %zu wrong", base, bad);
    /* broadcast and reduce from every root */
    for (int root = 0; root < n; root++) {
      for (size_t i = 0; i < total; i++) x[i] = (float)val(9 + root, r, i);
      OK(tp_broadcast(x, x, total, d, root, c, NULL));
      bad = 0;
      for (size_t i = 0; i < total; i++) bad += x[i] != (float)val(9 + root, root, i);
      EXPECT(bad == 0, "broadcast root %d count %zu: %zu wrong", root, total, bad);
      for (size_t i = 0; i < total; i++) x[i] = (float)val(20 + root, r, i);
      OK(tp_reduce(x, y, total, d, TP_MAX, root, c, NULL));
      if (r == root) {
        bad = 0;
        for (size_t i = 0; i < total; i++) bad += y[i] != (float)ref_reduce(d, TP_MAX, 20 + root, n, i);
        EXPECT(bad == 0, "reduce root %d count %zu: %zu wrong", root, total, bad);
      }
    }
    free(x);
    free(y);
  }
  OK(tp_barrier(c, NULL));
}

/* Elements rank `from` sends rank `to` in all_to_all case `base`: uneven, some zero. */
static size_t a2a_count(size_t base, int from, int to) {
  if ((from + 2 * to) % 5 == 3) return 0;
  return base + (size_t)((from * 7 + to * 3) % 11) * (base / 8 + 1);
}

static void test_all_to_all(tp_comm_t c, int n, int r) {
  const size_t bases[] = {0, 1, 7, 1021, 300007};
  for (size_t bi = 0; bi < sizeof bases / sizeof *bases; bi++) {
    size_t base = bases[bi], sc[4], rc[4], sd[5] = {0}, rd[5] = {0};
    for (int p = 0; p < n; p++) {
      sc[p] = a2a_count(base, r, p);
      rc[p] = a2a_count(base, p, r);
      sd[p + 1] = sd[p] + sc[p];
      rd[p + 1] = rd[p] + rc[p];
    }
    double *x = malloc(sd[n] * 8 + 8), *y = malloc(rd[n] * 8 + 8);
    for (int p = 0; p < n; p++) /* element i of the block to p: val(30 + p, r, i) */
      for (size_t i = 0; i < sc[p]; i++) x[sd[p] + i] = val(30 + p, r, i);
    OK(tp_all_to_all(x, sc, y, rc, TP_FLOAT64, c, NULL));
    size_t bad = 0;
    for (int p = 0; p < n; p++)
      for (size_t i = 0; i < rc[p]; i++) bad += y[rd[p] + i] != val(30 + r, p, i);
    EXPECT(bad == 0, "all_to_all base %zu: %zu wrong", base, bad);
    free(x);
    free(y);
  }
  size_t sc[4] = {0}, rc[4] = {0};
  double x[4] = {0}, y[8] = {0};
  for (int p = 0; p < n; p++) sc[p] = rc[p] = 1;
  rc[r] = 2; /* this rank to itself: refused here, before any rank waits */
  tp_status_t st = tp_all_to_all(x, sc, y, rc, TP_FLOAT64, c, NULL);
  EXPECT(st == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "recv_counts"), "self block: %s", tp_last_error());
  rc[r] = 1;
  st = tp_all_to_all(x, sc, x, rc, TP_FLOAT64, c, NULL); /* no in-place form */
  EXPECT(st == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "overlap"), "in place: %s", tp_last_error());
  if (n < 2) return;
  if (r == 0) rc[1] = 2; /* rank 0 expects 2 from rank 1, which sends 1: every rank names both */
  st = tp_all_to_all(x, sc, y, rc, TP_FLOAT64, c, NULL);
  EXPECT(st == TP_ERR_MISMATCH && strstr(tp_last_error(), "rank 1 sends 1 elements to rank 0") &&
             strstr(tp_last_error(), "rank 0 expects 2 from rank 1"),
         "mismatched counts gave %s: %s", tp_status_name(st), tp_last_error());
}

static void test_p2p_split_registered(tp_comm_t c, int n, int r) {
  /* Ring with sendrecv, message larger than the eager size. */
  size_t cnt = 200003;
  double *x = malloc(cnt * 8), *y = malloc(cnt * 8);
  for (size_t i = 0; i < cnt; i++) x[i] = val(30, r, i);
  OK(tp_sendrecv(x, cnt, (r + 1) % n, y, cnt, (r + n - 1) % n, TP_FLOAT64, c, NULL));
  size_t bad = 0;
  for (size_t i = 0; i < cnt; i++) bad += y[i] != val(30, (r + n - 1) % n, i);
  EXPECT(bad == 0, "sendrecv ring: %zu wrong", bad);
  /* Plain send / recv, ordered to avoid deadlock. */
  if (n > 1) {
    if (r == 0) {
      OK(tp_send(x, 1000, TP_FLOAT64, 1, c, NULL));
    } else if (r == 1) {
      OK(tp_recv(y, 1000, TP_FLOAT64, 0, c, NULL));
      bad = 0;
      for (size_t i = 0; i < 1000; i++) bad += y[i] != val(30, 0, i);
      EXPECT(bad == 0, "send/recv: %zu wrong", bad);
    }
  }
  free(x);
  free(y);
  /* Split by parity; reverse order by key. */
  tp_comm_t sub = NULL;
  OK(tp_comm_split(c, r % 2, -r, &sub));
  int sr, ss;
  OK(tp_comm_rank(sub, &sr));
  OK(tp_comm_size(sub, &ss));
  EXPECT(ss == (n + 1 - r % 2) / 2, "split size %d", ss);
  int32_t v = r, sum = 0;
  OK(tp_all_reduce(&v, &sum, 1, TP_INT32, TP_SUM, sub, NULL));
  int32_t want = 0;
  for (int p = r % 2; p < n; p += 2) want += p;
  EXPECT(sum == want, "split all_reduce %d != %d", sum, want);
  tp_comm_destroy(sub);
  tp_comm_t none = (tp_comm_t)1;
  OK(tp_comm_split(c, r == 0 ? 0 : TP_SPLIT_NOCOLOR, 0, &none));
  EXPECT((r == 0) == (none != NULL), "nocolor split");
  tp_comm_destroy(none);
  /* Registered memory: in-place all_reduce and all_gather read peers in place. */
  size_t rc = 1 << 20;
  float *buf;
  tp_mem_t h;
  OK(tp_comm_mem_alloc(c, rc * 4 * (size_t)n, (void **)&buf, &h));
  for (size_t i = 0; i < rc; i++) buf[i] = (float)val(40, r, i);
  OK(tp_all_reduce(buf, buf, rc, TP_FLOAT32, TP_SUM, c, NULL));
  bad = 0;
  for (size_t i = 0; i < rc; i++) bad += !close_enough(TP_FLOAT32, buf[i], ref_reduce(TP_FLOAT32, TP_SUM, 40, n, i));
  EXPECT(bad == 0, "registered all_reduce: %zu wrong", bad);
  for (size_t i = 0; i < rc; i++) buf[r * rc + i] = (float)val(41, r, i);
  OK(tp_all_gather(buf + r * rc, buf, rc, TP_FLOAT32, c, NULL));
  bad = 0;
  for (int p = 0; p < n; p++)
    for (size_t i = 0; i < rc; i++) bad += buf[p * rc + i] != (float)val(41, p, i);
  EXPECT(bad == 0, "registered all_gather: %zu wrong", bad);
  tp_comm_stats_t stats;
  OK(tp_comm_get_stats(c, &stats));
  EXPECT(n == 1 || stats.zero_copy >= 2, "registered path not taken (%llu)", (unsigned long long)stats.zero_copy);
  tp_mem_release(h);
}

static void test_errors(tp_comm_t c, int n, int r) {
  float x[16] = {0};
  /* Bad arguments fail locally and leave the communicator usable. */
  EXPECT(tp_all_reduce(x, x, 4, (tp_dtype_t)99, TP_SUM, c, NULL) == TP_ERR_INVALID_ARGUMENT, "bad dtype");
  EXPECT(tp_all_reduce(x, x, 4, TP_FLOAT32, (tp_redop_t)9, c, NULL) == TP_ERR_INVALID_ARGUMENT, "bad op");
  EXPECT(tp_broadcast(x, x, 4, TP_FLOAT32, n, c, NULL) == TP_ERR_INVALID_ARGUMENT, "bad root");
  EXPECT(strstr(tp_last_error(), "invalid root") != NULL, "message: %s", tp_last_error());
  EXPECT(tp_all_reduce(NULL, x, 4, TP_FLOAT32, TP_SUM, c, NULL) == TP_ERR_INVALID_ARGUMENT, "null send");
  EXPECT(tp_all_reduce(x, x + 1, 4, TP_FLOAT32, TP_SUM, c, NULL) == TP_ERR_INVALID_ARGUMENT, "partial overlap");
  /* Zero elements: NULL buffers are fine (and must not reach memcpy). */
  OK(tp_all_reduce(NULL, NULL, 0, TP_FLOAT32, TP_SUM, c, NULL));
  OK(tp_broadcast(NULL, NULL, 0, TP_INT8, 0, c, NULL));
  OK(tp_all_gather(NULL, NULL, 0, TP_FLOAT64, c, NULL));
  OK(tp_reduce_scatter(NULL, NULL, 0, TP_FLOAT64, TP_MAX, c, NULL));
  OK(tp_barrier(c, NULL));
  /* A host backend takes no stream: a clear argument error, before any rank waits. */
  tp_stream_t fake = (tp_stream_t)(void *)x;
  EXPECT(tp_all_reduce(x, x, 4, TP_FLOAT32, TP_SUM, c, fake) == TP_ERR_INVALID_ARGUMENT, "stream");
  EXPECT(strstr(tp_last_error(), "all_reduce: backend shm runs on the host and takes no stream; pass NULL"),
         "stream message: %s", tp_last_error());
  EXPECT(tp_barrier(c, fake) == TP_ERR_INVALID_ARGUMENT, "barrier stream");
  EXPECT(tp_sendrecv(x, 1, r, x + 8, 1, r, TP_FLOAT32, c, fake) == TP_ERR_INVALID_ARGUMENT, "sendrecv stream");
  if (n > 1)
    EXPECT(
        tp_send(x, 1, TP_FLOAT32, (r + 1) % n, c, fake) == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "send:"),
        "send stream: %s", tp_last_error());
  unsigned mask = 0;
  OK(tp_comm_devices(c, &mask));
  EXPECT(mask == (1u << TP_DEVICE_CPU), "devices mask %#x", mask);
  OK(tp_barrier(c, NULL)); /* still usable */
  if (n < 2) return;
  /* Mismatch: rank 0 all_reduce of 16, the others all_gather: everybody fails. */
  tp_status_t st = r == 0 ? tp_all_reduce(x, x, 16, TP_FLOAT32, TP_SUM, c, NULL)
                          : tp_all_gather(x, x + 8, 8 / n, TP_FLOAT32, c, NULL);
  EXPECT(st == TP_ERR_MISMATCH || st == TP_ERR_REMOTE, "mismatch gave %s", tp_status_name(st));
  EXPECT(strstr(tp_last_error(), "all_gather") && strstr(tp_last_error(), "all_reduce"),
         "mismatch message names both: %s", tp_last_error());
  /* The communicator is now unusable, with a clear error. */
  st = tp_barrier(c, NULL);
  EXPECT(st != TP_SUCCESS, "barrier after mismatch succeeded");
}

/* The history ring, call sites, regions and their statistics; the ring size from
 * TPCORE_HISTORY (a split reads it); a desync named with every rank's site. */
static void test_history(tp_comm_t c, int n, int r) {
  float x[8];
  for (int i = 0; i < 8; i++) x[i] = (float)(r + i + 1);
  OK(tp_comm_set_site(c, "a.c:1"));
  OK(tp_all_reduce(x, x, 5, TP_FLOAT32, TP_SUM, c, NULL));
  const char *prev = tp_comm_set_region(c, "mlp");
  EXPECT(prev && strcmp(prev, "other") == 0, "previous region %s", prev ? prev : "(null)");
  OK(tp_barrier(c, NULL));
  EXPECT(strcmp(tp_comm_set_region(c, prev), "mlp") == 0, "set_region returns the tag it replaces");
  OK(tp_comm_set_site(c, NULL));
  OK(tp_broadcast(x, x, 3, TP_FLOAT32, n - 1, c, NULL));
  for (int i = 0; i < 3; i++)
    EXPECT(x[i] == (float)(n * (n - 1) / 2 + n * (i + 1)), "x[%d] = %g", i, x[i]); /* summed, then broadcast */
  tp_coll_record_t h[8];
  int k = -1;
  OK(tp_comm_history(c, h, 8, &k));
  EXPECT(k == 3, "history holds %d", k);
  if (k == 3) {
    EXPECT(h[0].seq == 1 && strcmp(h[0].op, "all_reduce") == 0 && h[0].redop == TP_SUM && h[0].dtype == TP_FLOAT32 &&
               h[0].count == 5 && h[0].root == -1 && strcmp(h[0].site, "a.c:1") == 0 &&
               strcmp(h[0].region, "other") == 0,
           "entry 0: %s %s", h[0].op, h[0].site);
    EXPECT(h[1].seq == 2 && strcmp(h[1].op, "barrier") == 0 && h[1].dtype == -1 && strcmp(h[1].site, "a.c:1") == 0 &&
               strcmp(h[1].region, "mlp") == 0,
           "entry 1: %s %s %s", h[1].op, h[1].site, h[1].region);
    EXPECT(h[2].seq == 3 && strcmp(h[2].op, "broadcast") == 0 && h[2].root == n - 1 && strcmp(h[2].site, "C") == 0,
           "entry 2: %s %s", h[2].op, h[2].site);
    for (int i = 0; i < 3; i++)
      EXPECT(h[i].status == TP_SUCCESS && h[i].seconds >= 0 && (i == 0 || h[i].start >= h[i - 1].start), "entry %d", i);
  }
  k = -1;
  OK(tp_comm_history(c, NULL, 0, &k)); /* max 0: how many it holds */
  EXPECT(k == 3, "max 0: holds %d", k);
  OK(tp_comm_history(c, h, 1, &k)); /* the newest only */
  EXPECT(k == 1 && h[0].seq == 3, "max 1: %d entries, seq %llu", k, (unsigned long long)h[0].seq);
  uint64_t seq = 0;
  OK(tp_comm_seq(c, &seq)); /* the last collective's number (the next one's is seq + 1) */
  EXPECT(seq == 3, "tp_comm_seq %llu", (unsigned long long)seq);
  EXPECT(tp_comm_seq(c, NULL) == TP_ERR_INVALID_ARGUMENT && tp_comm_seq(NULL, &seq) == TP_ERR_INVALID_ARGUMENT,
         "tp_comm_seq: NULL argument");
  tp_comm_region_stats_t rs[4];
  OK(tp_comm_region_stats(c, rs, 4, &k));
  EXPECT(k == 2 && strcmp(rs[0].name, "other") == 0 && rs[0].calls == 2 && rs[0].bytes == 8 * sizeof(float) &&
             strcmp(rs[1].name, "mlp") == 0 && rs[1].calls == 1 && rs[1].bytes == 0,
         "region stats (%d)", k);
  tp_comm_stats_t st;
  OK(tp_comm_get_stats(c, &st));
  EXPECT(k == 2 && fabs(rs[0].seconds + rs[1].seconds - st.seconds) < 1e-12, "regions add up");
  /* Bad arguments; a long site is cut, not overrun. */
  EXPECT(tp_comm_history(c, NULL, 4, &k) == TP_ERR_INVALID_ARGUMENT, "NULL out");
  EXPECT(tp_comm_history(c, h, -1, &k) == TP_ERR_INVALID_ARGUMENT, "negative max");
  EXPECT(tp_comm_region_stats(NULL, rs, 4, &k) == TP_ERR_INVALID_ARGUMENT, "NULL comm");
  EXPECT(tp_comm_set_region(NULL, "x") == NULL && tp_comm_set_site(NULL, "x") == TP_ERR_INVALID_ARGUMENT, "NULL comm");
  char longsite[200];
  memset(longsite, 'y', sizeof longsite - 1);
  longsite[sizeof longsite - 1] = '\0';
  OK(tp_comm_set_site(c, longsite));
  OK(tp_barrier(c, NULL));
  OK(tp_comm_history(c, h, 1, &k));
  EXPECT(strlen(h[0].site) == TP_COMM_SITE_MAX - 1, "site cut to %zu", strlen(h[0].site));
  /* TPCORE_HISTORY: a split's ring of 3; 0 keeps none; a bad value is refused by name. */
  setenv("TPCORE_HISTORY", "3", 1);
  tp_comm_t s = NULL;
  OK(tp_comm_split(c, 0, r, &s));
  setenv("TPCORE_HISTORY", "bad", 1);
  tp_comm_t bad = NULL;
  EXPECT(tp_comm_split(c, 0, r, &bad) == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "TPCORE_HISTORY") && !bad,
         "bad TPCORE_HISTORY: %s", tp_last_error());
  unsetenv("TPCORE_HISTORY");
  if (!s) return;
  for (int i = 0; i < 5; i++) OK(tp_barrier(s, NULL));
  int cap = 0;
  OK(tp_comm_history_capacity(s, &cap));
  OK(tp_comm_history(s, h, 8, &k));
  EXPECT(cap == 3 && k == 3 && h[0].seq == 3 && h[2].seq == 5, "split ring: cap %d, %d entries", cap, k);
  /* A desync, named with both sites on every rank. */
  if (n > 1) {
    OK(tp_comm_set_site(s, r == 0 ? "x.c:1" : "y.c:2"));
    tp_status_t e = r == 0 ? tp_all_reduce(x, x, 4, TP_FLOAT32, TP_SUM, s, NULL) : tp_barrier(s, NULL);
    EXPECT(e == TP_ERR_MISMATCH, "desync gave %s", tp_status_name(e));
    EXPECT(
        strstr(tp_last_error(), "all_reduce(sum, 4 float32) at x.c:1") && strstr(tp_last_error(), "barrier at y.c:2"),
        "desync message: %s", tp_last_error());
    OK(tp_comm_history(s, h, 8, &k));
    EXPECT(k == 3 && h[2].status == TP_ERR_MISMATCH && h[2].seq == 6, "failed entry: %d", k);
  }
  tp_comm_destroy(s);
}

/* Registered memory turned off (config field or TPCORE_REGISTERED_MEMORY=0):
 * mem_alloc declines with TP_ERR_UNSUPPORTED, on splits too; collectives work. */
static void test_registered_off(int n, int r, const char *job) {
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  cfg.job_id = job;
  cfg.timeout_s = 30;
  cfg.registered_memory = 0;
  tp_comm_t c;
  OK(tp_comm_init_rank(&c, n, r, &cfg));
  void *p = (void *)1;
  tp_mem_t h = (tp_mem_t)1;
  EXPECT(tp_comm_mem_alloc(c, 4096, &p, &h) == TP_ERR_UNSUPPORTED && !p && !h, "declined");
  EXPECT(strstr(tp_last_error(), "registered memory is turned off"), "message: %s", tp_last_error());
  tp_comm_t sub = NULL;
  OK(tp_comm_split(c, 0, r, &sub));
  EXPECT(tp_comm_mem_alloc(sub, 4096, &p, &h) == TP_ERR_UNSUPPORTED, "split declines too");
  tp_comm_destroy(sub);
  float x = 1;
  OK(tp_all_reduce(&x, &x, 1, TP_FLOAT32, TP_SUM, c, NULL));
  EXPECT(x == n, "all_reduce %g", x);
  tp_comm_destroy(c);
  /* The environment variable does the same when the config leaves it unset. */
  char job2[96];
  snprintf(job2, sizeof job2, "%s_env", job);
  cfg = (tp_comm_config_t)TP_COMM_CONFIG_INITIALIZER;
  cfg.job_id = job2;
  cfg.timeout_s = 30;
  setenv("TPCORE_REGISTERED_MEMORY", "0", 1);
  OK(tp_comm_init_rank(&c, n, r, &cfg));
  unsetenv("TPCORE_REGISTERED_MEMORY");
  EXPECT(tp_comm_mem_alloc(c, 4096, &p, &h) == TP_ERR_UNSUPPORTED, "env declines");
  tp_comm_destroy(c);
  /* An unknown backend names the known ones. */
  cfg.backend = "carrier-pigeon";
  EXPECT(tp_comm_init_rank(&c, n, r, &cfg) == TP_ERR_UNSUPPORTED && strstr(tp_last_error(), "available: shm"),
         "unknown backend: %s", tp_last_error());
}

/* The waits in each of their modes give the same results: the adaptive default
 * (short and long waits: a rank that arrives late makes the others spin past the
 * first probe, or sleep), a fixed spin (config spin_us), and no spin
 * (TPCORE_SPIN_US=0). */
static void test_wait_modes(int n, int r, const char *job) {
  for (int mode = 0; mode < 3; mode++) {
    tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
    char id[96];
    snprintf(id, sizeof id, "%s_m%d", job, mode);
    cfg.job_id = id;
    cfg.timeout_s = 30;
    if (mode == 1) cfg.spin_us = 20;
    if (mode == 2) setenv("TPCORE_SPIN_US", "0", 1);
    tp_comm_t c;
    OK(tp_comm_init_rank(&c, n, r, &cfg));
    unsetenv("TPCORE_SPIN_US");
    for (int i = 0; i < 300; i++) {
      if (n > 1 && r == i % n && i % 7 == 0) usleep(i % 2 ? 100 : 3000); /* a late rank */
      int32_t v = r + i, sum = 0;
      OK(tp_all_reduce(&v, &sum, 1, TP_INT32, TP_SUM, c, NULL));
      EXPECT(sum == n * i + n * (n - 1) / 2, "mode %d call %d: %d", mode, i, sum);
    }
    OK(tp_barrier(c, NULL));
    tp_comm_destroy(c);
  }
}

/* How many names of `job` /dev/shm holds (the shm backend's: tpcore_<job>_...). */
static int job_names(const char *job) {
  char prefix[128];
  snprintf(prefix, sizeof prefix, "tpcore_%s_", job);
  DIR *d = opendir("/dev/shm");
  if (!d) return -1;
  int k = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) k += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  closedir(d);
  return k;
}

/* A job id no other job can have (config job_id_unique): once init, a split and an
 * alloc have returned, no name of the job is left in /dev/shm, so ranks that end
 * without closing (as under SIGKILL; main checks after they exit) leave nothing.
 * The default keeps the world communicator's name while the job lives (its claim). */
static void test_names(int n, int r, const char *job) {
  char claim[96];
  snprintf(claim, sizeof claim, "%s_claim", job);
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  cfg.job_id = claim;
  cfg.timeout_s = 30;
  tp_comm_t c, sub = NULL;
  OK(tp_comm_init_rank(&c, n, r, &cfg));
  EXPECT(job_names(claim) == (n > 1), "claimed id, world %d: %d names", n, job_names(claim));
  OK(tp_barrier(c, NULL));
  tp_comm_destroy(c);
  cfg.job_id = job;
  cfg.job_id_unique = 1;
  OK(tp_comm_init_rank(&c, n, r, &cfg));
  EXPECT(job_names(job) == 0, "after init: %d names", job_names(job));
  OK(tp_comm_split(c, r % 2, r, &sub));
  void *p = NULL;
  tp_mem_t h = NULL;
  OK(tp_comm_mem_alloc(sub, 4096, &p, &h));
  OK(tp_barrier(c, NULL)); /* the other color's split and alloc are done too */
  EXPECT(job_names(job) == 0, "after split and alloc: %d names", job_names(job));
  float x = 1;
  OK(tp_all_reduce(&x, &x, 1, TP_FLOAT32, TP_SUM, c, NULL));
  EXPECT(x == n, "all_reduce %g", x);
  OK(tp_barrier(c, NULL));
  _exit(g_fail ? 1 : 0); /* no destroy: what SIGKILL leaves */
}

static void run_rank(int n, int r, int which) {
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  char job[80];
  snprintf(job, sizeof job, "%s_%d_%d", g_job, n, which);
  if (which == 6) {
    test_registered_off(n, r, job);
    return;
  }
  if (which == 7) {
    test_wait_modes(n, r, job);
    return;
  }
  if (which == 9) {
    test_names(n, r, job);
    return;
  }
  cfg.job_id = job;
  cfg.timeout_s = 30;
  tp_comm_t c;
  OK(tp_comm_init_rank(&c, n, r, &cfg));
  switch (which) {
    case 0: test_all_reduce(c, n, r); break;
    case 1: test_gather_scatter(c, n, r); break;
    case 2: test_p2p_split_registered(c, n, r); break;
    case 3: test_errors(c, n, r); break;
    case 8: test_history(c, n, r); break;
    case 10: test_all_to_all(c, n, r); break;
    case 4: { /* a rank that dies: the others fail fast, naming it */
      if (n < 2) break;
      if (r == n - 1) _exit(0); /* dies without closing */
      double t0 = tp_now();
      float x = 1;
      tp_status_t st = tp_all_reduce(&x, &x, 1, TP_FLOAT32, TP_SUM, c, NULL);
      EXPECT(st == TP_ERR_REMOTE, "dead peer gave %s", tp_status_name(st));
      char want[32];
      snprintf(want, sizeof want, "rank %d", n - 1);
      EXPECT(strstr(tp_last_error(), want) != NULL, "names the dead rank: %s", tp_last_error());
      EXPECT(tp_now() - t0 < 5, "took %.1f s", tp_now() - t0);
      break;
    }
    case 5: { /* a rank that never calls: timeout names it */
      if (n < 2) break;
      tp_comm_set_timeout(c, 0.5);
      if (r == n - 1) {
        usleep(1500 * 1000);
        break;
      }
      float x = 1;
      tp_status_t st = tp_all_reduce(&x, &x, 1, TP_FLOAT32, TP_SUM, c, NULL);
      EXPECT(st == TP_ERR_TIMEOUT || st == TP_ERR_REMOTE, "missing peer gave %s", tp_status_name(st));
      break;
    }
  }
  tp_comm_destroy(c);
}

static const char *case_names[] = {
    "all_reduce",   "gather_scatter_bcast_reduce", "p2p_split_registered", "errors",  "dead_rank",
    "missing_rank", "registered_memory_off",       "wait_modes",           "history", "names_gone_once_all_joined",
    "all_to_all"};

int main(void) {
  snprintf(g_job, sizeof g_job, "ctest%d", (int)getpid());
  int passed = 0, failed = 0;
  for (int which = 0; which < 11; which++) {
    for (int n = 1; n <= 4; n++) {
      pid_t pids[4];
      for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
          alarm(120);
          run_rank(n, r, which);
          _exit(g_fail ? 1 : 0);
        }
      }
      int ok = 1;
      for (int r = 0; r < n; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = 0;
      }
      if (which == 9) { /* the ranks ended without closing: nothing of the unique id is left */
        char job[80];
        snprintf(job, sizeof job, "%s_%d_%d", g_job, n, which);
        if (job_names(job) != 0) {
          fprintf(stderr, "  %d names of job %s left after its ranks ended\n", job_names(job), job);
          ok = 0;
        }
      }
      printf("%-30s world %d: %s\n", case_names[which], n, ok ? "ok" : "FAILED");
      fflush(stdout);
      ok ? passed++ : failed++;
    }
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
