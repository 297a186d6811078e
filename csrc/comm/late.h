/* The late ranks of a timed-out call, named as every backend names them (late.c). */
#ifndef TP_COMM_LATE_H
#define TP_COMM_LATE_H

#include <stddef.h>

/* Appends to buf (cap bytes, NUL-terminated) the ranks that did not arrive, grouped by their
 * last call: ": ranks 0, 3 did not arrive (their last call: all_reduce #61); rank 4 has not
 * finished init".  last holds n rows of w bytes: "" for a rank that arrived, "-" for one that
 * has made no call yet (no_call says what kind: "no collective call"), "+" for one still in
 * init, else its last call.  The rows are consumed (cleared).  Returns the length written. */
size_t tp_late_ranks(char *last, int n, size_t w, const char *no_call, char *buf, size_t cap);

#endif
