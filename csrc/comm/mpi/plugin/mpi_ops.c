/*
 * The MPI plugin's operations (mpi_impl.h; the design is in mpi.c): the user-defined
 * reductions and the datatypes they need, the call descriptions compared across ranks, the
 * collectives (avg included) and point to point.
 */
#include "mpi_impl.h"

static MPI_Datatype dt_f16 = MPI_DATATYPE_NULL, dt_bf16 = MPI_DATATYPE_NULL, dt_i128 = MPI_DATATYPE_NULL;
static MPI_Op user_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}; /* sum prod min max */
static MPI_Op op_sum_i128 = MPI_OP_NULL;

/* ---- user-defined reductions ---------------------------------------------------------- */

static int user_dtype(MPI_Datatype t, tp_dtype_t *out) {
  if (t == dt_f16) *out = TP_FLOAT16;
  else if (t == dt_bf16) *out = TP_BFLOAT16;
  else if (t == MPI_FLOAT) *out = TP_FLOAT32;
  else if (t == MPI_DOUBLE) *out = TP_FLOAT64;
  else return 0;
  return 1;
}

/* MPI's contract: inout[i] = in[i] op inout[i]. */
static void user_reduce(void *in, void *inout, int *len, MPI_Datatype *type, tp_redop_t op) {
  tp_dtype_t d;
  if (!user_dtype(*type, &d) || *len <= 0) return;
  const void *srcs[2] = {in, inout};
  tp_mpi_host->reduce_n(inout, NULL, srcs, 2, (size_t)*len, d, op);
}
static void user_sum(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_SUM); }
static void user_prod(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_PROD); }
static void user_min(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_MIN); }
static void user_max(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_MAX); }

static void sum_i128(void *in, void *inout, int *len, MPI_Datatype *type) {
  (void)type;
  __int128 v, w;
  for (int i = 0; i < *len; i++) {
    memcpy(&v, (char *)in + 16 * (size_t)i, 16);
    memcpy(&w, (char *)inout + 16 * (size_t)i, 16);
    w = (__int128)((unsigned __int128)v + (unsigned __int128)w);
    memcpy((char *)inout + 16 * (size_t)i, &w, 16);
  }
}

