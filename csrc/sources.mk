# The one list of the C sources, read by the Makefile (`include`) and by setup.py (parsed:
# plain `NAME := words` lines; '#' comments).  A directory's *.c files are all compiled, so a
# new file in a listed directory needs no edit; a new directory is one word here.
#   TP_CORE_DIRS     the C core (libtpcore.a, usable from C without Python)
#   TP_PYTHON_DIRS   the CPython extension's own files (setup.py only)
#   TP_CUDA_DIRS     the CUDA plugin libtpcore_cuda.so: every *.cu (nvcc) and *.c (cc) of these,
#                    plus csrc/core/dtype.c, dynlib_sym.c (setup.py's build_ext; `make CUDA=1`)
#   TP_MPI_DIRS      the MPI plugin libtpcore_mpi.so: every *.c of these (mpicc's flags), plus
#                    csrc/core/dtype.c and csrc/comm/late.c
# Every C file of csrc/ outside csrc/tests is in exactly one of them (tests/project/test_build.py).
TP_CORE_DIRS := csrc/core csrc/devices csrc/kernels csrc/kernels/cpu csrc/comm csrc/comm/shm csrc/comm/nccl csrc/comm/store csrc/comm/mpi csrc/cuda csrc/layers
TP_PYTHON_DIRS := csrc/python
TP_CUDA_DIRS := csrc/cuda/plugin csrc/cuda/kernels
# The plugins' other files (Makefile and setup.py): the core's files each compiles in, and the
# version script that leaves its entry the only exported symbol.  The MPI plugin is every *.c
# of TP_MPI_DIRS (the only files that include <mpi.h>).
TP_CUDA_EXTRA := csrc/core/dtype.c csrc/core/dynlib_sym.c
TP_CUDA_MAP := csrc/cuda/plugin/plugin.map
TP_MPI_DIRS := csrc/comm/mpi/plugin
TP_MPI_EXTRA := csrc/core/dtype.c csrc/comm/late.c
TP_MPI_MAP := csrc/comm/mpi/plugin/plugin.map
