/*
 * A stand-in for libnccl.so.2 for the NCCL binding's error paths (no GPU, no NCCL
 * here): every entry the binding looks up, doing nothing.  Built by the Makefile
 * (test target) and by tests/devices/test_nccl.py with:
 *   -DFAKE_VERSION=21603   what ncclGetVersion says (2.16.3: too old)
 *   -DFAKE_OMIT_SPLIT      leave ncclCommSplit out (a library lacking a symbol)
 * Its init entries fail, so nothing can get past them by accident.
 */
#include <stddef.h>

#ifndef FAKE_VERSION
#define FAKE_VERSION 22305
#endif

typedef int res_t;
#define OK 0
#define INVALID_USAGE 5

res_t ncclGetVersion(int *v) {
  *v = FAKE_VERSION;
  return OK;
}
const char *ncclGetErrorString(res_t r) {
  (void)r;
  return "fake NCCL error";
}
const char *ncclGetLastError(void *comm) {
  (void)comm;
  return "the fake NCCL cannot run anything";
}
res_t ncclGetUniqueId(void *id) {
  (void)id;
  return INVALID_USAGE;
}
res_t ncclCommInitRankConfig(void **c, int n, char id[128], int r, void *cfg) {
  (void)c, (void)n, (void)id, (void)r, (void)cfg;
  return INVALID_USAGE;
}
res_t ncclCommGetAsyncError(void *c, res_t *e) {
  (void)c;
  *e = OK;
  return OK;
}
res_t ncclCommFinalize(void *c) {
  (void)c;
  return OK;
}
res_t ncclCommDestroy(void *c) {
  (void)c;
  return OK;
}
res_t ncclCommAbort(void *c) {
  (void)c;
  return OK;
}
#ifndef FAKE_OMIT_SPLIT
res_t ncclCommSplit(void *c, int color, int key, void **out, void *cfg) {
  (void)c, (void)color, (void)key, (void)out, (void)cfg;
  return INVALID_USAGE;
}
#endif
res_t ncclMemAlloc(void **p, size_t n) {
  (void)p, (void)n;
  return INVALID_USAGE;
}
res_t ncclMemFree(void *p) {
  (void)p;
  return OK;
}
res_t ncclCommRegister(void *c, void *b, size_t n, void **h) {
  (void)c, (void)b, (void)n, (void)h;
  return INVALID_USAGE;
}
res_t ncclCommDeregister(void *c, void *h) {
  (void)c, (void)h;
  return OK;
}
res_t ncclGroupStart(void) { return OK; }
res_t ncclGroupEnd(void) { return OK; }
res_t ncclAllReduce(void) { return INVALID_USAGE; }
res_t ncclBroadcast(void) { return INVALID_USAGE; }
res_t ncclReduce(void) { return INVALID_USAGE; }
res_t ncclAllGather(void) { return INVALID_USAGE; }
res_t ncclReduceScatter(void) { return INVALID_USAGE; }
res_t ncclSend(void) { return INVALID_USAGE; }
res_t ncclRecv(void) { return INVALID_USAGE; }