static MPI_Datatype mpi_type(tp_dtype_t d) {
  switch (d) {
    case TP_FLOAT32: return MPI_FLOAT;
    case TP_FLOAT64: return MPI_DOUBLE;
    case TP_FLOAT16: return dt_f16;
    case TP_BFLOAT16: return dt_bf16;
    case TP_INT8: return MPI_INT8_T;
    case TP_UINT8: return MPI_UINT8_T;
    case TP_INT32: return MPI_INT32_T;
    case TP_INT64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

/* The MPI op for (dtype, op), op not avg. */
static MPI_Op mpi_op(tp_dtype_t d, tp_redop_t op) {
  int user =
      d == TP_FLOAT16 || d == TP_BFLOAT16 || ((d == TP_FLOAT32 || d == TP_FLOAT64) && (op == TP_MIN || op == TP_MAX));
  if (user) return user_ops[op];
  switch (op) {
    case TP_SUM: return MPI_SUM;
    case TP_PROD: return MPI_PROD;
    case TP_MIN: return MPI_MIN;
    default: return MPI_MAX;
  }
}

tp_status_t tp_mpi_setup_types(void) {
  if (dt_f16 != MPI_DATATYPE_NULL) return TP_SUCCESS;
  MPI_Datatype f16, bf16, i128;
  if (MPI_Type_contiguous(1, MPI_UINT16_T, &f16) || MPI_Type_commit(&f16) ||
      MPI_Type_contiguous(1, MPI_UINT16_T, &bf16) || MPI_Type_commit(&bf16) ||
      MPI_Type_contiguous(2, MPI_INT64_T, &i128) || MPI_Type_commit(&i128))
    return tp_set_error(TP_ERR_INTERNAL, "mpi: cannot create the 16-bit datatypes");
  MPI_User_function *fns[4] = {user_sum, user_prod, user_min, user_max};
  for (int i = 0; i < 4; i++)
    if (MPI_Op_create(fns[i], 1, &user_ops[i]) != MPI_SUCCESS)
      return tp_set_error(TP_ERR_INTERNAL, "mpi: cannot create the user-defined reductions");
  if (MPI_Op_create(sum_i128, 1, &op_sum_i128) != MPI_SUCCESS)
    return tp_set_error(TP_ERR_INTERNAL, "mpi: cannot create the 128-bit sum");
  dt_f16 = f16;
  dt_bf16 = bf16;
  dt_i128 = i128;
  return TP_SUCCESS;
}

/* ---- the call's description, compared across ranks --------------------------------- */

enum { D_SEQ, D_KIND, D_DTYPE, D_OP, D_ROOT, D_COUNT, D_HASH, D_N };
/* After the description (compared), the caller's site (not compared: ranks may call one
 * collective from different lines), for the message. */
enum { D_SITE = D_N, D_W = D_N + TP_COMM_SITE_MAX / 8 };

static void describe(const int64_t *d, char *buf, size_t n) {
  tp_coll_kind_t k = (tp_coll_kind_t)d[D_KIND];
  int len = snprintf(buf, n, "%s #%lld", tp_mpi_host->coll_name(k), (long long)d[D_SEQ]);
  if (len < 0 || (size_t)len >= n || k == TP_COLL_BARRIER || k == TP_COLL_SPLIT) return;
  len += snprintf(buf + len, n - (size_t)len, " (%s", tp_dtype_name((tp_dtype_t)d[D_DTYPE]));
  if ((size_t)len < n && (k == TP_COLL_ALL_REDUCE || k == TP_COLL_REDUCE || k == TP_COLL_REDUCE_SCATTER))
    len += snprintf(buf + len, n - (size_t)len, " %s", tp_mpi_host->redop_name((tp_redop_t)d[D_OP]));
  if ((size_t)len < n && (k == TP_COLL_BROADCAST || k == TP_COLL_REDUCE))
    len += snprintf(buf + len, n - (size_t)len, ", root %lld", (long long)d[D_ROOT]);
  if ((size_t)len < n && k == TP_COLL_ALL_TO_ALL) snprintf(buf + len, n - (size_t)len, ")");
  else if ((size_t)len < n)
    snprintf(buf + len, n - (size_t)len, ", %s %lld elements)",
             k == TP_COLL_ALL_GATHER || k == TP_COLL_REDUCE_SCATTER ? "total" : "count", (long long)d[D_COUNT]);
}

static uint64_t hash_counts(const size_t *counts, int n) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; counts && i < n; i++) {
    h ^= (uint64_t)counts[i];
    h *= 1099511628211ull;
  }
  return h;
}

static void site_of(const int64_t *d, char *site) {
  memcpy(site, d + D_SITE, TP_COMM_SITE_MAX);
  site[TP_COMM_SITE_MAX - 1] = '\0';
}

tp_status_t tp_mpi_calls_setup(struct tp_comm *comm, mpi_ctx *x) {
  if (!tp_mpi_check_calls) return TP_SUCCESS;
  size_t n = (size_t)comm->size;
  x->calls = calloc(D_W * (n + 1), sizeof(int64_t)); /* this rank's, then every rank's */
  x->last_calls = calloc(D_W * n, sizeof(int64_t));  /* D_SEQ 0: no call yet */
  x->call_reqs = malloc(2 * n * sizeof(MPI_Request));
  x->call_stats = malloc(2 * n * sizeof(MPI_Status));
  if (!x->calls || !x->last_calls || !x->call_reqs || !x->call_stats)
    return tp_set_error(TP_ERR_NOMEM, "out of memory allocating the mpi communicator's call descriptions");
  return TP_SUCCESS;
}

void tp_mpi_calls_free(mpi_ctx *x) {
  free(x->calls);
  free(x->last_calls);
  free(x->call_reqs);
  free(x->call_stats);
  x->calls = x->last_calls = NULL;
  x->call_reqs = NULL;
  x->call_stats = NULL;
}

