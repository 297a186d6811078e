/* The run-time library finder (dynlib.h has the search order). */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dynlib.h"

#define MAX_DIRS 32
#define MAX_PATH 4096

static pthread_mutex_t dirs_lock = PTHREAD_MUTEX_INITIALIZER;
static char *dirs[MAX_DIRS];
static int ndirs;

tp_status_t tp_set_library_dirs(const char *const *list, int n) {
  if (n < 0 || n > MAX_DIRS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "set_library_dirs: %d directories (0 to %d)", n, MAX_DIRS);
  if (n && !list) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "set_library_dirs: dirs is NULL");
  char *copy[MAX_DIRS] = {0};
  for (int i = 0; i < n; i++) {
    if (!list[i] || !*list[i] || strlen(list[i]) >= MAX_PATH / 2) {
      for (int j = 0; j < i; j++) free(copy[j]);
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "set_library_dirs: directory %d is %s", i,
                          list[i] && *list[i] ? "too long" : "empty or NULL");
    }
    copy[i] = strdup(list[i]);
    if (!copy[i]) {
      for (int j = 0; j < i; j++) free(copy[j]);
      return tp_set_error(TP_ERR_NOMEM, "set_library_dirs: out of memory");
    }
  }
  pthread_mutex_lock(&dirs_lock);
  for (int i = 0; i < ndirs; i++) free(dirs[i]);
  for (int i = 0; i < n; i++) dirs[i] = copy[i];
  ndirs = n;
  pthread_mutex_unlock(&dirs_lock);
  return TP_SUCCESS;
}

/* The last result of each library's search (build_info reports them): its path, or
 * the error sentence. */
#define MAX_RECORDS 8
static struct {
  char what[32];
  char result[1024];
  int found;
} records[MAX_RECORDS];
static int nrecords;

static void record(const char *what, void *h) {
  pthread_mutex_lock(&dirs_lock);
  int i = 0;
  while (i < nrecords && strcmp(records[i].what, what)) i++;
  if (i == nrecords && nrecords < MAX_RECORDS) snprintf(records[nrecords++].what, sizeof records[0].what, "%s", what);
  if (i < nrecords) {
    records[i].found = h != NULL;
    snprintf(records[i].result, sizeof records[i].result, "%s", h ? tp_dynlib_path(h) : tp_last_error());
  }
  pthread_mutex_unlock(&dirs_lock);
}

int tp_dynlib_search_result(int i, char *what, size_t wcap, char *result, size_t rcap) {
  int found = -1;
  pthread_mutex_lock(&dirs_lock);
  if (i >= 0 && i < nrecords) {
    snprintf(what, wcap, "%s", records[i].what);
    snprintf(result, rcap, "%s", records[i].result);
    found = records[i].found;
  }
  pthread_mutex_unlock(&dirs_lock);
  return found;
}

/* The places tried, for the error sentence: "a (error); b (error); ...", bounded. */
typedef struct {
  char text[3072];
  size_t len;
  char first_error[512]; /* the most telling error: a file that exists but does not load */
} tried_t;

static void note_try(tried_t *t, const char *place, const char *err, int exists) {
  if (t->len < sizeof t->text)
    t->len += (size_t)snprintf(t->text + t->len, sizeof t->text - t->len, "%s%s", t->len ? ", " : "", place);
  if (exists && err && !t->first_error[0]) snprintf(t->first_error, sizeof t->first_error, "%s", err);
}

static void *try_open(tried_t *t, const char *path, int is_path) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h) return h;
  const char *err = dlerror();
  /* A file that is there but does not load (wrong architecture, missing dependency,
   * corrupt) is worth naming; "no such file" is the ordinary miss. */
  int exists = is_path ? access(path, F_OK) == 0 : (err && !strstr(err, "No such file"));
  note_try(t, path, err, exists);
  return NULL;
}

static void *try_dir(tried_t *t, const char *dir, const char *const *sonames, int n) {
  char path[MAX_PATH];
  for (int i = 0; i < n; i++) {
    int len = snprintf(path, sizeof path, "%s/%s", dir, sonames[i]);
    if (len <= 0 || (size_t)len >= sizeof path) continue;
    void *h = try_open(t, path, 1);
    if (h) return h;
  }
  return NULL;
}

static void *dynlib_open(const char *what, const char *override_env, const char *const *sonames, int nsonames);

void *tp_dynlib_open(const char *what, const char *override_env, const char *const *sonames, int nsonames) {
  void *h = dynlib_open(what, override_env, sonames, nsonames);
  if (what && sonames && nsonames > 0) record(what, h);
  return h;
}

static void *dynlib_open(const char *what, const char *override_env, const char *const *sonames, int nsonames) {
  if (!what || !sonames || nsonames <= 0) {
    tp_set_error(TP_ERR_INVALID_ARGUMENT, "dynlib_open: no library named");
    return NULL;
  }
  tried_t t;
  memset(&t, 0, sizeof t);
  const char *over = override_env ? getenv(override_env) : NULL;
  if (over && *over) {
    void *h = dlopen(over, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    const char *err = dlerror();
    tp_set_error(TP_ERR_UNSUPPORTED, "cannot load %s from %s=%s: %s", what, override_env, over,
                 err ? err : "unknown error");
    return NULL;
  }
  void *h = NULL;
  pthread_mutex_lock(&dirs_lock);
  for (int i = 0; i < ndirs && !h; i++) h = try_dir(&t, dirs[i], sonames, nsonames);
  pthread_mutex_unlock(&dirs_lock);
  if (h) return h;
  const char *homes[] = {"CUDA_HOME", "CUDA_PATH"};
  char dir[MAX_PATH];
  for (int i = 0; i < 2 && !h; i++) {
    const char *home = getenv(homes[i]);
    if (!home || !*home) continue;
    if ((size_t)snprintf(dir, sizeof dir, "%s/lib64", home) >= sizeof dir) continue;
    h = try_dir(&t, dir, sonames, nsonames);
  }
  if (!h) h = try_dir(&t, "/usr/local/cuda/lib64", sonames, nsonames);
  for (int i = 0; i < nsonames && !h; i++) h = try_open(&t, sonames[i], 0);
  if (h) return h;
  tp_set_error(TP_ERR_UNSUPPORTED,
               "cannot find %s: tried %s%s%s%s%s%s; install it (the nvidia-* wheel that has "
               "it, as PyTorch does) or point %s at the library file",
               what, override_env ? override_env : "", override_env ? " (unset), " : "", t.text,
               t.first_error[0] ? " (one was found but did not load: " : "", t.first_error, t.first_error[0] ? ")" : "",
               override_env ? override_env : "LD_LIBRARY_PATH");
  return NULL;
}
