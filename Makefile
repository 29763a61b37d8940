# tinyscale — one binary per technique, two backends in each.
#
#   make            build every technique into build/ (with CUDA when nvcc is found)
#   make CUDA=0     the same sources compiled by g++ as C++, CUDA compiled out
#   make CUDA=emu   the emulated GPU: g++ compiles the CUDA code against common/emu/, and
#                   --device cuda runs it on the CPU (into build-emu/; notes/emulated_gpu.md)
#   make test       install missing packages, build (on every core), run every test; last line
#                   "N passed, M failed". Without a visible GPU it builds the emulated GPU
#                   (CUDA=emu), so every [cuda] case runs there
#   make demo       build 01 only (in parallel; CPU-only into build/demo-cpu when no GPU is visible),
#                   train it on the embedded data (about a minute); its plot in build/demo.png
#   make bench      kernel, collective and training-step benchmarks
#   make ptxas      every CUDA kernel's registers, spills, shared memory, block size and occupancy on
#                   an H100 (nvcc -Xptxas -v for sm_90 over DEVICE_SRC; scripts/ptxas_table.py)
#   make fuzz       each libFuzzer target (fuzz/) for FUZZ_SECONDS (60); make test runs each for 5 s
#   make clean
#
# Variables: CUDA=auto|0|1|emu, CUDA_ARCH="80 90" (sm list), BUILD=build, NP=mpirun ranks for demos,
#            SANITIZE=address (with CUDA=emu and its own BUILD: AddressSanitizer, below),
#            SANITIZE=memory (with CUDA=emu: initcheck and memcheck reports, into $(BUILD)/memcheck/),
#            SANITIZE=thread (with CUDA=emu and its own BUILD: ThreadSanitizer's races, below).

NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA ?= auto
GPU_VISIBLE = $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
ifeq ($(CUDA),auto)
  ifneq ($(filter test,$(MAKECMDGOALS)),)
    # make test runs every [cuda] case: on the GPU where one is visible, under the emulated GPU
    # everywhere else (into build-emu/, so its objects never mix with nvcc's in build/).
    CUDA := $(if $(and $(NVCC),$(GPU_VISIBLE)),1,emu)
  else
    CUDA := $(if $(NVCC),1,0)
  endif
endif
ifeq ($(CUDA),1)
  ifeq ($(NVCC),)
    $(error CUDA=1 but nvcc was not found)
  endif
endif

BUILD ?= $(if $(filter emu,$(CUDA)),build-emu,build)
CUDA_ARCH ?= 80 90
# The toolkit's root from nvcc's real path (a /usr/bin/nvcc symlink into /usr/local/cuda-12.x
# resolves there); its libraries in lib64 unless CUDA_LIB names the directory that holds libcublas.
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
CUDA_LIB ?= $(firstword $(wildcard $(CUDA_HOME)/lib64/libcublas.so $(CUDA_HOME)/targets/x86_64-linux/lib/libcublas.so /usr/lib/x86_64-linux-gnu/libcublas.so))
CUDA_LIB := $(if $(CUDA_LIB),$(patsubst %/,%,$(dir $(CUDA_LIB))),$(CUDA_HOME)/lib64)

CXX := g++
MPI_SHOW := $(shell mpicxx -show 2>/dev/null)
MPI_INC := $(filter -I%,$(MPI_SHOW))
MPI_LIB := $(filter -L% -l%,$(MPI_SHOW))
ifeq ($(MPI_LIB),)
  MPI_INC := -I/usr/include/x86_64-linux-gnu/mpich
  MPI_LIB := -lmpich
endif

# The CPU kernels rely on the compiler's vectoriser; binaries are built where they run.
CPU_ARCH ?= -march=native
# So an object compiled for another CPU (a build folder copied to another machine, a shared disk)
# is never linked here, where it could stop on an illegal instruction or vectorise its sums
# differently: the target's resolved features name a stamp that every object depends on, and a
# build made for another CPU is rebuilt.
CPU_ID := $(shell $(CXX) $(CPU_ARCH) -Q --help=target 2>/dev/null | cksum | cut -d' ' -f1)
CPU_STAMP = $(BUILD)/.cpu-$(CPU_ID)
HOST_FLAGS := -O3 $(CPU_ARCH) -fno-math-errno -fopenmp -Wall -Wno-unknown-pragmas
CPPFLAGS := -Icommon $(MPI_INC)
LIBS := $(MPI_LIB) -lopenblas -lgomp -lpthread
# SANITIZE=address: g++'s AddressSanitizer over the emulated GPU (make CUDA=emu SANITIZE=address
# BUILD=build-asan): device allocations are heap blocks with its redzones, so a kernel's access
# outside its allocation is a report with the kernel's source line (notes/emulated_gpu.md). Run with
# ASAN_OPTIONS=detect_leaks=0: the emulator's streams live to the end of the process.
ifeq ($(SANITIZE),address)
  HOST_FLAGS += -O1 -g -fno-omit-frame-pointer -fsanitize=address
  SAN_LD := -fsanitize=address