/* "all_reduce #61 at model.py:91": a description's call and site. */
static void call_and_site(const int64_t *d, char *buf, size_t n) {
  char site[TP_COMM_SITE_MAX];
  site_of(d, site);
  snprintf(buf, n, "%s #%lld at %s", tp_mpi_host->coll_name((tp_coll_kind_t)d[D_KIND]), (long long)d[D_SEQ],
           site[0] ? site : "C");
}

/* A timed-out exchange: the ranks whose description has not come, grouped by their last call
 * ("rank 2 did not arrive (its last call: all_reduce #61 at x.py:9)"; "ranks 1, 3 did not
 * arrive (their last call: ...)").  Receive i - 1 of the exchange is from rank (rank + i) % n. */
static void why_missing(struct tp_comm *comm, mpi_ctx *x, const void *arg, char *buf, size_t cap) {
  enum { T = 160 };
  (void)arg;
  int n = comm->size, me = comm->rank, nmiss = 0;
  char (*last)[T] = calloc((size_t)n, T); /* a missing rank's last call ("-": none); "" for the others */
  if (!last) {
    snprintf(buf, cap, " (not every rank of the communicator reached it)");
    return;
  }
  for (int i = 1; i < n; i++) {
    int p = (me + i) % n, arrived = 1;
    MPI_Request r = x->call_reqs[i - 1];
    if (r != MPI_REQUEST_NULL && MPI_Request_get_status(r, &arrived, MPI_STATUS_IGNORE) != MPI_SUCCESS) arrived = 1;
    if (arrived) continue;
    nmiss++;
    const int64_t *d = x->last_calls + D_W * p;
    if (d[D_SEQ]) call_and_site(d, last[p], T);
    else snprintf(last[p], T, "-");
  }
  if (!nmiss) snprintf(buf, cap, " (every rank arrived at it; this rank's description of it did not reach them all)");
  else tp_late_ranks(&last[0][0], n, T, "no call on this communicator", buf, cap);
  free(last);
}

/* All ranks exchange the description, every rank sending its own to each (so a rank whose
 * description has not come by the timeout is named, with its previous one); any difference is
 * TP_ERR_MISMATCH naming both, and where each called it. */
tp_status_t tp_mpi_check_call(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what) {
  int64_t mine[D_N] = {(int64_t)x->seq, a->kind, a->dtype, a->op, a->root, 0, 0};
  int v = a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_REDUCE_SCATTER;
  mine[D_COUNT] = (int64_t)(v ? a->total : a->count);
  mine[D_HASH] = v ? (int64_t)hash_counts(a->counts, comm->size) : 0;
  if (a->kind == TP_COLL_BARRIER || a->kind == TP_COLL_SPLIT) mine[D_DTYPE] = mine[D_OP] = mine[D_COUNT] = 0;
  if (a->kind == TP_COLL_ALL_TO_ALL) mine[D_COUNT] = 0; /* per pair: check_a2a_counts */
  if (a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_REDUCE_SCATTER)
    mine[D_ROOT] = 0;
  if (a->kind != TP_COLL_ALL_REDUCE && a->kind != TP_COLL_REDUCE && a->kind != TP_COLL_REDUCE_SCATTER) mine[D_OP] = 0;
  if (!tp_mpi_check_calls || !x->calls) return TP_SUCCESS;
  int n = comm->size, me = comm->rank, k = 0, rc = MPI_SUCCESS;
  /* this rank's and every rank's (x->calls: a request a timeout leaves in flight may still use it) */
  int64_t *buf = x->calls, *all = x->calls + D_W;
  memcpy(buf, mine, sizeof mine);
  memcpy(buf + D_SITE, comm->site, TP_COMM_SITE_MAX);
  memcpy(all + D_W * me, buf, sizeof(int64_t) * D_W);
  /* requests 0..n-2 receive, from rank (me + i) % n; n-1..2n-3 send, to rank (me - i) % n */
  for (; k < 2 * (n - 1); k++) {
    int i = k % (n - 1) + 1, from = (me + i) % n, to = (me + n - i) % n;
    if (k < n - 1) rc = MPI_Irecv(all + D_W * from, D_W, MPI_INT64_T, from, TAG_CALL, x->mc, &x->call_reqs[k]);
    else rc = MPI_Isend(buf, D_W, MPI_INT64_T, to, TAG_CALL, x->mc, &x->call_reqs[k]);
    if (rc != MPI_SUCCESS) {
      x->pending |= k > 0; /* the ones posted are left in flight */
      return tp_mpi_error(comm, rc, what);
    }
  }
  tp_status_t st = tp_mpi_wait_why(comm, x, x->call_reqs, k, x->call_stats, what, why_missing, NULL);
  if (st != TP_SUCCESS) return st;
  memcpy(x->last_calls, all, sizeof(int64_t) * D_W * (size_t)n);
  x->arrived = x->seq;
  for (int p = 0; p < n; p++) {
    if (!memcmp(all + D_W * p, mine, sizeof mine)) continue;
    char theirs[160], ours[160], tsite[TP_COMM_SITE_MAX], osite[TP_COMM_SITE_MAX];
    describe(all + D_W * p, theirs, sizeof theirs);
    describe(mine, ours, sizeof ours);
    site_of(all + D_W * p, tsite);
    site_of(buf, osite);
    if (!strcmp(theirs, ours)) snprintf(theirs + strlen(theirs), sizeof theirs - strlen(theirs), " with other counts");
    return tp_set_error(TP_ERR_MISMATCH, "%s on rank %d of %d: rank %d called %s at %s but this rank called %s at %s",
                        what, comm->rank, comm->size, p, theirs, tsite, ours, osite);
  }
  return TP_SUCCESS;
}

