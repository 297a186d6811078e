/*
 * The run-time library finder (private): how tpcore opens cuBLAS, cuBLASLt and NCCL
 * without linking them (the toolkit may lack them; the wheels are hundreds of MB).
 *
 * Search order for one library (first that dlopens wins; RTLD_NOW | RTLD_LOCAL):
 *   1. the override variable (TPCORE_NCCL_LIBRARY, TPCORE_CUBLAS_LIBRARY, ...): a full
 *      path; when set it is the only place tried, and its failure is the error;
 *   2. the directories registered with tp_set_library_dirs (the Python side passes the
 *      lib directories of the nvidia-* wheels: nvidia/nccl/lib, nvidia/cublas/lib, ...),
 *      each with every soname in order;
 *   3. $CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64 (with each soname);
 *   4. the loader path: dlopen(soname) for every soname (LD_LIBRARY_PATH, ldconfig).
 * A failure is TP_ERR_UNSUPPORTED with a sentence naming the library, every place tried
 * in order and dlerror() of the most telling one.
 */
#ifndef TPCORE_DYNLIB_H
#define TPCORE_DYNLIB_H

#include "core_impl.h"

/* what: "NCCL"; override_env: "TPCORE_NCCL_LIBRARY" (may be NULL); sonames in order of
 * preference ("libnccl.so.2", "libnccl.so").  NULL with the error set when none loads. */
void *tp_dynlib_open(const char *what, const char *override_env, const char *const *sonames, int nsonames);
/* dlsym that sets the error ("NCCL at /path has no symbol ncclCommInitRankConfig") when absent. */
void *tp_dynlib_sym(void *lib, const char *what, const char *symbol);
/* The path a handle of tp_dynlib_open was loaded from (for build_info), or "". */
const char *tp_dynlib_path(void *lib);

/* The last search of the i-th library searched so far (build_info): what ("NCCL") and
 * its path (returns 1) or the error sentence (returns 0); -1 past the last. */
int tp_dynlib_search_result(int i, char *what, size_t wcap, char *result, size_t rcap);

#endif
