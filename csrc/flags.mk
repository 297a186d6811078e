# The compiler and linker flags of every build, read by the Makefile (`include`) and by setup.py
# (parsed: plain `NAME := words` lines, `$(NAME)` of a name defined above, '#' comments; no shell
# quoting, since setup.py passes each word as one argument).  What a build finds on the machine
# is added by that build: BLAS (scipy-openblas32 or pkg-config), mpicc's flags, the CUDA
# toolkit's include/, the -gencode flags and TP_CUDA_ARCH_STR of the chosen architectures.
# tests/project/test_build.py checks that both builds compile and link the plugins with these.

# Every C file: the core (libtpcore.a), the extension tpcore._C, the C tests, the plugins' C files.
TP_CFLAGS := -std=c11 -Wall -Wextra -Wno-unused-parameter -fPIC -fvisibility=hidden -D_GNU_SOURCE -Icsrc/include
TP_LIBS := -lpthread -lrt -ldl -lm
# One of these per build: release (-g as Python's own flags give setup.py anyway), TPCORE_DEBUG=1 /
# make DEBUG=1, TPCORE_SANITIZE=<list> / make SANITIZE=1 (TP_SANITIZERS is the list; a finding
# stops the process).
TP_OPT_RELEASE := -O3 -g
TP_OPT_DEBUG := -O0 -g
TP_SANITIZERS := address,undefined
TP_OPT_SANITIZE := -O1 -g -fno-omit-frame-pointer -fsanitize=$(TP_SANITIZERS) -fno-sanitize-recover=all
TP_LDFLAGS_SANITIZE := -fsanitize=$(TP_SANITIZERS)

# The plugins (shared libraries that tpcore opens at run time): every symbol hidden but the entry
# that the plugin's version script (csrc/sources.mk's TP_*_MAP) names, and no undefined symbol
# left for the host to provide.
TP_PLUGIN_CFLAGS := $(TP_CFLAGS) -Icsrc
# the MPI plugin: compiled with the build's optimisation (and sanitizers) plus mpicc's flags
TP_MPI_LDFLAGS := -shared -Wl,--no-undefined
# the CUDA plugin: its .cu files by nvcc, its .c files by the C compiler (always optimised, never
# sanitized: nvcc's objects are not), linked by nvcc with the CUDA runtime inside.
TP_CUDA_ARCHS := 80 90
TP_NVCCFLAGS := -std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden -D_GNU_SOURCE -Icsrc/include -Icsrc
TP_CUDA_CFLAGS := $(TP_PLUGIN_CFLAGS) -O2
TP_CUDA_LDFLAGS := -shared --cudart=static -Xlinker --exclude-libs,ALL -Xlinker --no-undefined
TP_CUDA_LIBS := -ldl -lrt -lpthread