/* ---- collectives -------------------------------------------------------------------- */

static tp_status_t count_int(struct tp_comm *comm, size_t n, const char *what, int *out) {
  if (n > (size_t)INT_MAX)
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "%s on rank %d: %zu elements is more than the mpi backend takes in one "
                        "call (%d); split the buffer",
                        what, comm->rank, n, INT_MAX);
  *out = (int)n;
  return TP_SUCCESS;
}

/* displacements and counts of a v-collective, as MPI's ints. */
static tp_status_t v_arrays(struct tp_comm *comm, const size_t *counts, const char *what, int **cnt, int **dsp) {
  *cnt = malloc(sizeof(int) * (size_t)comm->size);
  *dsp = malloc(sizeof(int) * (size_t)comm->size);
  if (!*cnt || !*dsp) return tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory", what, comm->rank);
  size_t off = 0;
  for (int p = 0; p < comm->size; p++) {
    TP_CHECK(count_int(comm, counts[p], what, &(*cnt)[p]));
    TP_CHECK(count_int(comm, off, what, &(*dsp)[p]));
    off += counts[p];
  }
  return TP_SUCCESS;
}

/* Accumulator of avg: 0 float32, 1 float64, 2 int64, 3 int128. */
static int avg_acc(tp_dtype_t d) {
  switch (d) {
    case TP_FLOAT64: return 1;
    case TP_INT8:
    case TP_UINT8:
    case TP_INT32: return 2;
    case TP_INT64: return 3;
    default: return 0;
  }
}
static const size_t acc_size[4] = {4, 8, 8, 16};

static void widen(const void *src, void *dst, size_t n, tp_dtype_t d) {
  for (size_t i = 0; i < n; i++) {
    switch (d) {
      case TP_FLOAT32: ((float *)dst)[i] = ((const float *)src)[i]; break;
      case TP_FLOAT16: ((float *)dst)[i] = tp_half_to_float(((const uint16_t *)src)[i]); break;
      case TP_BFLOAT16: ((float *)dst)[i] = tp_bf16_to_float(((const uint16_t *)src)[i]); break;
      case TP_FLOAT64: ((double *)dst)[i] = ((const double *)src)[i]; break;
      case TP_INT8: ((int64_t *)dst)[i] = ((const int8_t *)src)[i]; break;
      case TP_UINT8: ((int64_t *)dst)[i] = ((const uint8_t *)src)[i]; break;
      case TP_INT32: ((int64_t *)dst)[i] = ((const int32_t *)src)[i]; break;
      case TP_INT64: {
        __int128 v = ((const int64_t *)src)[i];
        memcpy((char *)dst + 16 * i, &v, 16);
        break;
      }
      default: break;
    }
  }
}

