/*
 * Shared-memory segments: creation, checked opening, liveness by flock, and the
 * sweep of dead jobs' names.  See shm_seg.h for the rules.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "shm_seg.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <pwd.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHM_DIR "/dev/shm"

tp_status_t tp_seg_sys_error(const char *what, const char *name, int err) {
  if (err == ENOSPC || err == ENOMEM)
    return tp_set_error(TP_ERR_NOMEM, "%s %s: no space left in shared memory (/dev/shm is full or too small: %s)", what,
                        name, strerror(err));
  return tp_set_error(TP_ERR_SYSTEM, "%s %s: %s", what, name, strerror(err));
}

static int path_of(const char *name, char *path, size_t n) { return snprintf(path, n, SHM_DIR "%s", name) < (int)n; }

static void owner_text(uid_t uid, char *buf, size_t n) {
  struct passwd pw, *res = NULL;
  char tmp[1024];
  if (getpwuid_r(uid, &pw, tmp, sizeof tmp, &res) == 0 && res)
    snprintf(buf, n, "user '%s' (uid %u)", res->pw_name, (unsigned)uid);
  else snprintf(buf, n, "uid %u", (unsigned)uid);
}

/* Owner and mode rules for a segment this process is about to use. */
static tp_status_t check_owner(const char *name, const struct stat *sb) {
  char who[320];
  if (!S_ISREG(sb->st_mode))
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "shared-memory name " SHM_DIR "%s is not a regular file: refusing to use it", name);
  if (sb->st_uid != geteuid()) {
    owner_text(sb->st_uid, who, sizeof who);
    char me[320];
    owner_text(geteuid(), me, sizeof me);
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "shared-memory segment " SHM_DIR
                        "%s belongs to %s, not to this job's %s: "
                        "refusing to use it (another user created this job's name first; set "
                        "TPCORE_JOB_ID to a value of your own, as python -m tpcore.launch does)",
                        name, who, me);
  }
  if ((sb->st_mode & 07777) != 0600)
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "shared-memory segment " SHM_DIR
                        "%s has mode 0%o, expected 0600: refusing to "
                        "use it (other users could read or write it)",
                        name, (unsigned)(sb->st_mode & 07777));
  return TP_SUCCESS;
}

