/* The CPU kernel table's entries (private): each has the signature of its
 * tp_kernel_ops field (../kernels_impl.h documents them) and is listed in table.c. */
#ifndef TPCORE_KERNELS_CPU_IMPL_H
#define TPCORE_KERNELS_CPU_IMPL_H

#include "../kernels_impl.h"

#define TP_CPU_DECLARE_(name) extern __typeof__(*((tp_kernel_ops *)0)->name) tp_cpu_##name;
TP_KERNEL_ENTRIES(TP_CPU_DECLARE_)
#undef TP_CPU_DECLARE_

#endif