/* dst[i] = acc[i] / world, narrowed to d (integers truncate toward zero). */
static void narrow_avg(const void *acc, void *dst, size_t n, tp_dtype_t d, int world) {
  for (size_t i = 0; i < n; i++) {
    switch (d) {
      case TP_FLOAT32: ((float *)dst)[i] = ((const float *)acc)[i] / (float)world; break;
      case TP_FLOAT16: ((uint16_t *)dst)[i] = tp_float_to_half(((const float *)acc)[i] / (float)world); break;
      case TP_BFLOAT16: ((uint16_t *)dst)[i] = tp_float_to_bf16(((const float *)acc)[i] / (float)world); break;
      case TP_FLOAT64: ((double *)dst)[i] = ((const double *)acc)[i] / (double)world; break;
      case TP_INT8: ((int8_t *)dst)[i] = (int8_t)(((const int64_t *)acc)[i] / world); break;
      case TP_UINT8: ((uint8_t *)dst)[i] = (uint8_t)(((const int64_t *)acc)[i] / world); break;
      case TP_INT32: ((int32_t *)dst)[i] = (int32_t)(((const int64_t *)acc)[i] / world); break;
      case TP_INT64: {
        __int128 v;
        memcpy(&v, (const char *)acc + 16 * i, 16);
        ((int64_t *)dst)[i] = (int64_t)(v / world);
        break;
      }
      default: break;
    }
  }
}

/* avg of all_reduce / reduce / reduce_scatter: widen, sum, divide, narrow. */
static tp_status_t avg_collective(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what) {
  int acc = avg_acc(a->dtype);
  MPI_Datatype at = acc == 0 ? MPI_FLOAT : acc == 1 ? MPI_DOUBLE : acc == 2 ? MPI_INT64_T : dt_i128;
  MPI_Op op = acc == 3 ? op_sum_i128 : MPI_SUM;
  size_t in_n = a->kind == TP_COLL_REDUCE_SCATTER ? a->total : a->count;
  size_t out_n = a->count;
  int out_here = a->kind != TP_COLL_REDUCE || comm->rank == a->root;
  size_t in_bytes, out_bytes;
  if (!tp_mul_size(in_n, acc_size[acc], &in_bytes) || !tp_mul_size(out_n, acc_size[acc], &out_bytes))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: %zu elements overflow the avg accumulator", what,
                        comm->rank, in_n);
  void *in = malloc(in_bytes ? in_bytes : 1), *out = malloc(out_bytes ? out_bytes : 1);
  int *cnt = NULL, *dsp = NULL;
  tp_status_t st = TP_SUCCESS;
  if (!in || !out)
    st = tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory for avg's %zu-byte accumulator", what, comm->rank,
                      in_bytes + out_bytes);
  int n_in = 0, rc = MPI_SUCCESS;
  if (st == TP_SUCCESS) st = count_int(comm, in_n, what, &n_in);
  MPI_Request req = MPI_REQUEST_NULL;
  if (st == TP_SUCCESS) {
    widen(a->send, in, in_n, a->dtype);
    if (a->kind == TP_COLL_ALL_REDUCE) {
      rc = MPI_Iallreduce(in, out, n_in, at, op, x->mc, &req);
    } else if (a->kind == TP_COLL_REDUCE) {
      rc = MPI_Ireduce(in, out, n_in, at, op, a->root, x->mc, &req);
    } else {
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st == TP_SUCCESS) rc = MPI_Ireduce_scatter(in, out, cnt, at, op, x->mc, &req);
    }
    if (st == TP_SUCCESS)
      st = rc == MPI_SUCCESS ? tp_mpi_wait_one(comm, x, &req, what, -1) : tp_mpi_error(comm, rc, what);
  }
  if (st == TP_SUCCESS && out_here) narrow_avg(out, a->recv, out_n, a->dtype, comm->size);
  if (!x->pending) { /* a request still running may use them */
    free(in);
    free(out);
    free(cnt);
    free(dsp);
  }
  return st;
}

/* all_to_all's counts, pair by pair: every rank sends rank q its send_counts[q] (MPI_Alltoall) and
 * compares it with its recv_counts; the first bad pair (the smallest sender * n + receiver, an
 * MPI_MIN) and its two counts (an MPI_MAX from the rank that saw it) reach every rank, so all of
 * them raise the same TP_ERR_MISMATCH and none enters MPI_Alltoallv with counts that disagree. */
