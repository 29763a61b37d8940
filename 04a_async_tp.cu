// 04a_async_tp.cu — asynchronous tensor parallelism, read after 04_tensor_parallel.cu.
//
// What it adds to chapter 04: under --sequence-parallel, f's all-gather before the column-parallel
// GEMMs and g's reduce-scatter after the row-parallel GEMM leave the critical path. Each is cut
// into the tp steps of a ring, and each step's send/receive runs while the GEMM works on the shard
// already in hand: the "collective matmul" of Wang et al. (ASPLOS 2023, "Overlap communication
// with dependent computation via decomposition in large deep learning models"), what torchtitan
// calls async TP (torch's fused_all_gather_matmul / fused_matmul_reduce_scatter) and Megatron-LM
// its TP communication overlap (--tp-comm-overlap, Transformer Engine's userbuffers).
//
//   all-gather + GEMM (f, forward; q/k/v and gate/up): rank r holds x_r, the rows of its tokens.
//     At step s it holds x_j, j = r − s (mod tp): it posts x_j to r+1 and x_{j−1} from r−1, and
//     meanwhile computes y_j = x_j·Wᵀ, its rows of the output. After tp steps every y_j is done,
//     and f's output (the gathered x, which k, v and up then read whole) is complete.
//   GEMM + reduce-scatter (g, forward; o_proj and down_proj): the partial sum for token block b
//     starts at rank b+1 and travels the ring, each rank adding its own partial x_b·W_rᵀ, and
//     arrives complete at rank b after tp − 1 hops. Rank r at step s computes its partial for
//     block b = r − 1 − s (while the accumulator of step s − 1 travels), adds the one that arrived,
//     and sends the sum on.
//
// The all-gather side reproduces 04 bit for bit: y_j's elements are the same sums over the same
// inner dimension as the whole GEMM's rows j (a GEMM's per-element sum does not depend on how many
// rows it is given: common/kernels/kernels_cpu.cu's panels rest on the same property), and the
// gathered x is a copy. The reduce-scatter side adds the tp partials in ring order, not in the
// collective's: equal to 04 by the fp32 criterion. tests/test_async_tp.cpp checks both.
//
// Progress. On the CPU the transfers are MPI_Isend/MPI_Irecv (Comm::send_recv_async), and
// MPICH moves a rendezvous-sized message only inside MPI calls (no progress thread unless
// MPIR_CVAR_ASYNC_PROGRESS=1): so the GEMM on the shard in hand runs in row slices with an
// MPI_Test (Work::done) between them. On CUDA the send/recv are NCCL calls on the tp group's
// communication stream, ordered after the GEMM that produced the shard by an event, and the
// compute stream waits for them by another (Work::wait): the GPU overlaps them by itself.
//
// How it plugs in: 04's variant registry (tp::add_variant), a flag and an install. It installs
// AsyncTensorParallel as the model's f and g, and wraps the model's LinearGemms so the dense
// linears' GEMMs come through it: the first GEMM on f's output runs the gather ring, a row-parallel
// GEMM is held until g asks for its output and runs inside the reduce-scatter ring. Backward keeps
// 04's collectives. notes/04_tensor_parallel.md measures the exposed communication before/after.
//   mpirun -np 2 ./build/04_tensor_parallel --tp 2 --sequence-parallel --async-tp --trace t.json
#ifndef TS_04A_ASYNC_TP_CU
#define TS_04A_ASYNC_TP_CU
#include <algorithm>

#include "04_tensor_parallel.cu"
#include "kernels/elementwise.h"
#include "model/linear_gemms.h"
#include "lab/04_tensor_parallel.h"  // predict_step_time: 04's step, which async TP's prediction starts from

namespace tp {

// One ring transfer in flight, and the span the trace shows for it on the second communication
// lane, beside the GEMMs it overlaps; the time the host then blocks for it is "tp wait" on the
// first, where 04's blocking collectives are: the exposed communication.
struct RingTransfer {
  Work work;
  std::string name;
  double posted = 0;
  bool active = false;
  void poll() {
    if (active && work.done()) end();
  }
  void wait() {
    if (!active) return;
    {
      TraceScope s("tp wait (" + name + ")", Lane::Comm);
      work.wait();
    }
    end();
  }
  void end() {
    active = false;
    Trace& t = Trace::get();
    if (t.enabled()) t.add(name, Lane::Comm2, posted, t.now_us() - posted);
  }
};

class AsyncTensorParallel : public TensorParallel {
 public:
  AsyncTensorParallel(Comm& group, const ParamTable& table) : TensorParallel(group, true), tp_(group), table_(table) {}

