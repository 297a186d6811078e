/*
 * POSIX shared-memory segments under the rules that keep jobs apart from each
 * other and from other users (private to the shm backend).
 *
 * - Only segments owned by this user (euid) with mode 0600 are ever mapped; a
 *   foreign or loosened one is an error naming its owner, never joined.
 * - A segment is "in use" while some process holds a flock on it: its creator
 *   and every rank that attached, until the name goes (once every rank has
 *   mapped it; a world communicator claiming a shared job id keeps it for its
 *   lifetime).  Locks vanish with their processes (even under SIGKILL), so a
 *   name nobody locks belongs to a dead job and tp_seg_sweep removes it.
 * - After taking its lock a process checks that the name still refers to the
 *   file it locked (a sweep may have removed it in between) and retries if not.
 */
#ifndef TPCORE_SHM_SEG_H
#define TPCORE_SHM_SEG_H

#include <stddef.h>
#include <sys/types.h>

#include "../../core/core_impl.h"

#define TP_SEG_PREFIX "tpcore_"

/* Create `name` (O_EXCL, 0600), lock it shared, size it (space reserved up
 * front) and map it.  *fd keeps the lock.  When the name exists, returns
 * TP_ERR_INVALID_USAGE with *exists = 1 and nothing recorded (the caller decides). */
tp_status_t tp_seg_create(const char *name, size_t size, void **base, int *fd, int *exists);

/* Open an existing segment read-write after checking owner and mode.  A name
 * that does not exist gives TP_SUCCESS with *fd = -1.  *nbytes: its size. */
tp_status_t tp_seg_open(const char *name, int *fd, size_t *nbytes);

/* Take a shared lock and check that `name` still refers to fd's file: 1 on success.
 * A locked fd is closed in children made by fork(): a rank's child (a DataLoader
 * worker, a multiprocessing fork) must not keep the rank's segment alive. */
int tp_seg_lock(const char *name, int fd);
/* Map a locked segment read-write through a description of its own (the lock's
 * must not outlive the lock holder in a mapping a forked child inherits). */
void *tp_seg_map(int fd, size_t size);
/* Close a locked fd (tp_seg_create's, or one tp_seg_lock succeeded on). */
void tp_seg_close(int fd);
/* 1 if `name` refers to fd's file. */
int tp_seg_same(const char *name, int fd);

/* Drop this process's lock on a segment; if no one else holds one and the name
 * still refers to it, unlink the name.  Closes fd. */
void tp_seg_leave(const char *name, int fd);

/* Remove this user's segments whose names start with `prefix` (without the
 * leading '/') and that no live process locks.  Returns how many were removed. */
int tp_seg_sweep(const char *prefix);

tp_status_t tp_seg_sys_error(const char *what, const char *name, int err);

#endif