static tp_status_t check_a2a_counts(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what,
                                    tp_status_t local) {
  if (!tp_mpi_check_calls || !x->calls) return local;
  int n = comm->size, me = comm->rank;
  char mine[512] = "";
  if (local != TP_SUCCESS) snprintf(mine, sizeof mine, "%s", tp_mpi_host->last_error());
  int64_t *buf = malloc(2 * (size_t)n * sizeof(int64_t)), *sent = buf, *got = buf ? buf + n : NULL;
  if (!buf) return tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory", what, me);
  int64_t bad = INT64_MAX, first = INT64_MAX, pair[2] = {-1, -1}, seen[2] = {-1, -1};
  for (int p = 0; p < n; p++) sent[p] = (int64_t)a->counts[p];
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Ialltoall(sent, 1, MPI_INT64_T, got, 1, MPI_INT64_T, x->mc, &req);
  tp_status_t st = rc == MPI_SUCCESS ? tp_mpi_wait_one(comm, x, &req, what, -1) : tp_mpi_error(comm, rc, what);
  if (local != TP_SUCCESS) bad = -(int64_t)(n - me); /* this rank's counts do not fit MPI's ints */
  for (int p = 0; st == TP_SUCCESS && p < n && bad == INT64_MAX; p++)
    if (got[p] != (int64_t)a->recv_counts[p]) {
      bad = (int64_t)p * n + me;
      pair[0] = got[p], pair[1] = (int64_t)a->recv_counts[p];
    }
  if (st == TP_SUCCESS) {
    rc = MPI_Iallreduce(&bad, &first, 1, MPI_INT64_T, MPI_MIN, x->mc, &req);
    st = rc == MPI_SUCCESS ? tp_mpi_wait_one(comm, x, &req, what, -1) : tp_mpi_error(comm, rc, what);
  }
  if (st == TP_SUCCESS && first < 0) {
    int p = n + (int)first;
    st = p == me ? tp_set_error(local, "%s", mine)
                 : tp_set_error(TP_ERR_UNSUPPORTED,
                                "%s on rank %d of %d: rank %d's all_to_all counts do not fit the mpi backend's "
                                "int counts and displacements (at most %d elements a call)",
                                what, me, n, p, INT_MAX);
  } else if (st == TP_SUCCESS && first != INT64_MAX) {
    if (bad != first) pair[0] = pair[1] = -1;
    rc = MPI_Iallreduce(pair, seen, 2, MPI_INT64_T, MPI_MAX, x->mc, &req);
    st = rc == MPI_SUCCESS ? tp_mpi_wait_one(comm, x, &req, what, -1) : tp_mpi_error(comm, rc, what);
    int p = (int)(first / n), q = (int)(first % n);
    if (st == TP_SUCCESS)
      st = tp_set_error(TP_ERR_MISMATCH,
                        "%s on rank %d of %d: all_to_all counts disagree: rank %d sends %lld elements to rank %d "
                        "(send_counts[%d] on rank %d) but rank %d expects %lld from rank %d (recv_counts[%d] on "
                        "rank %d); they must be equal",
                        what, me, n, p, (long long)seen[0], q, q, p, q, (long long)seen[1], p, p, q);
  }
  if (!x->pending) free(buf); /* a request still running may use it */
  return st;
}