  // f before the dense linears: a buffer for the gathered rows holding only this rank's; the first
  // GEMM on it (forward below) fills the rest, ring step by ring step.
  Tensor f_forward_into_linears(const Tensor& x) override {
    finish();
    const int64_t n = x.size(0);
    Tensor full = Tensor::empty({n * tp_.size(), x.size(1)}, x.dtype, x.device(), Tag::Workspace);
    copy(full.rows(tp_.rank() * n, n), x);
    gathering_ = full;
    return full;
  }
  // g after a row-parallel GEMM that forward held back: the GEMM and the reduce-scatter as one ring.
  Tensor g_forward(const Tensor& y, Tag tag) override {
    if (held_.y.defined() && held_.y.raw() == y.raw()) return matmul_reduce_scatter(tag);
    finish();
    return TensorParallel::g_forward(y, tag);
  }
  Tensor f_forward(const Tensor& x) override { return finish(), TensorParallel::f_forward(x); }
  Tensor f_backward(const Tensor& dx) override { return finish(), TensorParallel::f_backward(dx); }
  Tensor g_backward(const Tensor& dy) override { return finish(), TensorParallel::g_backward(dy); }

  // A dense linear's forward GEMM, from AsyncTpGemms: true when this class took it (the gather
  // ring's first GEMM, or a row-parallel GEMM held for g).
  bool forward(LinearGemms& gemms, int e, const Tensor& y, const Tensor& x, const Tensor& W) {
    finish_held();
    if (gathering_.defined() && x.raw() == gathering_.raw()) {
      matmul_all_gather(gemms, e, y, W);
      return true;
    }
    finish();
    const ParamEntry& p = table_.entries[size_t(e)];
    if (p.split != Split::Cols || p.parts == 1) return false;
    held_ = {&gemms, e, y, x, W};
    return true;
  }
  // Anything still pending runs now, blocking (nothing in the model reaches here; a safety net).
  void finish() {
    finish_held();
    if (gathering_.defined()) {
      Tensor full = gathering_;
      gathering_ = Tensor();
      const int64_t n = full.size(0) / tp_.size();
      tp_.all_gather(full, full.rows(tp_.rank() * n, n));
    }
  }

 protected:
  // Reduce-scatter ring step s of T, this rank's partial for the step's block in `part`: add the
  // accumulator arriving from the left (`ring`, posted by step s − 1, into `in`), then, but at the
  // last step, pass the sum on to the right and take the next block's into `in`.
  // (tests/bugs/early_ring_send.cpp sends before the add.)
  virtual void accumulate_and_pass(const Tensor& part, const Tensor& in, RingTransfer& ring, int s, int T) {
    if (s > 0) {
      ring.wait();  // (done already if a poll saw it complete)
      add_inplace(part, in);
    }
    if (s + 1 < T) post(ring, "reduce_scatter ring (g)", part, in);
  }
  void post(RingTransfer& t, const char* name, const Tensor& send, const Tensor& recv) {
    const int T = tp_.size(), r = tp_.rank();
    t.name = name;
    t.posted = Trace::get().enabled() ? Trace::get().now_us() : 0;
    t.work = tp_.send_recv_async(send, (r + 1) % T, recv, (r + T - 1) % T, kRingTag);
    t.active = true;
  }

 private:
  struct Held {
    LinearGemms* gemms = nullptr;
    int entry = -1;
    Tensor y, x, W;
  };
  static constexpr int kRingTag = 404;
  // Rows of a slice of the GEMM between two MPI_Tests: small enough to poll a few times per step,
  // large enough to stay one efficient GEMM.
  static constexpr int64_t kSliceRows = 64;

