# The C core without Python: libtpcore.a and the C tests.
#   make                 build/libtpcore.a and the C tests (test_comm, test_layers, test_kernels,
#                        test_api_hostile, test_store)
#   make SANITIZE=1      the same under ASan + UBSan (in build-san/)
#   make DEBUG=1         the same at -O0 -g (in build-debug/)
#   make test            run the C tests (world sizes 1-4)
#   make check           lint (ruff, clang-format), the C tests, and the quick Python subset
#                        (pytest -m "not slow"; needs the extension built: pip install -e . or
#                        python setup.py build_ext --inplace, and the test extras)
#   make CUDA=1          also build/libtpcore_cuda.so, the CUDA plugin (nvcc; CUDA_ARCHS="80 90" by
#                        default: sm_XX machine code for each, PTX of the last); the C programs load
#                        it from beside themselves on first CUDA use
#   MPI=0                do not build build/libtpcore_mpi.so, the MPI plugin (built when mpicc is
#                        found; `make test` then runs test_mpi under mpirun at world sizes 1-4)
CC ?= cc
# The flags (csrc/flags.mk) and the source directories (csrc/sources.mk), shared with setup.py.
include csrc/flags.mk
include csrc/sources.mk
ifeq ($(SANITIZE),1)
BUILD ?= build-san
OPT := $(TP_OPT_SANITIZE)
LDFLAGS := $(TP_LDFLAGS_SANITIZE)
else ifeq ($(DEBUG),1)
BUILD ?= build-debug
OPT := $(TP_OPT_DEBUG)
LDFLAGS :=
else
BUILD ?= build
OPT := $(TP_OPT_RELEASE)
LDFLAGS :=
endif
CFLAGS := $(TP_CFLAGS) $(OPT)
# BLAS: the scipy-openblas32 wheel's OpenBLAS when Python has it (pip install '.[test]'),
# else a system CBLAS through pkg-config (BLAS=system forces that).
ifneq ($(BLAS),system)
SOB_DIR := $(shell python3 -c "import scipy_openblas32 as s; print(s.get_lib_dir())" 2>/dev/null)
endif
ifneq ($(SOB_DIR),)
BLAS_CFLAGS := -DTP_BLAS_SCIPY_OPENBLAS=1 -I$(shell python3 -c "import scipy_openblas32 as s; print(s.get_include_dir())")
BLAS_LIBS := -L$(SOB_DIR) -lscipy_openblas -Wl,-rpath,$(SOB_DIR)
else
BLAS_CFLAGS := $(shell pkg-config --cflags openblas 2>/dev/null || pkg-config --cflags cblas)
BLAS_LIBS := $(shell pkg-config --libs openblas 2>/dev/null || pkg-config --libs cblas)
endif
CFLAGS += $(BLAS_CFLAGS)
LIBS := $(BLAS_LIBS) $(TP_LIBS)

