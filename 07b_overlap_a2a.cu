// 07b_overlap_a2a.cu — the expert all-to-all hidden under the other micro-batch's compute, read
// after 07_expert_parallel.cu: what it adds to chapter 07 is `--overlap-a2a`, a schedule of the
// step's micro-batches registered with the chapter's schedules (ep::add_schedule).
//
// Why: 07 runs a MoE layer's dispatch and combine on the critical path: every rank waits while the
// rows travel. DeepSeek-V3's DualPipe (technical report §3.2.1) and Megatron-LM's MoE communication
// overlap (--overlap-moe-expert-parallel-comm) pair two micro-batches and run one's all-to-all while
// the other computes. Here two micro-batches A and B run as two coroutines on this thread, and each
// all-to-all hands over to the other at its post. One MoE layer, turn by turn:
//
//   A  attn, router, post dispatch(A) |                               | wait dispatch(A), experts(A),
//   B                                 | attn, router, post dispatch(B) |   post combine(A) ...
//
//   ... | wait dispatch(B), experts(B), post combine(B) | wait combine(A), sum, next layer's attn ...
//
// so dispatch(A) travels under B's attention and router, dispatch(B) under A's experts, combine(A)
// under B's experts, combine(B) under A's next layer's attention; backward mirrors it (each
// exchange of 07's experts_backward hands over the same way). notes/07_expert_parallel.md draws
// the schedule as a table and measures the exposed all-to-all before/after.
//
// The arithmetic is 07's, unchanged: only when each rank's host waits moves. Each parameter's
// gradient still gets A's contribution before B's (A leads B layer by layer, forward and backward),
// and 07's reducers launch only after the pair's last micro-batch has finished a unit (resume).
//
// Progress. On the CPU a dispatch is MPI_Ialltoallv (Comm::all_to_all_v_async), and MPICH moves a
// message only inside MPI calls (no progress thread unless MPIR_CVAR_ASYNC_PROGRESS=1): the other
// micro-batch's dense GEMMs (PollingGemms) each start with an MPI_Test of what is in flight (poll),
// as 04a's GEMM slices do, and so does each micro-batch's compute after an all-to-all it waited
// for. On CUDA the all-to-all is NCCL's grouped send/recv on the ep group's communication stream,
// after an event on the compute stream; wait makes the compute stream wait for it: the GPU overlaps
// the two streams by itself while the host queues the other micro-batch's kernels.
//
//   mpirun -np 4 ./build/07_expert_parallel --dp 4 --ep 4 --experts 8 --top-k 2 --micro-batch 1 --overlap-a2a
#ifndef TS_07B_OVERLAP_A2A_CU
#define TS_07B_OVERLAP_A2A_CU
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <memory>

#include "07_expert_parallel.cu"
#include "model/linear_gemms.h"
#include "training/memory_timeline.h"
#include "training/step_time.h"

namespace ep {
using namespace ts;

// ----- two micro-batches as coroutines ---------------------------------------------------------

// Micro-batches as coroutines (ucontext) on this thread, each on a stack of its own: one runs until
// it hands over (pass_on), then the next one still running, round robin. One OS thread, so MPI,
// CUDA's current device and the emulated GPU see the one caller they always see.
class Interleave {
 public:
  // Runs one(i) for i in [first, first + k) as coroutines, resume(i) before each turn of i.
  void run(int first, int k, const std::function<void(int)>& resume, const std::function<void(int)>& one) {
    std::vector<Fiber> f(static_cast<size_t>(k));
    Interleave* outer = active_;
    active_ = this;
    for (int j = 0; j < k; j++) start(f[size_t(j)], first + j, one);
    for (int live = k; live > 0;)
      for (Fiber& x : f) {
        if (x.done) continue;
        resume(x.index);
        running_ = &x;
        memory_phase_resume(x.phase);  // --memory-timeline: the allocations are this one's
        swapcontext(&main_, &x.ctx);
        x.phase = memory_phase_now();
        if (x.done) live--;
      }
    running_ = nullptr;
    active_ = outer;
  }
  // From inside a micro-batch: the next one runs; returns when this one's turn comes again. Outside
  // an interleave (one micro-batch at a time), returns at once.
  static void pass_on() {
    if (active_ && active_->running_) swapcontext(&active_->running_->ctx, &active_->main_);
  }

