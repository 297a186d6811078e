/*
 * Collectives over the job's rendezvous store (store_impl.h): what a backend needs
 * before it has a communicator that spans the hosts.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store_impl.h"

tp_status_t tp_job_store_open(tp_store_t *out, double timeout_s, const char *who) {
  *out = NULL;
  const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT"), *secret = getenv("TPCORE_STORE_SECRET");
  if (!addr || !*addr || !port || !*port || !secret || !*secret)
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "%s: the ranks span hosts, so they meet through the job's store, "
                        "but %s is not set (python -m tpcore.launch --nnodes sets MASTER_ADDR, MASTER_PORT and "
                        "TPCORE_STORE_SECRET)",
                        who,
                        !addr || !*addr   ? "MASTER_ADDR"
                        : !port || !*port ? "MASTER_PORT"
                                          : "TPCORE_STORE_SECRET");
  char *end;
  errno = 0;
  long p = strtol(port, &end, 10);
  if (errno || *end || p < 1 || p > 65535)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: MASTER_PORT must be a port in 1..65535, got '%s'", who, port);
  tp_store_config_t cfg = TP_STORE_CONFIG_INITIALIZER;
  cfg.host = addr, cfg.port = (int)p, cfg.timeout_s = timeout_s;
  cfg.secret = secret, cfg.secret_len = strlen(secret);
  tp_status_t st = tp_store_open(out, &cfg);
  if (st != TP_SUCCESS) tp_error_prefix("%s", who);
  return st;
}

tp_status_t tp_store_bcast(tp_store_t s, const char *key, int rank, int root, void *blob, size_t nbytes) {
  if (rank == root) return tp_store_set(s, key, blob, nbytes);
  void *v = NULL;
  size_t n = 0;
  tp_status_t st = tp_store_get(s, key, &v, &n);
  if (st != TP_SUCCESS) {
    tp_error_prefix("rank %d waiting for rank %d's '%s'", rank, root, key);
    return st;
  }
  if (n != nbytes)
    st = tp_set_error(TP_ERR_MISMATCH,
                      "rank %d: rank %d published %zu bytes under '%s', this rank "
                      "expects %zu (different tpcore versions?)",
                      rank, root, n, key, nbytes);
  else TP_COPY(blob, v, n);
  tp_store_free(v);
  return st;
}

tp_status_t tp_store_split_ranks(tp_store_t s, const char *prefix, int rank, int size, int color, int key, int *nrank,
                                 int *nsize) {
  char k[TP_STORE_MAX_KEY + 1];
  int mine[2] = {color, key};
  if (strlen(prefix) > TP_STORE_MAX_KEY - 16)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "split over the store: prefix too long");
  snprintf(k, sizeof k, "%s/%d", prefix, rank);
  TP_CHECK(tp_store_set(s, k, mine, sizeof mine));
  int below = 0, count = 0;
  for (int p = 0; p < size; p++) {
    int theirs[2];
    if (p == rank) {
      memcpy(theirs, mine, sizeof mine);
    } else {
      snprintf(k, sizeof k, "%s/%d", prefix, p);
      TP_CHECK(tp_store_bcast(s, k, rank, p, theirs, sizeof theirs));
    }
    if (color < 0 || theirs[0] != color) continue;
    count++;
    if (theirs[1] < key || (theirs[1] == key && p < rank)) below++;
  }
  *nrank = color < 0 ? -1 : below;
  *nsize = color < 0 ? 0 : count;
  return TP_SUCCESS;
}