int tp_seg_same(const char *name, int fd) {
  char path[320];
  struct stat a, b;
  if (!path_of(name, path, sizeof path)) return 0;
  if (fstat(fd, &a) != 0 || lstat(path, &b) != 0) return 0;
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* Locked fds of this process, closed in the child after fork(). */
static pthread_mutex_t locked_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t locked_once = PTHREAD_ONCE_INIT;
static int *locked;
static size_t n_locked, cap_locked;

static void fork_prepare(void) { pthread_mutex_lock(&locked_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&locked_mu); }
static void fork_child(void) {
  /* /dev/null takes each number's place rather than a plain close: the child's copies of
   * the communicators still hold these numbers, and must not close a file reusing one. */
  int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (size_t i = 0; i < n_locked; i++) {
    if (nul >= 0) dup3(nul, locked[i], O_CLOEXEC);
    else close(locked[i]);
  }
  if (nul >= 0) close(nul);
  pthread_mutex_unlock(&locked_mu);
}
static void register_fork(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

static int track(int fd) {
  pthread_once(&locked_once, register_fork);
  pthread_mutex_lock(&locked_mu);
  int ok = 1;
  if (n_locked == cap_locked) {
    size_t cap = cap_locked ? 2 * cap_locked : 16;
    int *p = realloc(locked, cap * sizeof *p);
    if (p) {
      locked = p;
      cap_locked = cap;
    } else {
      ok = 0;
    }
  }
  if (ok) locked[n_locked++] = fd;
  pthread_mutex_unlock(&locked_mu);
  return ok;
}

void tp_seg_close(int fd) {
  if (fd < 0) return;
  pthread_mutex_lock(&locked_mu);
  for (size_t i = 0; i < n_locked; i++)
    if (locked[i] == fd) {
      locked[i] = locked[--n_locked];
      break;
    }
  close(fd); /* under the mutex: a fork in between must not see a reused number */
  pthread_mutex_unlock(&locked_mu);
}

int tp_seg_lock(const char *name, int fd) {
  if (flock(fd, LOCK_SH) != 0) return 0;
  return tp_seg_same(name, fd) && track(fd);
}

void *tp_seg_map(int fd, size_t size) {
  /* A mapping keeps its open file description alive, and with it any lock taken
   * through it, for as long as the mapping lives -- in forked children too.  So
   * the segment is mapped through a description of its own, never the locked one. */
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  int f = open(path, O_RDWR | O_CLOEXEC);
  if (f < 0) f = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* no /proc: the same description (lock kept by mappings) */
  if (f < 0) return MAP_FAILED;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  int err = errno;
  close(f);
  errno = err;
  return p;
}

tp_status_t tp_seg_open(const char *name, int *fd, size_t *nbytes) {
  *fd = -1;
  int f = shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (f < 0) {
    int err = errno;
    if (err == ENOENT) return TP_SUCCESS;
    char path[320];
    struct stat sb;
    if (err == EACCES && path_of(name, path, sizeof path) && lstat(path, &sb) == 0) {
      tp_status_t st = check_owner(name, &sb);
      if (st != TP_SUCCESS) return st;
    }
    return tp_seg_sys_error("cannot open shared-memory segment", name, err);
  }
  struct stat sb;
  if (fstat(f, &sb) != 0) {
    int err = errno;
    close(f);
    return tp_seg_sys_error("cannot stat shared-memory segment", name, err);
  }
  tp_status_t st = check_owner(name, &sb);
  if (st != TP_SUCCESS) {
    close(f);
    return st;
  }
  *fd = f;
  *nbytes = (size_t)sb.st_size;
  return TP_SUCCESS;
}

tp_status_t tp_seg_create(const char *name, size_t size, void **base, int *fd, int *exists) {
  *exists = 0;
  *fd = -1;
  for (int attempt = 0;; attempt++) {
    int f = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (f < 0) {
      if (errno == EEXIST) {
        *exists = 1;
        return TP_ERR_INVALID_USAGE;
      }
      return tp_seg_sys_error("cannot create shared-memory segment", name, errno);
    }
    /* The umask may have cleared bits of 0600; peers insist on exactly 0600. */
    if (fchmod(f, 0600) != 0 || !tp_seg_lock(name, f)) {
      int err = errno;
      int same = tp_seg_same(name, f);
      close(f);
      if (!same && attempt < 8) continue; /* a sweep removed the name before we locked it */
      if (same) shm_unlink(name);
      return tp_seg_sys_error("cannot lock shared-memory segment", name, err ? err : EAGAIN);
    }
    int err = 0;
    if (ftruncate(f, (off_t)size) != 0) err = errno;
    if (!err) err = posix_fallocate(f, 0, (off_t)size);
    if (err == EINVAL || err == EOPNOTSUPP) err = 0; /* file system without fallocate */
    void *p = MAP_FAILED;
    if (!err) {
      p = tp_seg_map(f, size);
      if (p == MAP_FAILED) err = errno;
    }
    if (err) {
      if (tp_seg_same(name, f)) shm_unlink(name);
      tp_seg_close(f);
      return tp_seg_sys_error("cannot size shared-memory segment", name, err);
    }
    *base = p;
    *fd = f;
    return TP_SUCCESS;
  }
}

void tp_seg_leave(const char *name, int fd) {
  if (fd < 0) return;
  flock(fd, LOCK_UN);
  /* Whoever leaves last finds no other lock and removes the name. */
  if (flock(fd, LOCK_EX | LOCK_NB) == 0 && tp_seg_same(name, fd)) shm_unlink(name);
  tp_seg_close(fd);
}

int tp_seg_sweep(const char *prefix) {
  DIR *d = opendir(SHM_DIR);
  if (!d) return 0;
  int dfd = dirfd(d), removed = 0;
  size_t plen = strlen(prefix);
  uid_t me = geteuid();
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, plen) != 0) continue;
    int f = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (f < 0) continue; /* gone, or another user's */
    struct stat a, b;
    /* Only what tpcore makes (this user's, 0600): anything else is left for a person to look at. */
    if (fstat(f, &a) == 0 && S_ISREG(a.st_mode) && a.st_uid == me && (a.st_mode & 07777) == 0600 &&
        flock(f, LOCK_EX | LOCK_NB) == 0 && fstatat(dfd, e->d_name, &b, AT_SYMLINK_NOFOLLOW) == 0 &&
        a.st_dev == b.st_dev && a.st_ino == b.st_ino && unlinkat(dfd, e->d_name, 0) == 0)
      removed++;
    close(f);
  }
  closedir(d);
  return removed;
}