 private:
  // A stack for each coroutine, with a guard page below it: an overflow faults instead of writing
  // over the heap. The model's host code (OpenBLAS's calls, the emulated GPU's launches) runs on it.
  static constexpr size_t kStackBytes = size_t(32) << 20;
  struct Fiber {
    ucontext_t ctx{};
    void* stack = nullptr;
    int index = 0;
    bool done = false;
    int phase = memory_phase_now();
    const std::function<void(int)>* body = nullptr;
    ~Fiber() {
      if (stack) munmap(stack, kStackBytes);
    }
  };
  void start(Fiber& x, int index, const std::function<void(int)>& one) {
    x.index = index;
    x.body = &one;
    x.stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TS_CHECK(x.stack != MAP_FAILED, "--overlap-a2a: no memory for a micro-batch's stack");
    mprotect(x.stack, size_t(sysconf(_SC_PAGESIZE)), PROT_NONE);
    getcontext(&x.ctx);
    x.ctx.uc_stack.ss_sp = x.stack;
    x.ctx.uc_stack.ss_size = kStackBytes;
    x.ctx.uc_link = &main_;  // where a finished micro-batch returns
    makecontext(&x.ctx, &Interleave::entry, 0);
  }
  static void entry() {
    Fiber& x = *active_->running_;
    (*x.body)(x.index);
    x.done = true;
  }
  ucontext_t main_{};
  Fiber* running_ = nullptr;
  static inline Interleave* active_ = nullptr;
};

// A step's n micro-batches in pairs (0, 1), (2, 3), ...: n is even (validate_overlap).
inline void run_pairs(int n, const std::function<void(int)>& resume, const std::function<void(int)>& one) {
  Interleave pairs;
  for (int i = 0; i < n; i += 2) pairs.run(i, 2, resume, one);
}

// ----- the MoE block whose all-to-alls hand over ----------------------------------------------------

// 07's flat block; each exchange (dispatch and combine, forward and backward) posted, handed over
// to the other micro-batch, then waited for.
class OverlappedMoe : public ExpertParallelMoe {
 public:
  using ExpertParallelMoe::ExpertParallelMoe;

  // One MPI_Test (or event query) of each all-to-all in flight: MPICH's progress (the header).
  void poll() {
    for (InFlight* t : in_flight_) t->poll();
  }

 protected:
  // One all-to-all in flight: its span from post to completion goes on the trace's second
  // communication lane ("ep all_to_all_v in flight (...)"), the host's wait for it on the first.
  struct InFlight {
    Work work;
    std::string name;
    double posted = 0;
    bool active = true;
    void poll() {
      if (active && work.done()) end();
    }
    void end() {
      active = false;
      Trace& t = Trace::get();
      if (t.enabled()) t.add(name + " in flight", Lane::Comm2, posted, t.now_us() - posted);
    }
  };
  void exchange(Comm& c, const Tensor& out, const std::vector<int64_t>& out_rows, const Tensor& in,
                const std::vector<int64_t>& in_rows, const char* what) override {
    const int64_t D = in.size(1);
    InFlight t{c.all_to_all_v_async(out, elems(out_rows, D), in, elems(in_rows, D)),
               c.name() + " all_to_all_v (" + what + ")", Trace::get().now_us()};
    in_flight_.push_back(&t);
    Interleave::pass_on();  // the other micro-batch computes while the rows travel
    complete(t, what);
    in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), &t));
    poll();  // the other micro-batch's, before this one computes on what arrived
  }
  // The rows the caller reads next are there after this (tests/bugs/early_combine_read.cpp reads a
  // combine's before). The host's wait is the exposed all-to-all: "ep wait (...)" on the trace.
  static void complete(InFlight& t, const char* what) {
    if (!t.active) return;  // a poll saw it complete
    {
      TraceScope s(std::string("ep wait (") + what + ")", Lane::Comm);
      t.work.wait();
    }
    t.end();
  }

 private:
  std::vector<InFlight*> in_flight_;  // both micro-batches' all-to-alls in flight (on their stacks)
};

