/* The CUDA kernel table's entries (private): each has the signature of its
 * tp_kernel_ops field (../kernels_impl.h documents them), C linkage, is defined in a
 * .cu file of this directory and listed in table.c.  Included by C (table.c) and by
 * C++ (the .cu files, compiled by nvcc). */
#ifndef TPCORE_KERNELS_CUDA_IMPL_H
#define TPCORE_KERNELS_CUDA_IMPL_H

#include "../../kernels/kernels_impl.h"

#ifdef __cplusplus
#include <type_traits>
extern "C" {
#define TP_CUDA_DECLARE_(name) extern std::remove_pointer<decltype(((tp_kernel_ops *)0)->name)>::type tp_cuda_##name;
#else
#define TP_CUDA_DECLARE_(name) extern __typeof__(*((tp_kernel_ops *)0)->name) tp_cuda_##name;
#endif
TP_KERNEL_ENTRIES(TP_CUDA_DECLARE_)
#undef TP_CUDA_DECLARE_
#ifdef __cplusplus
}
#endif

#endif