static tp_status_t run_collective(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what) {
  if (a->op == TP_AVG &&
      (a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_REDUCE || a->kind == TP_COLL_REDUCE_SCATTER))
    return avg_collective(comm, x, a, what);
  MPI_Datatype t = mpi_type(a->dtype);
  MPI_Request req = MPI_REQUEST_NULL;
  int n = 0, rc = MPI_SUCCESS, *cnt = NULL, *dsp = NULL;
  tp_status_t st = TP_SUCCESS;
  int in_place = a->send == a->recv;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
      TP_CHECK(count_int(comm, a->count, what, &n));
      rc = MPI_Iallreduce(in_place ? MPI_IN_PLACE : a->send, a->recv, n, t, mpi_op(a->dtype, a->op), x->mc, &req);
      break;
    case TP_COLL_REDUCE: {
      TP_CHECK(count_int(comm, a->count, what, &n));
      int root = comm->rank == a->root;
      const void *s = root && in_place ? MPI_IN_PLACE : a->send;
      rc = MPI_Ireduce(s, root ? a->recv : NULL, n, t, mpi_op(a->dtype, a->op), a->root, x->mc, &req);
      break;
    }
    case TP_COLL_BROADCAST: {
      TP_CHECK(count_int(comm, a->count, what, &n));
      if (comm->rank == a->root && n && !in_place) memmove(a->recv, a->send, a->count * tp_dtype_size(a->dtype));
      rc = MPI_Ibcast(a->recv, n, t, a->root, x->mc, &req);
      break;
    }
    case TP_COLL_ALL_GATHER: {
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st != TP_SUCCESS) break;
      /* in place: x is this rank's block of out */
      size_t es = tp_dtype_size(a->dtype);
      const char *mine = a->recv ? (const char *)a->recv + (size_t)dsp[comm->rank] * es : NULL;
      int ip = cnt[comm->rank] == 0 || a->send == (const void *)mine;
      rc = MPI_Iallgatherv(ip ? MPI_IN_PLACE : a->send, cnt[comm->rank], t, a->recv, cnt, dsp, t, x->mc, &req);
      break;
    }
    case TP_COLL_REDUCE_SCATTER: {
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st != TP_SUCCESS) break;
      /* in place (out is this rank's block of x): reduced into a scratch block, then copied,
       * so the rest of x is left as it was (MPI_IN_PLACE would overwrite it). */
      const char *mine = (const char *)a->send + (size_t)dsp[comm->rank] * tp_dtype_size(a->dtype);
      int ip = a->recv == (const void *)mine && a->count;
      void *out = a->count ? a->recv : (void *)a->send, *tmp = NULL;
      if (ip && !(out = tmp = malloc(a->count * tp_dtype_size(a->dtype)))) {
        st = tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory", what, comm->rank);
        break;
      }
      rc = MPI_Ireduce_scatter(a->send, out, cnt, t, mpi_op(a->dtype, a->op), x->mc, &req);
      if (rc == MPI_SUCCESS) st = tp_mpi_wait_one(comm, x, &req, what, -1);
      if (rc == MPI_SUCCESS && st == TP_SUCCESS && ip) memcpy(a->recv, tmp, a->count * tp_dtype_size(a->dtype));
      if (!x->pending) { /* a request still running may use them */
        free(tmp);
        free(cnt);
        free(dsp);
      }
      return rc == MPI_SUCCESS ? st : tp_mpi_error(comm, rc, what);
    }
    case TP_COLL_ALL_TO_ALL: {
      int *rcnt = NULL, *rdsp = NULL;
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st == TP_SUCCESS) st = v_arrays(comm, a->recv_counts, what, &rcnt, &rdsp);
      st = check_a2a_counts(comm, x, a, what, st);
      if (st == TP_SUCCESS) rc = MPI_Ialltoallv(a->send, cnt, dsp, t, a->recv, rcnt, rdsp, t, x->mc, &req);
      if (st == TP_SUCCESS)
        st = rc == MPI_SUCCESS ? tp_mpi_wait_one(comm, x, &req, what, -1) : tp_mpi_error(comm, rc, what);
      if (!x->pending) { /* a request still running may read them */
        free(cnt);
        free(dsp);
        free(rcnt);
        free(rdsp);
      }
      return st;
    }
    case TP_COLL_BARRIER: rc = MPI_Ibarrier(x->mc, &req); break;
    default: return tp_set_error(TP_ERR_INTERNAL, "mpi: unknown collective %d", (int)a->kind);
  }
  if (st == TP_SUCCESS)
    st = rc == MPI_SUCCESS ? tp_mpi_wait_one(comm, x, &req, what, -1) : tp_mpi_error(comm, rc, what);
  if (!x->pending) { /* a request still running may read them */
    free(cnt);
    free(dsp);
  }
  return st;
}