else ifeq ($(SANITIZE),memory)
  ifneq ($(CUDA),emu)
    $(error SANITIZE=memory needs CUDA=emu: initcheck and memcheck are the emulated GPU's)
  endif
else ifeq ($(SANITIZE),thread)
  # SANITIZE=thread: ThreadSanitizer over the emulated GPU (make CUDA=emu SANITIZE=thread
  # BUILD=build-tsan): each CUDA thread is a TSan fiber, barriers and event waits are its
  # happens-before edges (common/emu/tsan.h), so a data race between threads, blocks, streams or an
  # NCCL call and a kernel is a report naming the kernel and both source lines.
  HOST_FLAGS += -O1 -g -fno-omit-frame-pointer -fsanitize=thread
  SAN_LD := -fsanitize=thread
  CPPFLAGS += -DTS_EMU_TSAN
else ifneq ($(SANITIZE),)
  $(error SANITIZE=$(SANITIZE): SANITIZE=address, SANITIZE=memory or SANITIZE=thread (with CUDA=emu))
endif

ifeq ($(CUDA),emu)
  # The emulated GPU (common/emu/, notes/emulated_gpu.md): g++ compiles the CUDA sources against
  # the project's stand-ins for the CUDA runtime, cuBLAS, cuBLASLt and NCCL, found first on the
  # include path, and --device cuda runs every kernel, GEMM and collective on the CPU.
  CPPFLAGS += -DTS_CUDA -DTS_CUDA_EMU -Icommon/emu
  CU := $(CXX) -std=c++17 -x c++ $(HOST_FLAGS)
  LIBS += -lboost_context
else ifeq ($(CUDA),1)
  GENCODE := $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a)) \
             -gencode arch=compute_$(lastword $(CUDA_ARCH)),code=compute_$(lastword $(CUDA_ARCH))
  CPPFLAGS += -DTS_CUDA -I$(CUDA_HOME)/include
  # --threads 0: the architectures of one file compile in parallel, not one after the other.
  CU := $(NVCC) -std=c++17 -x cu $(GENCODE) --threads 0 -Xcompiler "$(HOST_FLAGS)" --expt-relaxed-constexpr
  # No relocatable device code, so the host linker links nvcc's objects directly.
  LIBS += -L$(CUDA_LIB) -lcublasLt -lcublas -lcudart -lnccl -Wl,-rpath,$(CUDA_LIB)
else
  CU := $(CXX) -std=c++17 -x c++ $(HOST_FLAGS)