  // The GEMM on the shard in hand, in row slices, testing the transfer in flight between them.
  void gemm_polling(LinearGemms& g, int e, const Tensor& y, const Tensor& x, const Tensor& W, RingTransfer& t) {
    const int64_t n = x.size(0);
    for (int64_t r0 = 0; r0 < n; r0 += kSliceRows) {
      const int64_t m = std::min(kSliceRows, n - r0);
      {
        TraceScope s("async tp gemm", Lane::Compute);
        g.forward(e, y.rows(r0, m), x.rows(r0, m), W);
      }
      t.poll();
    }
  }
  // all-gather + GEMM: y's rows j from x_j while x_{j−1} arrives (the file's header).
  void matmul_all_gather(LinearGemms& g, int e, const Tensor& y, const Tensor& W) {
    Tensor full = gathering_;
    gathering_ = Tensor();
    const int T = tp_.size(), r = tp_.rank();
    const int64_t n = full.size(0) / T;
    RingTransfer ring;
    for (int s = 0; s < T; s++) {
      const int j = (r - s + T) % T, next = (r - s - 1 + T) % T;
      if (s + 1 < T) post(ring, "all_gather ring (f)", full.rows(j * n, n), full.rows(next * n, n));
      gemm_polling(g, e, y.rows(j * n, n), full.rows(j * n, n), W, ring);
      ring.wait();
    }
  }
  // GEMM + reduce-scatter: block b = r − 1 − s's partial while step s − 1's sum travels.
  Tensor matmul_reduce_scatter(Tag tag) {
    Held h = held_;
    held_ = Held();
    const int T = tp_.size(), r = tp_.rank();
    const int64_t n = h.y.size(0) / T, D = h.y.size(1);
    Tensor out = Tensor::empty({n, D}, h.y.dtype, h.y.device(), tag);
    Tensor acc[2] = {Tensor::empty({n, D}, h.y.dtype, h.y.device(), Tag::Workspace),
                     Tensor::empty({n, D}, h.y.dtype, h.y.device(), Tag::Workspace)};
    Tensor in = Tensor::empty({n, D}, h.y.dtype, h.y.device(), Tag::Workspace);
    RingTransfer ring;
    for (int s = 0; s < T; s++) {
      const int b = (r - 1 - s + 2 * T) % T;
      const Tensor& part = s + 1 == T ? out : acc[s % 2];  // the buffer in flight is the other one
      gemm_polling(*h.gemms, h.entry, part, h.x.rows(b * n, n), h.W, ring);
      accumulate_and_pass(part, in, ring, s, T);
    }
    return out;
  }
  void finish_held() {
    if (!held_.y.defined()) return;
    Held h = held_;
    held_ = Held();
    h.gemms->forward(h.entry, h.y, h.x, h.W);
  }

  Comm& tp_;
  const ParamTable& table_;
  Tensor gathering_;  // f's output whose other ranks' rows the next GEMM on it gathers
  Held held_;         // a row-parallel GEMM waiting for g
};

// The model's GEMMs, through AsyncTensorParallel first: the forward GEMMs it fuses with f and g;
// everything else (and backward) as the GEMMs it wraps.
class AsyncTpGemms : public LinearGemms {
 public:
  AsyncTpGemms(std::unique_ptr<LinearGemms> inner, AsyncTensorParallel& ops) : inner_(std::move(inner)), ops_(ops) {}
  void forward(int e, const Tensor& y, const Tensor& x, const Tensor& W) override {
    if (!ops_.forward(*inner_, e, y, x, W)) inner_->forward(e, y, x, W);
  }
  void input_grad(int e, const Tensor& dx, const Tensor& dy, const Tensor& W, bool accumulate) override {
    ops_.finish();
    inner_->input_grad(e, dx, dy, W, accumulate);
  }
  void weight_grad(int e, const Tensor& dW, const Tensor& dy, const Tensor& x) override {
    ops_.finish();
    inner_->weight_grad(e, dW, dy, x);
  }
  void end_step(long step) override { inner_->end_step(step); }

