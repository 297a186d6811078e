/* The one place that names BLAS symbols.  The default build links the OpenBLAS of
 * the scipy-openblas32 wheel, vendored into the package, whose symbols carry a
 * "scipy_" prefix (so they never clash with NumPy's own copy); TPCORE_BLAS=system
 * links a system CBLAS found by pkg-config (plain names). */
#ifndef TPCORE_BLAS_IMPL_H
#define TPCORE_BLAS_IMPL_H

#include <cblas.h>

#if defined(TP_BLAS_SCIPY_OPENBLAS)
#define TP_BLAS(name) scipy_##name
#define TP_BLAS_IS_OPENBLAS 1
#else
#define TP_BLAS(name) name
#if defined(OPENBLAS_VERSION) || defined(OPENBLAS_CONST)
#define TP_BLAS_IS_OPENBLAS 1
#endif
#endif

/* The integer type of the CBLAS interface: OpenBLAS's blasint (int32 in these
 * builds), plain int for other CBLAS headers. */
#if defined(TP_BLAS_IS_OPENBLAS)
typedef blasint tp_blasint;
#else
typedef int tp_blasint;
#endif

#endif