endif
# Only files that define kernels need nvcc; the others are host code (CUDA runtime, cuBLAS and NCCL
# calls included), which g++ compiles with the same macros in a fraction of nvcc's time (nvcc
# passes every file through each architecture's device compiler).
HOST_CU := $(CXX) -std=c++17 -x c++ $(HOST_FLAGS)
DEVICE_SRC := $(shell grep -l '__global__' common/*/*.cu 0[1-8]*_*.cu lab/*.cu bench/*.cu 2>/dev/null)
compiler_for = $(if $(filter $(1),$(DEVICE_SRC)),$(CU),$(HOST_CU))
ifeq ($(SANITIZE),thread)
  # The emulator's own sources are not instrumented: its bookkeeping is not the program's, and what
  # it does to the program's memory is declared to TSan by hand (common/emu/tsan.h).
  $(BUILD)/common/emu/%.o: HOST_CU := $(filter-out -fsanitize=thread,$(HOST_CU))
endif
LD := $(CXX) -fopenmp $(SAN_LD)
TESTCXX := $(CXX) -std=c++17 $(HOST_FLAGS) -Itests

# common/ in its layers (notes/00_architecture.md, "A reader's map"); the emulated device only in its build.
LAYER_SRC := $(filter-out common/emu/%,$(wildcard common/*/*.cu))
COMMON_SRC := $(LAYER_SRC) $(if $(filter emu,$(CUDA)),$(wildcard common/emu/*.cu))
COMMON_OBJ := $(patsubst %.cu,$(BUILD)/%.o,$(COMMON_SRC))
TECH_SRC := $(sort $(wildcard 0[1-8]_*.cu))
TECH_BIN := $(patsubst %.cu,$(BUILD)/%,$(TECH_SRC))
# The reading tier and the lab tier (notes/00_architecture.md, "How to read this codebase"): chapter
# NN's program links the chapter (NN_*.cu), the frontier variants read after it (NNa_*.cu, NNb_*.cu,
# …, each plugging into the chapter's core) and its lab (lab/NN_*.cu: predictions, plan and chart
# printing, reports), each its own object.
beside_src = $(sort $(wildcard $(1)[a-z]_*.cu lab/$(1)_*.cu))
beside_obj = $(patsubst %.cu,$(BUILD)/%.o,$(call beside_src,$(1)))
chapter_of = $(firstword $(subst _, ,$(1)))
TEST_SRC := $(sort $(wildcard tests/test_*.cpp))
TEST_BIN := $(patsubst tests/%.cpp,$(BUILD)/tests/%,$(TEST_SRC))
BENCH_SRC := $(sort $(wildcard bench/*.cu))
BENCH_BIN := $(patsubst bench/%.cu,$(BUILD)/bench/%,$(BENCH_SRC))

# libFuzzer targets (fuzz/): the readers of every file a run takes, built by clang with
# AddressSanitizer and UBSan over CPU-only objects of their own.
FUZZ_SRC := $(sort $(wildcard fuzz/fuzz_*.cpp))
FUZZ_BIN := $(patsubst fuzz/%.cpp,$(BUILD)/fuzz/%,$(FUZZ_SRC))
FUZZ_OBJ := $(patsubst %.cu,$(BUILD)/fuzz/%.o,$(LAYER_SRC))
FUZZ_CXX := clang++ -std=c++17 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
            -fopenmp=libgomp -Wall -Wno-unknown-pragmas -Wno-psabi -Wno-unused-private-field -Icommon $(MPI_INC)
FUZZ_SECONDS ?= 60

.PHONY: all test demo bench clean deps fuzz ptxas
# Objects built on the way to a binary are kept (make deletes such intermediates otherwise), so a
# second `make test` with nothing changed compiles nothing.
.SECONDARY:
.DEFAULT_GOAL := all
all: $(TECH_BIN) $(BENCH_BIN)

$(BUILD)/common/%.o: common/%.cu $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(call compiler_for,$<) $(CPPFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/%.o: %.cu $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(call compiler_for,$<) $(CPPFLAGS) -MMD -MP -c $< -o $@

# A technique file is a module and a program: its main() compiles only where TS_PROGRAM names it
# (01 -> 1, ..., 08 -> 8), so other files and tests can include its technique. A variant (05a_…)
# or lab file is a module only.
$(BUILD)/0%.o: 0%.cu $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(call compiler_for,$<) $(CPPFLAGS) $(if $(filter $<,$(TECH_SRC)),-DTS_PROGRAM=$(firstword $(subst _, ,$*))) -MMD -MP -c $< -o $@

$(CPU_STAMP):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/.cpu-* && touch $@

$(BUILD)/common.a: $(COMMON_OBJ)
	rm -f $@ && ar rcs $@ $^

.SECONDEXPANSION:
$(BUILD)/0%: $(BUILD)/0%.o $$(call beside_obj,$$(call chapter_of,0$$*)) $(BUILD)/common.a
	$(LD) $^ -o $@ $(LIBS)

$(BUILD)/bench/%: $(BUILD)/bench/%.o $(BUILD)/common.a
	$(LD) $^ -o $@ $(LIBS)

# Catch2's runner is compiled once (it takes ~15 s); each test file links against it.
$(BUILD)/tests/catch_main.o: tests/catch_main.cpp $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(TESTCXX) $(CPPFLAGS) -c $< -o $@

$(BUILD)/tests/%.o: tests/%.cpp $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(TESTCXX) $(CPPFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/tests/test_%: $(BUILD)/tests/test_%.o $(BUILD)/tests/catch_main.o $(BUILD)/common.a
	$(LD) $^ -o $@ $(LIBS)

# A small program the watchdog tests start under mpirun (an unmatched collective, a fatal rank).
$(BUILD)/tests/comm_error_prog: $(BUILD)/tests/comm_error_prog.o $(BUILD)/common.a
	$(LD) $^ -o $@ $(LIBS)

# The seeded bugs of tests/test_equivalence.cpp (and 04_tensor_parallel+no_split_table, a misuse that
# tests/test_tp.cpp expects to be refused), each a test-only variant TECHNIQUE+BUG of a
# technique binary: the technique's unchanged object linked with tests/bugs/BUG.cpp's, and
# -Xlinker --wrap=SYMBOL for each __wrap_SYMBOL that file defines (tests/bugs/bug.h says how).
SEEDED_BUGS := 02_data_parallel+drop_microbatch 03_zero+stale_shard 04_tensor_parallel+swap_fg \
               04_tensor_parallel+no_split_table 02_data_parallel+skip_collective 02_data_parallel+short_collective \
               07_expert_parallel+local_bias_loads 07_expert_parallel+skip_shared_expert \
               07_expert_parallel+per_expert_copies 07_expert_parallel+lost_partial \
               04_tensor_parallel+early_ring_send 07_expert_parallel+early_combine_read
# The faults the reliability tests inject the same way (tests/bugs/stop_in.cpp: a rank stopped or
# killed in a named collective; crash_in_save.cpp: a save cut short): the technique code has no
# test switch of its own (notes/00_architecture.md, "Seeded bugs").
STOP_IN := 02_data_parallel+stop_in 03_zero+stop_in 04_tensor_parallel+stop_in 05_pipeline_parallel+stop_in \
           06_context_parallel+stop_in 07_expert_parallel+stop_in
INJECTED_FAULTS := $(STOP_IN) 01_single_gpu+crash_in_save
# Defects seeded for the emulated GPU's sanitizer checks (tests/bugs/emu_*.cpp; its build only).
EMU_BUGS := $(if $(filter emu,$(CUDA)),01_single_gpu+emu_host_pointer)
# ... and for its ThreadSanitizer build (SANITIZE=thread), races that tests/test_emu_races.cpp expects reported.
EMU_RACE_BUGS := 01_single_gpu+emu_missing_barrier 01_single_gpu+emu_ownership_slip 02_data_parallel+emu_no_ready_wait
EMU_BUGS += $(if $(filter thread,$(SANITIZE)),$(EMU_RACE_BUGS))
BUG_BIN := $(patsubst %,$(BUILD)/tests/bugs/%,$(SEEDED_BUGS) $(INJECTED_FAULTS) $(EMU_BUGS))
wrap_flags = $(patsubst __wrap_%,-Xlinker --wrap=%,$(sort $(shell grep -o '__wrap_[A-Za-z0-9_]*' $(1))))
define bug_variant
$(BUILD)/tests/bugs/$(1)+$(2): $(BUILD)/$(1).o $(call beside_obj,$(call chapter_of,$(1))) $(BUILD)/tests/bugs/$(2).o $(BUILD)/common.a
	$$(LD) $$(call wrap_flags,tests/bugs/$(2).cpp) $$^ -o $$@ $$(LIBS)
endef
$(foreach v,$(SEEDED_BUGS) $(INJECTED_FAULTS) $(EMU_BUGS),$(eval $(call bug_variant,$(firstword $(subst +, ,$(v))),$(lastword $(subst +, ,$(v))))))
# Order-only: built with the test that runs them (when the test itself is built), never linked
# into it; `make test` names them as well, since make skips a missing secondary file otherwise.
$(BUILD)/tests/test_equivalence: | $(patsubst %,$(BUILD)/tests/bugs/%,$(SEEDED_BUGS))
$(BUILD)/tests/test_reliability: | $(patsubst %,$(BUILD)/tests/bugs/%,$(STOP_IN))
$(BUILD)/tests/test_single: | $(BUILD)/tests/bugs/01_single_gpu+crash_in_save
$(BUILD)/tests/test_tp: | $(BUILD)/tests/bugs/04_tensor_parallel+no_split_table
$(BUILD)/tests/test_async_tp: | $(BUILD)/tests/bugs/04_tensor_parallel+early_ring_send
$(BUILD)/tests/test_overlap_a2a: | $(BUILD)/tests/bugs/07_expert_parallel+early_combine_read
$(BUILD)/tests/test_emu_chapters: | $(patsubst %,$(BUILD)/tests/bugs/%,$(EMU_BUGS))
$(BUILD)/tests/test_ep: | $(BUILD)/tests/bugs/07_expert_parallel+local_bias_loads \
                          $(BUILD)/tests/bugs/07_expert_parallel+skip_shared_expert \
                          $(BUILD)/tests/bugs/07_expert_parallel+per_expert_copies \
                          $(BUILD)/tests/bugs/07_expert_parallel+lost_partial
$(BUILD)/tests/test_operations: | $(BUILD)/tests/bugs/02_data_parallel+skip_collective \
                                 $(BUILD)/tests/bugs/02_data_parallel+short_collective \
                                 $(BUILD)/tests/bugs/02_data_parallel+stop_in \
                                 $(BUILD)/tests/bugs/04_tensor_parallel+stop_in \
                                 $(BUILD)/tests/bugs/05_pipeline_parallel+stop_in

# SANITIZE=memory, and make test under the emulated GPU: initcheck and memcheck as reports
# (common/emu/shadow.h, notes/emulated_gpu.md). The code that holds kernels (DEVICE_SRC) and the
# seeded defects that bring their own kernels are compiled again into $(BUILD)/memcheck/ with g++'s
# kernel-address instrumentation: a call into the emulator's shadow before every load and store,
# redzones between static __shared__ arrays, -g for the reports' source lines, and neither the
# vectoriser nor SRA, so that each access is the source's own, of its size and alignment (attention
# v2's 16-byte Chunk stays one 16-byte load). Every other object is $(BUILD)'s, linked as it is.
MEMCHECK := $(BUILD)/memcheck
MEMCHECK_FLAGS := -g -fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0 \
                  --param asan-stack=0 --param asan-globals=1 -fsanitize-sections=ts_emu_shared \
                  -fno-tree-vectorize -fno-tree-slp-vectorize -fno-tree-sra
MEMCHECK_SRC := $(DEVICE_SRC)
MEMCHECK_OBJ := $(patsubst %.cu,$(MEMCHECK)/%.o,$(MEMCHECK_SRC))
# What make test runs there (tests/test_emu_memcheck.cpp): the kernel twins, one chapter per
# technique, and the seeded defects (tests/bugs/memcheck_*.cpp), each in 01.
MEMCHECK_TESTS := test_kernels test_flash test_fp8 test_moe test_attention_merge
MEMCHECK_BUGS := 01_single_gpu+memcheck_short_index 01_single_gpu+memcheck_misaligned_tile \
                 01_single_gpu+memcheck_shared_overrun 01_single_gpu+memcheck_device_overrun \
                 01_single_gpu+memcheck_extra_partial
MEMCHECK_BIN := $(patsubst %,$(MEMCHECK)/tests/%,$(MEMCHECK_TESTS)) $(patsubst %,$(MEMCHECK)/tests/bugs/%,$(MEMCHECK_BUGS)) \
                $(patsubst %.cu,$(MEMCHECK)/%,$(TECH_SRC))
$(MEMCHECK)/%.o: %.cu $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(CU) $(MEMCHECK_FLAGS) $(CPPFLAGS) -MMD -MP -c $< -o $@
$(MEMCHECK)/tests/bugs/%.o: tests/bugs/%.cpp $(CPU_STAMP)
	@mkdir -p $(dir $@)
	$(TESTCXX) $(MEMCHECK_FLAGS) $(CPPFLAGS) -MMD -MP -c $< -o $@
$(MEMCHECK)/common.a: $(MEMCHECK_OBJ) $(filter-out $(patsubst %.cu,$(BUILD)/%.o,$(MEMCHECK_SRC)),$(COMMON_OBJ))
	rm -f $@ && ar rcs $@ $^
$(MEMCHECK)/tests/test_%: $(BUILD)/tests/test_%.o $(BUILD)/tests/catch_main.o $(MEMCHECK)/common.a
	@mkdir -p $(dir $@)
	$(LD) $^ -o $@ $(LIBS)
$(MEMCHECK)/0%: $(BUILD)/0%.o $$(call beside_obj,$$(call chapter_of,0$$*)) $(MEMCHECK)/common.a
	@mkdir -p $(dir $@)
	$(LD) $^ -o $@ $(LIBS)
define memcheck_bug
$(MEMCHECK)/tests/bugs/$(1)+$(2): $(BUILD)/$(1).o $(call beside_obj,$(call chapter_of,$(1))) $(MEMCHECK)/tests/bugs/$(2).o $(MEMCHECK)/common.a
	$$(LD) $$(call wrap_flags,tests/bugs/$(2).cpp) $$^ -o $$@ $$(LIBS)
endef
ifeq ($(CUDA),emu)
$(foreach v,$(MEMCHECK_BUGS),$(eval $(call memcheck_bug,$(firstword $(subst +, ,$(v))),$(lastword $(subst +, ,$(v))))))
$(BUILD)/tests/test_emu_memcheck: | $(MEMCHECK_BIN)
ifeq ($(SANITIZE),memory)
all: $(MEMCHECK_BIN)
endif
endif

$(BUILD)/fuzz/common/%.o: common/%.cu
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) -fsanitize=fuzzer-no-link -x c++ -MMD -MP -c $< -o $@

$(BUILD)/fuzz/fuzz_%: fuzz/fuzz_%.cpp fuzz/fuzz_util.h $(FUZZ_OBJ)
	$(FUZZ_CXX) -fsanitize=fuzzer $< $(FUZZ_OBJ) -o $@ $(MPI_LIB) -lopenblas -lgomp -lpthread

# Each target for FUZZ_SECONDS from its seed corpus (fuzz/corpus/NAME, copied: new inputs stay in
# the build); a crash or a hang (10 s on one input) stops it with the input saved under the build.
fuzz: deps
	@$(MAKE) --no-print-directory $(FUZZ_BIN)
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh

# Whether this build sees a GPU, decided as the binaries decide it (the driver and the GPU check ask it).
$(BUILD)/tests/gpu_probe: $(BUILD)/tests/gpu_probe.o $(BUILD)/common.a
	$(LD) $^ -o $@ $(LIBS)

# Installs what a fresh Debian machine lacks (as root), or says the exact command (otherwise).
deps:
	@scripts/ensure-deps.sh

# The emulated GPU's ThreadSanitizer build that tests/test_emu_races.cpp drives (build-tsan/, only
# where make test runs on the emulated GPU): the kernel tests, every chapter and the seeded races.
TSAN_BUILD := build-tsan
TSAN_BIN := $(patsubst %,$(TSAN_BUILD)/%,tests/test_kernels $(basename $(TECH_SRC)) $(addprefix tests/bugs/,$(EMU_RACE_BUGS)))

test: deps
	@$(MAKE) --no-print-directory -j$(JOBS) CUDA=$(CUDA) BUILD=$(BUILD) all $(TEST_BIN) $(BUG_BIN) $(BUILD)/tests/comm_error_prog $(BUILD)/tests/gpu_probe $(FUZZ_BIN) $(if $(filter emu,$(CUDA)),$(MEMCHECK_BIN))
	$(if $(filter emu,$(CUDA)),@$(MAKE) --no-print-directory -j$(JOBS) CUDA=emu SANITIZE=thread BUILD=$(TSAN_BUILD) $(TSAN_BIN))
	@BUILD=$(BUILD) CUDA=$(CUDA) TS_TSAN_BUILD=$(TSAN_BUILD) tests/run_tests.sh

NP ?= 1
# The demo builds what it runs and no more: 01 and the objects it links, on every core, and the
# CUDA backend only when a GPU is visible. Without one the demo runs on the CPU, so a CPU-only 01
# is all it needs (nvcc's device passes would be most of the build); it goes into a directory of
# its own, so that it never mixes with the CUDA objects of $(BUILD).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
DEMO_CUDA = $(if $(GPU_VISIBLE),$(CUDA),0)
DEMO_BUILD = $(if $(filter $(CUDA),$(DEMO_CUDA)),$(BUILD),$(BUILD)/demo-cpu)
demo: deps
	@$(MAKE) --no-print-directory -j$(JOBS) CUDA=$(DEMO_CUDA) BUILD=$(DEMO_BUILD) $(DEMO_BUILD)/01_single_gpu
	$(DEMO_BUILD)/01_single_gpu --preset tiny --seq 64 --batch 16 --steps 3000 --warmup-steps 50 --min-lr 3e-4 --log-json $(BUILD)/demo.jsonl
	/usr/bin/python3 scripts/plot.py $(BUILD)/demo.jsonl -o $(BUILD)/demo.png --labels "01 tiny (seq 64)"

bench: deps
	@$(MAKE) --no-print-directory all
	@BUILD=$(BUILD) scripts/bench.sh

# The device code compiled for sm_90 alone, with the flags of a CUDA=1 build; nothing is kept.
ptxas:
	@test -n "$(NVCC)" || { echo "make ptxas: nvcc not found" >&2; exit 1; }
	@/usr/bin/python3 scripts/ptxas_table.py --nvcc $(NVCC) \
	  --cflags "-Icommon $(MPI_INC) -DTS_CUDA -I$(CUDA_HOME)/include --expt-relaxed-constexpr" $(DEVICE_SRC)

clean:
	rm -rf build build-cpu build-emu $(TSAN_BUILD) $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