 private:
  std::unique_ptr<LinearGemms> inner_;
  AsyncTensorParallel& ops_;
};

// Installs `ops` (AsyncTensorParallel or a subclass) as the model's f and g, its GEMMs through them.
inline void install_async(Model& m, std::unique_ptr<AsyncTensorParallel> ops) {
  AsyncTensorParallel& o = *ops;
  m.tp = std::move(ops);
  m.gemms = std::make_unique<AsyncTpGemms>(std::move(m.gemms), o);
}

// ----- the step time it predicts (make bench's row) ---------------------------------------------------

// 04's prediction (lab/04_tensor_parallel.h) with the forward's f and g run as rings under the
// GEMMs. Per layer and micro-batch two all-gathers and two reduce-scatters of (T−1)/T·K bytes,
// each now T − 1 ring transfers (their latency T − 1 times): c seconds in all. They run beside the
// forward GEMMs of the linears they feed, g seconds (t_compute × those GEMMs' share of the step's
// FLOPs, 2·L·(2D² + 2·D·kv + 3·D·F) of 6N + 12·L·h·s per token). Each transfer hides behind a 1/T
// share of its GEMMs, the last share has none beside it: exposed max(0, c − g·(T−1)/T) replaces
// 04's forward f/g. Assumes a transfer and a GEMM each at its own full rate side by side (on a GPU
// NCCL takes a few SMs; on the CPU MPI's copies take the cores the GEMMs run on) and the GEMMs at
// the step's average efficiency.
// Per step, the bytes per rank of the forward's f (or g): two (T−1)/T·K per layer and micro-batch.
inline double forward_fg_bytes(const RunConfig& rc, int T) {
  const ModelConfig& m = rc.model;
  return double(rc.batch) / rc.micro_batch * m.layers * 2 * (T - 1.0) / T * double(rc.micro_batch) * m.seq * m.dim *
         dtype_size(rc.dtype);
}

// The comm report's prediction: those bytes go as the rings' sends (twice under full recompute,
// whose backward reruns the forward).
inline void async_comm(std::map<std::string, double>& c, const RunConfig& rc, int T) {
  const double b = forward_fg_bytes(rc, T) * (rc.recompute == Recompute::Full ? 2 : 1);
  c["all_gather"] -= b;
  c["reduce_scatter"] -= b;
  c["send"] += 2 * b;
}

inline StepTerms predict_async_step_time(const Gpu& g, const RunConfig& rc, int T) {
  StepTerms s = predict_step_time(g, rc, T, true);
  if (T == 1) return s;
  const ModelConfig& m = rc.model;
  const double mbs = double(rc.batch) / rc.micro_batch, L = m.layers, D = m.dim, kv = double(m.kv_heads) * m.head_dim();
  const double bytes = forward_fg_bytes(rc, T);
  const std::map<std::string, double> fwd = {{"all_gather", bytes}, {"reduce_scatter", bytes}};
  const double c04 = group_seconds(g.net, fwd, mbs * L * 4, 1), c = group_seconds(g.net, fwd, mbs * L * 4 * (T - 1), 1);
  const double gemm = s.t_compute * 2 * L * (2 * D * D + 2 * D * kv + 3 * D * m.ffn) / flops_per_token_of(m);
  s.t_tp += std::max(0.0, c - gemm * (T - 1) / T) - c04;
  s.total();
  return s;
}

inline std::function<StepTerms(const Gpu&)> async_step_time_model(const RunConfig& rc, int T) {
  return [&rc, T](const Gpu& g) { return predict_async_step_time(g, rc, T); };
}

inline void validate_async(const RunConfig& rc, int, bool sp) {
  if (!sp)
    config_error("--async-tp needs --sequence-parallel: it overlaps the all-gather and reduce-scatter that sequence "
                 "parallelism puts around the linears");
  if (rc.fp8.recipe != Fp8Recipe::Off)
    config_error("--async-tp with --dtype fp8 is not composed: FP8 replaces the model's GEMMs after tp installs its own");
}

inline const bool kAsyncTpRegistered = add_variant({
    "--async-tp",
    "with --sequence-parallel: overlap the all-gather/reduce-scatter ring steps with the GEMMs (04a_async_tp.cu)",
    validate_async,
    [](Model& m, Comm& group) {
      if (group.size() > 1) install_async(m, std::make_unique<AsyncTensorParallel>(group, m.table));
    },
    async_step_time_model,
    async_comm,
});

}  // namespace tp
#endif  // TS_04A_ASYNC_TP_CU