// The model's dense GEMMs, each after a poll of the all-to-alls in flight: the other micro-batch's
// attention and shared experts give MPICH its progress.
class PollingGemms : public LinearGemms {
 public:
  PollingGemms(std::unique_ptr<LinearGemms> inner, OverlappedMoe& moe) : inner_(std::move(inner)), moe_(moe) {}
  void forward(int e, const Tensor& y, const Tensor& x, const Tensor& W) override {
    moe_.poll();
    inner_->forward(e, y, x, W);
  }
  void input_grad(int e, const Tensor& dx, const Tensor& dy, const Tensor& W, bool accumulate) override {
    moe_.poll();
    inner_->input_grad(e, dx, dy, W, accumulate);
  }
  void weight_grad(int e, const Tensor& dW, const Tensor& dy, const Tensor& x) override {
    moe_.poll();
    inner_->weight_grad(e, dW, dy, x);
  }
  void end_step(long step) override { inner_->end_step(step); }

 private:
  std::unique_ptr<LinearGemms> inner_;
  OverlappedMoe& moe_;
};

// Installs `b` (OverlappedMoe or a subclass) as the model's MoE block, the dense GEMMs polling it.
inline ExpertParallelMoe& install_overlapped(Model& m, OverlappedMoe* b) {
  install(m, b);
  m.gemms = std::make_unique<PollingGemms>(std::move(m.gemms), *b);
  return *b;
}

// Refused on every rank alike (each checks the same flags), one line each.
inline void validate_overlap(const RunConfig& rc, const MeshConfig& mc, const Dispatch& d) {
  if (mc.ep < 2)
    config_error("--overlap-a2a needs --ep > 1: it hides the expert all-to-all, which --ep %d does not run", mc.ep);
  if (d.name != "flat")
    config_error("--overlap-a2a overlaps the flat dispatch's all-to-all (got --dispatch %s)", d.name.c_str());
  const int n = mc.dp > 0 && rc.micro_batch > 0 ? rc.batch / mc.dp / rc.micro_batch : 0;
  if (mc.pp == 1 && (n % 2 || n == 0))  // under a pipeline (08) its schedule pairs them
    config_error("--overlap-a2a pairs micro-batches: each rank's %d (--batch %d / --dp %d / --micro-batch %d) "
                 "must be even", n, rc.batch, mc.dp, rc.micro_batch);
}

// ----- the step time it predicts (make bench's row) -----------------------------------------------
// The MoE term's all-to-all (t_ep, lab/07_expert_parallel.h) runs beside the other micro-batch's
// compute: what shows is what outlasts it, max(compute, comm) for the pair = compute +
// max(0, t_ep − t_compute). Assumes the transfer and the compute each at its own full rate side by
// side (on a GPU NCCL takes a few SMs, lab/08_frontier.h prices DeepSeek-V3's 20 of 132; on the
// CPU MPI's copies take the cores the GEMMs run on) and the first dispatch and last combine of a
// pair hidden too (the other micro-batch's attention and next layer beside them).
inline void hide_all_to_all(StepTerms& s) {
  const double exposed = std::max(0.0, s.t_ep - s.t_compute);
  s.hidden_ep = s.t_ep - exposed;
  s.t_ep = exposed;
  s.total();
}

inline const bool kOverlapA2aRegistered = add_schedule({
    "--overlap-a2a",
    "hide the expert all-to-all: micro-batches in pairs, one's dispatch/combine in flight while the other computes "
    "(07b_overlap_a2a.cu)",
    validate_overlap,
    [](Model& m, Comm& group, const std::vector<int>& nodes) -> ExpertParallelMoe& {
      return install_overlapped(m, new OverlappedMoe(m, group, nodes));
    },
    run_pairs,
    hide_all_to_all,
    2,  // a pair's activations at once, priced at the turn of their peak (lab/07's schedule_activations)
});

}  // namespace ep
#endif  // TS_07B_OVERLAP_A2A_CU
