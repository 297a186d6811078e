/*
 * tpcore rendezvous store: a small key-value server over TCP that the ranks (and the
 * launchers) of a job use to meet across hosts, like torchrun's TCPStore.
 *
 * One process opens the store as its server (a thread that listens on host:port; the
 * address is the one the clients connect to, loopback by default, so a store is
 * reachable from other hosts only when it is told a non-loopback address); every other
 * process opens it as a client.  The server's own handle is also a client.
 *
 * Security and robustness: every connection first proves it knows the job's secret
 * (HMAC-SHA256 over nonces of both sides; the server proves it back), so the secret
 * never travels.  Messages are length-prefixed, checked against hard caps (key
 * TP_STORE_MAX_KEY bytes, value max_value_bytes) before anything is allocated; a
 * malformed, oversized or unauthenticated message, or a message that stalls half-way
 * for io_timeout_s (slowloris), disconnects that client with a logged sentence naming
 * its address; the server serves every connection from one poll() loop and never
 * blocks on any of them.  Every client read and write is bounded by the timeout.
 * Connections that have not authenticated hold at most half the slots (the oldest is
 * dropped for a new one), and a client dropped before it authenticated tries again, backing
 * off, until its timeout.  The server's log is rate-limited (a line a second of each kind,
 * the rest summed up every 10 s).
 *
 * Handles are thread-safe (one call at a time per handle).
 */
#ifndef TPCORE_STORE_H
#define TPCORE_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_store *tp_store_t;

#define TP_STORE_MAX_KEY 512                  /* bytes of a key                      */
#define TP_STORE_DEFAULT_MAX_VALUE (1u << 20) /* bytes of a value (1 MiB) by default  */
#define TP_STORE_MAX_VALUE_CAP (64u << 20)    /* the most max_value_bytes may be      */
#define TP_STORE_MIN_SECRET 16                /* bytes of the secret, at least        */
#define TP_STORE_MAX_SECRET 1024

typedef struct {
  const char *host;   /* the server's address (name or numeric); NULL: "127.0.0.1"            */
  int port;           /* 1..65535; 0 with is_server: any free port (tp_store_port tells)      */
  int is_server;      /* 1: start the server thread in this process (and connect to it)       */
  const void *secret; /* the job's secret, TP_STORE_MIN_SECRET..TP_STORE_MAX_SECRET bytes      */
  size_t secret_len;
  double timeout_s;       /* every call's bound (connect included); <= 0: 300 s                   */
  double io_timeout_s;    /* server: the most a client may stall inside a message; <= 0: timeout_s */
  size_t max_value_bytes; /* 0: TP_STORE_DEFAULT_MAX_VALUE; at most TP_STORE_MAX_VALUE_CAP        */
  size_t max_total_bytes; /* server: keys and values held in all; 0: 256 MiB                      */
  int max_clients;        /* server: open connections at once; <= 0: 1024                         */
  int quiet;              /* server: 1 = do not log refused clients on stderr                     */
} tp_store_config_t;

#define TP_STORE_CONFIG_INITIALIZER {NULL, 0, 0, NULL, 0, 0.0, 0.0, 0, 0, 0, 0}

/* Opens the store: starts the server (is_server) and connects, retrying a refused
 * connection until the timeout (the server may start later).  Errors name host:port. */
TP_API tp_status_t tp_store_open(tp_store_t *out, const tp_store_config_t *config);
/* The server's port (the one bound when config.port was 0). */
TP_API int tp_store_port(tp_store_t store);
TP_API tp_status_t tp_store_set(tp_store_t store, const char *key, const void *value, size_t nbytes);
/* Waits (under the timeout) until key exists; *value is malloc'd (free with tp_store_free),
 * NUL-terminated past *nbytes for convenience. */
TP_API tp_status_t tp_store_get(tp_store_t store, const char *key, void **value, size_t *nbytes);
/* Like get without waiting: *found = 0 and *value = NULL when the key is not there. */
TP_API tp_status_t tp_store_try_get(tp_store_t store, const char *key, void **value, size_t *nbytes, int *found);
TP_API void tp_store_free(void *value);
/* Adds delta to the integer at key (absent: 0; kept as decimal text) and gives the new value. */
TP_API tp_status_t tp_store_add(tp_store_t store, const char *key, int64_t delta, int64_t *result);
/* Waits until every one of the nkeys keys exists. */
TP_API tp_status_t tp_store_wait(tp_store_t store, const char *const *keys, int nkeys);
/* Removes key; *existed (may be NULL) says whether it was there. */
TP_API tp_status_t tp_store_delete(tp_store_t store, const char *key, int *existed);
/* Returns once n callers have called it with this name (each name reusable: rounds of n). */
TP_API tp_status_t tp_store_barrier(tp_store_t store, const char *name, int n);
/* For close() from another thread: the call in progress on the handle (and every later one but
 * close) fails at once with TP_ERR_ABORTED. */
TP_API void tp_store_interrupt(tp_store_t store);
/* Closes the connection and, on the server, stops its thread and closes every socket. */
TP_API void tp_store_close(tp_store_t store);

#ifdef __cplusplus
}
#endif

#endif
