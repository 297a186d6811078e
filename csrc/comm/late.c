/* The late ranks of a timed-out call, grouped by their last call: one wording for the mpi
 * and nccl backends (the mpi plugin compiles this file in: TP_MPI_EXTRA). */
#include <stdio.h>
#include <string.h>

#include "comm_impl.h"

size_t tp_late_ranks(char *last, int n, size_t w, const char *no_call, char *buf, size_t cap) {
  size_t len = 0;
  if (!cap) return 0;
  buf[0] = '\0';
  for (int p = 0; p < n && len + 1 < cap; p++) {
    const char *call = last + (size_t)p * w;
    if (!call[0]) continue;
    int count = 0;
    for (int q = p; q < n; q++) count += !strcmp(last + (size_t)q * w, call);
    len += (size_t)snprintf(buf + len, cap - len, "%s rank%s", len ? ";" : ":", count > 1 ? "s" : "");
    char kind = call[0] == '+' || call[0] == '-' ? call[0] : 0;
    char text[512];
    snprintf(text, sizeof text, "%s", call);
    for (int q = p, first = 1; q < n && len + 1 < cap; q++) {
      char *row = last + (size_t)q * w;
      if (strcmp(row, text)) continue;
      len += (size_t)snprintf(buf + len, cap - len, "%s%d", first ? " " : ", ", q);
      row[0] = '\0';
      first = 0;
    }
    if (len + 1 >= cap) break;
    if (kind == '+') len += (size_t)snprintf(buf + len, cap - len, " %s not finished init", count > 1 ? "have" : "has");
    else if (kind == '-')
      len += (size_t)snprintf(buf + len, cap - len, " did not arrive (%s made %s yet)",
                              count > 1 ? "they have" : "it has", no_call);
    else
      len += (size_t)snprintf(buf + len, cap - len, " did not arrive (%s last call: %s)", count > 1 ? "their" : "its",
                              text);
  }
  return len < cap ? len : cap - 1;
}