tp_status_t tp_mpi_refuse_if_failed(struct tp_comm *comm, mpi_ctx *x, const char *what) {
  if (atomic_load(&x->aborted))
    return tp_set_error(TP_ERR_ABORTED, "%s on rank %d: this rank aborted the communicator", what, comm->rank);
  return TP_SUCCESS;
}

tp_status_t tp_mpi_collective(struct tp_comm *comm, const tp_coll_args_t *a) {
  mpi_ctx *x = comm->impl;
  char what[64];
  snprintf(what, sizeof what, "%s #%llu", tp_mpi_host->coll_name(a->kind), (unsigned long long)(x->seq + 1));
  TP_CHECK(tp_mpi_refuse_if_failed(comm, x, what));
  x->seq++;
  TP_CHECK(tp_mpi_check_call(comm, x, a, what));
  return run_collective(comm, x, a, what);
}

/* ---- point to point ------------------------------------------------------------------- */

/* A receive must get exactly the count it expects. */
static tp_status_t check_received(struct tp_comm *comm, MPI_Status *s, MPI_Datatype t, int expect, const char *what,
                                  int src) {
  int got = 0;
  MPI_Get_count(s, t, &got);
  if (got != expect) /* the message was received whole: nothing is left in flight */
    return tp_set_error(TP_ERR_MISMATCH, "%s on rank %d: rank %d sent %d elements but this rank expects %d", what,
                        comm->rank, src, got, expect);
  return TP_SUCCESS;
}

tp_status_t tp_mpi_send(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dt, int peer,
                        tp_stream_t stream) {
  (void)stream;
  mpi_ctx *x = comm->impl;
  char what[48];
  snprintf(what, sizeof what, "send (to rank %d)", peer);
  TP_CHECK(tp_mpi_refuse_if_failed(comm, x, what));
  int n = 0;
  TP_CHECK(count_int(comm, count, what, &n));
  MPI_Request req;
  MPI_TRY(comm, MPI_Isend(buf, n, mpi_type(dt), peer, TAG_P2P, x->mc, &req), what);
  return tp_mpi_wait_one(comm, x, &req, what, peer);
}

tp_status_t tp_mpi_recv(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dt, int peer, tp_stream_t stream) {
  (void)stream;
  mpi_ctx *x = comm->impl;
  char what[48];
  snprintf(what, sizeof what, "recv (from rank %d)", peer);
  TP_CHECK(tp_mpi_refuse_if_failed(comm, x, what));
  int n = 0;
  TP_CHECK(count_int(comm, count, what, &n));
  MPI_Request req;
  MPI_Status s;
  MPI_TRY(comm, MPI_Irecv(buf, n, mpi_type(dt), peer, TAG_P2P, x->mc, &req), what);
  TP_CHECK(tp_mpi_wait_all(comm, x, &req, 1, &s, what, peer));
  return check_received(comm, &s, mpi_type(dt), n, what, peer);
}

tp_status_t tp_mpi_sendrecv(struct tp_comm *comm, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                            int src, tp_dtype_t dt, tp_stream_t stream) {
  (void)stream;
  mpi_ctx *x = comm->impl;
  char what[64];
  snprintf(what, sizeof what, "sendrecv (to rank %d, from rank %d)", dst, src);
  TP_CHECK(tp_mpi_refuse_if_failed(comm, x, what));
  int sn = 0, rn = 0;
  TP_CHECK(count_int(comm, scount, what, &sn));
  TP_CHECK(count_int(comm, rcount, what, &rn));
  MPI_Request reqs[2];
  MPI_Status s[2];
  MPI_TRY(comm, MPI_Irecv(rbuf, rn, mpi_type(dt), src, TAG_P2P, x->mc, &reqs[0]), what);
  int rc = MPI_Isend(sbuf, sn, mpi_type(dt), dst, TAG_P2P, x->mc, &reqs[1]);
  if (rc != MPI_SUCCESS) {
    x->pending = 1;
    return tp_mpi_error(comm, rc, what);
  }
  TP_CHECK(tp_mpi_wait_all(comm, x, reqs, 2, s, what, src));
  return check_received(comm, &s[0], mpi_type(dt), rn, what, src);
}