CORE_SRC := $(sort $(foreach d,$(TP_CORE_DIRS),$(wildcard $(d)/*.c)))
CORE_OBJ := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(CORE_SRC))
HDRS := $(wildcard csrc/include/tpcore/*.h) $(wildcard csrc/*/*.h) $(wildcard csrc/*/*/*.h) $(wildcard csrc/*/*/*/*.h)

# Fake NCCL libraries for test_nccl (rules below).
FAKE_NCCL := $(BUILD)/fake_nccl/old/libnccl.so.2 $(BUILD)/fake_nccl/nosym/libnccl.so.2 \
             $(BUILD)/fake_nccl/good/libnccl.so.2 $(BUILD)/fake_nccl/home/lib64/libnccl.so.2

# The MPI plugin: TP_MPI_DIRS's *.c (csrc/comm/mpi/plugin/, the only files that include <mpi.h>)
# with mpicc's flags, linked to libmpi, exporting its entry only (csrc/comm/mpi/mpi_abi.h); the
# core opens it from beside itself.
MPICC ?= $(shell command -v mpicc 2>/dev/null)
MPIRUN ?= $(shell command -v mpirun 2>/dev/null)
ifneq ($(MPI),0)
ifneq ($(MPICC),)
MPI_CFLAGS := $(shell $(MPICC) --showme:compile 2>/dev/null || pkg-config --cflags ompi 2>/dev/null)
MPI_LIBS := $(shell $(MPICC) --showme:link 2>/dev/null || pkg-config --libs ompi 2>/dev/null)
MPI_PLUGIN := $(BUILD)/libtpcore_mpi.so $(BUILD)/test_mpi
endif
endif

all: $(BUILD)/libtpcore.a $(BUILD)/test_comm $(BUILD)/test_layers $(BUILD)/test_layer_memory $(BUILD)/test_kernels $(BUILD)/test_api_hostile \
     $(BUILD)/test_store $(BUILD)/test_nccl $(FAKE_NCCL) $(if $(filter 1,$(CUDA)),$(BUILD)/libtpcore_cuda.so) \
     $(MPI_PLUGIN)

# The CUDA plugin (CUDA=1): TP_CUDA_DIRS's .cu files by nvcc, .c files (and core/dtype.c, dynlib_sym.c)
# by cc, the CUDA runtime linked statically, every symbol hidden but the entry (csrc/cuda/plugin_abi.h).
NVCC ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/nvcc),/usr/local/cuda/bin/nvcc)
# the toolkit's root (for its headers): CUDA_HOME, /usr/local/cuda, or above nvcc
CUDA_ROOT := $(or $(CUDA_HOME),$(wildcard /usr/local/cuda),$(abspath $(dir $(realpath $(NVCC)))..))
CUDA_ARCHS ?= $(TP_CUDA_ARCHS)
CUDA_GENCODE := $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
                -gencode=arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
CUDA_ARCH_STR := $(foreach a,$(CUDA_ARCHS),sm_$(a)) + compute_$(lastword $(CUDA_ARCHS)) PTX
NVCCFLAGS := $(TP_NVCCFLAGS) $(CUDA_GENCODE)
CUDA_CU := $(sort $(foreach d,$(TP_CUDA_DIRS),$(wildcard $(d)/*.cu)))
CUDA_C := $(sort $(foreach d,$(TP_CUDA_DIRS),$(wildcard $(d)/*.c))) $(TP_CUDA_EXTRA)
CUDA_OBJ := $(patsubst csrc/%.cu,$(BUILD)/cuda-obj/%.cu.o,$(CUDA_CU)) $(patsubst csrc/%.c,$(BUILD)/cuda-obj/%.o,$(CUDA_C))

CUDA_HDRS := $(sort $(foreach d,$(TP_CUDA_DIRS),$(wildcard $(d)/*.cuh)))  # the kernels' own headers

$(BUILD)/cuda-obj/%.cu.o: csrc/%.cu $(HDRS) $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/cuda-obj/%.o: csrc/%.c $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(TP_CUDA_CFLAGS) -I$(CUDA_ROOT)/include -DTP_CUDA_ARCH_STR='"$(CUDA_ARCH_STR)"' -c $< -o $@

$(BUILD)/libtpcore_cuda.so: $(CUDA_OBJ) $(TP_CUDA_MAP)
	$(NVCC) $(TP_CUDA_LDFLAGS) -Xlinker --version-script=$(TP_CUDA_MAP) -o $@ $(CUDA_OBJ) $(TP_CUDA_LIBS)

MPI_SRC := $(sort $(foreach d,$(TP_MPI_DIRS),$(wildcard $(d)/*.c))) $(TP_MPI_EXTRA)

$(BUILD)/libtpcore_mpi.so: $(MPI_SRC) $(TP_MPI_MAP) $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(TP_PLUGIN_CFLAGS) $(OPT) $(MPI_CFLAGS) $(TP_MPI_LDFLAGS) $(MPI_SRC) -o $@ \
	  -Wl,--version-script=$(TP_MPI_MAP) $(LDFLAGS) $(MPI_LIBS)

$(BUILD)/test_mpi: csrc/tests/test_mpi.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

$(BUILD)/obj/%.o: csrc/%.c $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libtpcore.a: $(CORE_OBJ)
	rm -f $@
	ar rcs $@ $^

$(BUILD)/test_comm: csrc/tests/test_comm.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

# The rendezvous store (csrc/comm/store/) from C: threads, timeouts, hostile sockets.
$(BUILD)/test_store: csrc/tests/test_store.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

$(BUILD)/test_layers: csrc/tests/test_layers.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

# The layers' memory accounting (tp_*_memory) against sizes computed from the configs.
$(BUILD)/test_layer_memory: csrc/tests/test_layer_memory.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

# Hostile arguments to every public entry of the tensor + stream API.
HTEST_SRC := $(wildcard csrc/tests/test_api_hostile*.c)

$(BUILD)/test_api_hostile: $(HTEST_SRC) csrc/tests/test_api_hostile.h $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $(HTEST_SRC) -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

# The NCCL binding's error paths, against fake libraries (csrc/tests/fake_nccl.c): one
# too old, one lacking a symbol, one good (no GPU needed: it must stop at the device).

$(BUILD)/test_nccl: csrc/tests/test_nccl.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

$(BUILD)/fake_nccl/old/libnccl.so.2 $(BUILD)/fake_nccl/home/lib64/libnccl.so.2: csrc/tests/fake_nccl.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -DFAKE_VERSION=21603 $< -o $@

$(BUILD)/fake_nccl/nosym/libnccl.so.2: csrc/tests/fake_nccl.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -DFAKE_OMIT_SPLIT $< -o $@

$(BUILD)/fake_nccl/good/libnccl.so.2: csrc/tests/fake_nccl.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC $< -o $@

# The NCCL backend and the host-staged path on a GPU (scripts/gpu_check.sh builds and runs
# it: test_nccl_gpu nccl 1, nccl 2, shm 2); not part of `make test` (no GPU here).
$(BUILD)/test_nccl_gpu: csrc/tests/test_nccl_gpu.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

# The kernel parity harness: every entry of every kernel table against references.
KTEST_SRC := $(wildcard csrc/tests/test_kernels*.c)

$(BUILD)/test_kernels: $(KTEST_SRC) csrc/tests/test_kernels.h $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $(KTEST_SRC) -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

# The quantized dot kernels' microbenchmark (csrc/tests/bench_quant.c: ns per row, GB/s per
# format and ISA level); not part of `make test`.
$(BUILD)/bench_quant: csrc/tests/bench_quant.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

bench-quant: $(BUILD)/bench_quant
	$(abspath $(BUILD))/bench_quant

test: all
	$(abspath $(BUILD))/test_comm
	$(abspath $(BUILD))/test_layers
	$(abspath $(BUILD))/test_layer_memory
	$(abspath $(BUILD))/test_kernels
# (sanitized: the hostile sizes ask for huge allocations that must fail as malloc fails, not abort)
	$(if $(filter 1,$(SANITIZE)),ASAN_OPTIONS=allocator_may_return_null=1) $(abspath $(BUILD))/test_api_hostile
	$(abspath $(BUILD))/test_store
	TPCORE_TEST_FAKE_NCCL=$(abspath $(BUILD))/fake_nccl $(abspath $(BUILD))/test_nccl
ifneq ($(MPI_PLUGIN),)
# (sanitized: leak checking is off for test_mpi: Open MPI leaves its allocations to the process's end,
# many from components it has already unloaded, which no suppression can name; ASan/UBSan stay on)
	for n in 1 2 3 4; do $(if $(filter 1,$(SANITIZE)),ASAN_OPTIONS=detect_leaks=0) OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
	  $(MPIRUN) -n $$n $(abspath $(BUILD))/test_mpi || exit 1; done
endif

PYTHON ?= python3
LINT_C := $(shell git ls-files 'csrc/*.c' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 2>/dev/null)
check: all
	ruff check python tests benchmarks examples scripts docs
	clang-format --dry-run --Werror $(LINT_C)
	$(MAKE) test
	$(if $(wildcard python/tpcore/_C*.so),PYTHONPATH=$(CURDIR)/python) $(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

clean:
	rm -rf build build-san build-debug

# The C core's sources, one per line (tests/project/test_build.py compares setup.py's list with it).
print-core-sources:
	@printf '%s\n' $(CORE_SRC)

.PHONY: all test check clean print-core-sources bench-quant
