#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core_impl.h"

static _Thread_local char tp_errbuf[2048];
static _Thread_local tp_status_t tp_errstatus = TP_SUCCESS;

const char *tp_status_name(tp_status_t s) {
  switch (s) {
    case TP_SUCCESS: return "success";
    case TP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case TP_ERR_INVALID_USAGE: return "invalid usage";
    case TP_ERR_SYSTEM: return "system error";
    case TP_ERR_TIMEOUT: return "timeout";
    case TP_ERR_REMOTE: return "remote rank failed";
    case TP_ERR_MISMATCH: return "collective mismatch";
    case TP_ERR_ABORTED: return "communicator aborted";
    case TP_ERR_NOMEM: return "out of memory";
    case TP_ERR_UNSUPPORTED: return "unsupported";
    case TP_ERR_INTERNAL: return "internal error";
    case TP_IN_PROGRESS: return "in progress";
  }
  return "unknown status";
}

const char *tp_last_error(void) { return tp_errbuf; }
tp_status_t tp_last_status(void) { return tp_errstatus; }

void tp_clear_error(void) {
  tp_errbuf[0] = '\0';
  tp_errstatus = TP_SUCCESS;
}

tp_status_t tp_set_error(tp_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tp_errbuf, sizeof tp_errbuf, fmt, ap);
  va_end(ap);
  tp_errstatus = status;
  return status;
}

void tp_error_prefix(const char *fmt, ...) {
  char prefix[512], old[sizeof tp_errbuf];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, tp_errbuf, sizeof old);
  int k = snprintf(tp_errbuf, sizeof tp_errbuf, "%s: ", prefix);
  if (k < 0 || (size_t)k >= sizeof tp_errbuf) return;
  size_t room = sizeof tp_errbuf - (size_t)k - 1, len = strnlen(old, sizeof old);
  if (len > room) len = room;
  memcpy(tp_errbuf + k, old, len);
  tp_errbuf[(size_t)k + len] = '\0';
}

double tp_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
