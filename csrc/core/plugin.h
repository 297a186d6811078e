/*
 * Opening a plugin built apart from the core (private): the CUDA device's
 * libtpcore_cuda.so (csrc/cuda/cuda_load.c) and the mpi backend's libtpcore_mpi.so
 * (csrc/comm/mpi/mpi_load.c) are found, opened, started and checked here, with one set of
 * error sentences.  The opener knows no table: the caller registers what the plugin
 * returns, in the registry of its own level.
 *
 * The handshake: the core looks up the plugin's one exported symbol (spec->entry) and
 * calls it with the caller's host table and a zeroed reply.  The plugin writes the
 * reply's header first (even when it refuses the host), then checks the host's ABI and
 * fills the rest.  The core refuses a plugin of another ABI, one whose entry failed, and
 * one of another tpcore version (plugins and core are built together).
 */
#ifndef TPCORE_PLUGIN_H
#define TPCORE_PLUGIN_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "core_impl.h"

#define TP_PLUGIN_STR2_(x) #x
#define TP_PLUGIN_STR_(x) TP_PLUGIN_STR2_(x)
/* "0.x.y": the version a plugin must have been built from. */
#define TP_HOST_VERSION \
  TP_PLUGIN_STR_(TP_VERSION_MAJOR) "." TP_PLUGIN_STR_(TP_VERSION_MINOR) "." TP_PLUGIN_STR_(TP_VERSION_PATCH)

/* The first fields of every plugin's reply (the CUDA and MPI plugins' replies begin so). */
typedef struct tp_plugin_header {
  uint32_t abi_version;       /* the plugin's ABI, written even when it refuses the host */
  uint32_t size;              /* sizeof its reply struct */
  const char *tpcore_version; /* the version it was built from */
} tp_plugin_header;

typedef struct tp_plugin_spec {
  const char *what;     /* "CUDA plugin" (the sentences' subject) */
  const char *env_name; /* "TPCORE_CUDA_PLUGIN": when set, the only place tried */
  const char *soname;   /* "libtpcore_cuda.so" */
  const char *entry;    /* the exported entry ("tp_<name>_plugin_init_v1") */
  uint32_t abi;         /* the ABI this core speaks */
  size_t reply_size;    /* sizeof the reply struct of that ABI */
  const char *rebuild;  /* how to rebuild both: "pip install . or make CUDA=1" */
  /* NULL, or run on the opened library before its entry (the MPI plugin promotes libmpi). */
  void (*before_entry)(void *handle);
} tp_plugin_spec;

/* A plugin's entry: fills reply (tp_plugin_header first) from the host table. */
typedef tp_status_t (*tp_plugin_entry_fn)(const void *host, void *reply);

/* Space for the reply: room beyond the structs of this ABI, a plugin of another may write more. */
#define TP_PLUGIN_REPLY_MAX 1024

/* The library alone: `path` when given, else $env_name when set (either is then the only
 * place tried), else soname beside the loaded core (<dir>/.libs/, <dir>/: tpcore/.libs
 * for the extension, build/ for the Makefile's programs), then the loader path;
 * RTLD_NOW | RTLD_LOCAL.  NULL with the error set, naming every place tried and why a
 * file that exists did not load ("... did not load: ..." / "this build has no ..."). */
void *tp_plugin_open(const char *what, const char *env_name, const char *soname, const char *path);

/* Opens spec's plugin (as tp_plugin_open), runs before_entry, calls its entry with host
 * and reply (TP_PLUGIN_REPLY_MAX bytes, zeroed here) and checks the ABI, the entry's
 * status, the reply's size and the tpcore version.  On success *file is the plugin's path
 * (static storage, valid until the next load). */
tp_status_t tp_plugin_load(const tp_plugin_spec *spec, const char *path, const void *host, void *reply,
                           const char **file);

/* The error record's entries of every host table (tp_set_error / tp_error_prefix of the
 * caller's thread, with the arguments as a va_list). */
tp_status_t tp_plugin_set_error_v(tp_status_t status, const char *fmt, va_list ap);
void tp_plugin_error_prefix_v(const char *fmt, va_list ap);

/* A load run once per process: every later call gives the first call's status and sentence. */
typedef struct tp_plugin_once {
  pthread_mutex_t lock;
  int done; /* under lock; read with acquire */
  tp_status_t status;
  char error[1536];
} tp_plugin_once;
#define TP_PLUGIN_ONCE_INIT {PTHREAD_MUTEX_INITIALIZER, 0, TP_SUCCESS, ""}

/* Runs load(arg) on the first call; returns its status, with its sentence set again on failure. */
tp_status_t tp_plugin_once_run(tp_plugin_once *once, tp_status_t (*load)(void *arg), void *arg);
/* 1 once the load has run (acquire); then once->status and once->error are final. */
int tp_plugin_once_done(tp_plugin_once *once);

#endif
