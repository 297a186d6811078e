/*
 * The store server's log on stderr (store_proto.h), rate-limited: a flood of connections
 * must not become a flood of lines.  Each kind of event logs at most one line a second
 * (the first of each second, with the client's address); the others are counted, and every
 * STORE_LOG_SUMMARY_S seconds one line per kind sums them up ("dropped 12345 unauthenticated
 * connections in the last 10 s ...").  Written here rather than taken from a library: libc's
 * syslog has no rate limit of its own (journald's is per service, not per event kind, and
 * the store logs to stderr), and this is forty lines.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "store_proto.h"

/* The summary of each kind: %lu events, %s the time ("10 s"). */
static const char *const summary_fmt[STORE_EV_KINDS] = {
    [STORE_EV_EVICTED] =
        "dropped %lu unauthenticated connections in the last %s (the slots for connections that "
        "have not authenticated yet were full: a flood of connections that do not authenticate?)",
    [STORE_EV_FULL] = "refused %lu connections in the last %s (max_clients connections were open)",
    [STORE_EV_AUTH] = "refused %lu clients that failed authentication in the last %s (a wrong secret)",
    [STORE_EV_PROTOCOL] = "disconnected %lu clients that sent malformed or oversized messages in the last %s",
    [STORE_EV_STALLED] =
        "disconnected %lu clients that stalled past io_timeout (did not authenticate, finish a "
        "message or read a reply) in the last %s",
    [STORE_EV_CLOSED] = "%lu clients closed their connection inside a message in the last %s",
    [STORE_EV_SYSTEM] = "%lu failures of the server itself (memory, file descriptors, random bytes) in the last %s",
};

static void emit(const char *where, const char *msg) { fprintf(stderr, "tpcore store %s: %s\n", where, msg); }

void tp_store_log_flush(store_log_t *lg, const char *where, double now, int final) {
  if (!final && now - lg->window_start < STORE_LOG_SUMMARY_S) return;
  char span[32], msg[512];
  snprintf(span, sizeof span, "%.1f s", now - lg->window_start);
  for (int k = 0; k < STORE_EV_KINDS; k++) {
    if (!lg->quiet && lg->suppressed[k]) {
      snprintf(msg, sizeof msg, summary_fmt[k], lg->count[k], span);
      size_t n = strlen(msg);
      snprintf(msg + n, sizeof msg - n, "; %lu of them not logged one by one (at most one line a second each kind)",
               lg->suppressed[k]);
      emit(where, msg);
    }
    lg->count[k] = lg->suppressed[k] = 0;
  }
  lg->window_start = now;
}

void tp_store_vlog(store_log_t *lg, const char *where, store_event_t kind, double now, const char *fmt, va_list ap) {
  tp_store_log_flush(lg, where, now, 0);
  lg->count[kind]++;
  if (lg->quiet) return;
  if (lg->logged[kind] && now - lg->last_line[kind] < 1.0) {
    lg->suppressed[kind]++;
    return;
  }
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  emit(where, msg);
  lg->logged[kind] = 1;
  lg->last_line[kind] = now;
}
