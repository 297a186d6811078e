/*
 * The part of NCCL's C API the nccl backend calls, declared here so that building
 * tpcore needs no nccl.h (and no CUDA headers): the library is opened at run time
 * (tp_dynlib_open) and every entry is a function pointer looked up by name.
 *
 * Values follow NCCL's public header (ABI-stable since 2.x): result codes, data
 * types, reduction ops, the 128-byte unique id and the versioned config struct.
 * Our ncclConfig_t is the 2.18 prefix of NCCL's (size, magic, version, then the
 * user fields up to splitShare): NCCL reads a config by its `size` and `version`
 * fields, filling the fields an older struct lacks with its defaults, so a prefix
 * stamped with version 2.18.0 is a valid config for every later library.
 */
#ifndef TPCORE_NCCL_API_H
#define TPCORE_NCCL_API_H

#include <limits.h>
#include <stddef.h>

/* NCCL_VERSION(X, Y, Z) for X >= 2, Y >= 9. */
#define TP_NCCL_VERSION(x, y, z) ((x) * 10000 + (y) * 100 + (z))
/* The oldest library we accept: ncclMemAlloc / ncclCommRegister arrived in 2.19
 * (ncclCommSplit and non-blocking init with ncclCommGetAsyncError earlier). */
#define TP_NCCL_MIN_VERSION TP_NCCL_VERSION(2, 19, 0)

typedef struct tp_nccl_comm_opaque *ncclComm_t;

#define TP_NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[TP_NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9
} ncclDataType_t;

/* Note NCCL's order: max before min. */
typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

#define TP_NCCL_CONFIG_MAGIC 0xcafebeefu
#define TP_NCCL_CONFIG_UNDEF_INT INT_MIN
#define TP_NCCL_SPLIT_NOCOLOR (-1)

typedef struct {
  size_t size;          /* sizeof this struct                   */
  unsigned int magic;   /* TP_NCCL_CONFIG_MAGIC                 */
  unsigned int version; /* the layout's version: 2.18.0         */
  int blocking;         /* 0: non-blocking (ncclInProgress)     */
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
} ncclConfig_t;

#define TP_NCCL_CONFIG_INITIALIZER                                                                          \
  {sizeof(ncclConfig_t),     TP_NCCL_CONFIG_MAGIC,     TP_NCCL_VERSION(2, 18, 0), TP_NCCL_CONFIG_UNDEF_INT, \
   TP_NCCL_CONFIG_UNDEF_INT, TP_NCCL_CONFIG_UNDEF_INT, TP_NCCL_CONFIG_UNDEF_INT,  NULL,                     \
   TP_NCCL_CONFIG_UNDEF_INT}

/* cudaStream_t, as NCCL takes it. */
typedef void *tp_nccl_stream_t;

/* The entries, resolved once per process (nccl.c). */
typedef struct {
  void *lib;
  int version;
  ncclResult_t (*GetVersion)(int *version);
  const char *(*GetErrorString)(ncclResult_t result);
  const char *(*GetLastError)(ncclComm_t comm);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *async_error);
  ncclResult_t (*CommFinalize)(ncclComm_t comm);
  ncclResult_t (*CommDestroy)(ncclComm_t comm);
  ncclResult_t (*CommAbort)(ncclComm_t comm);
  ncclResult_t (*CommSplit)(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
  ncclResult_t (*MemAlloc)(void **ptr, size_t size);
  ncclResult_t (*MemFree)(void *ptr);
  ncclResult_t (*CommRegister)(ncclComm_t comm, void *buff, size_t size, void **handle);
  ncclResult_t (*CommDeregister)(ncclComm_t comm, void *handle);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                            ncclComm_t comm, tp_nccl_stream_t stream);
  ncclResult_t (*Broadcast)(const void *send, void *recv, size_t count, ncclDataType_t dt, int root, ncclComm_t comm,
                            tp_nccl_stream_t stream);
  ncclResult_t (*Reduce)(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root,
                         ncclComm_t comm, tp_nccl_stream_t stream);
  ncclResult_t (*AllGather)(const void *send, void *recv, size_t sendcount, ncclDataType_t dt, ncclComm_t comm,
                            tp_nccl_stream_t stream);
  ncclResult_t (*ReduceScatter)(const void *send, void *recv, size_t recvcount, ncclDataType_t dt, ncclRedOp_t op,
                                ncclComm_t comm, tp_nccl_stream_t stream);
  ncclResult_t (*Send)(const void *buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                       tp_nccl_stream_t stream);
  ncclResult_t (*Recv)(void *buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, tp_nccl_stream_t stream);
} tp_nccl_api_t;

#endif
