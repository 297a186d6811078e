/*
 * Private: collectives over the job's rendezvous store (store_coll.c), for backends that
 * must meet across hosts before they have a communicator of their own (nccl's unique id
 * and its splits when the job spans hosts; any backend that needs to exchange ids).
 */
#ifndef TPCORE_STORE_IMPL_H
#define TPCORE_STORE_IMPL_H

#include "../../core/core_impl.h"
#include "tpcore/store.h"

/* A client of the job's store: MASTER_ADDR, MASTER_PORT and TPCORE_STORE_SECRET (what
 * python -m tpcore.launch --nnodes gives its ranks); `who` names the caller in errors. */
tp_status_t tp_job_store_open(tp_store_t *out, double timeout_s, const char *who);

/* Rank `root` publishes blob (nbytes) under key; every other rank waits for it (under the
 * store's timeout) and checks that it has nbytes. */
tp_status_t tp_store_bcast(tp_store_t s, const char *key, int rank, int root, void *blob, size_t nbytes);

/* Every rank of `size` posts (color, key) under prefix and reads everyone's: its rank and
 * the size of its color's group, ranks ordered by (key, old rank) as ncclCommSplit /
 * MPI_Comm_split do; color < 0: *nrank = -1, *nsize = 0. */
tp_status_t tp_store_split_ranks(tp_store_t s, const char *prefix, int rank, int size, int color, int key, int *nrank,
                                 int *nsize);

#endif
