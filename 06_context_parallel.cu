// 06_context_parallel.cu — context parallelism: every sequence is split across the --cp ranks.
//
// The playbook's context-parallel chapter, runnable. Each rank keeps 1/cp of every sequence's
// tokens, so every activation it stores is 1/cp of 01's; the weights are replicated and their
// gradients all-reduced over cp (02's bucketed reducer). Only attention mixes tokens, and it has
// two ways to see the whole sequence:
//   --cp-mode ring     ring attention (Liu et al. 2023): the K/V block of each rank travels round
//                      the ring while every rank computes its queries against the block it holds;
//                      the partial outputs are merged by the online-softmax rule on their
//                      log-sum-exp. Backward runs the ring again and carries dK/dV home.
//   --cp-mode ulysses  DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns the sequence
//                      shards of q/k/v into head shards of the full sequence, attention runs
//                      locally, and an all-to-all turns the output back.
// --zigzag 1 (default) cuts each sequence into 2·cp chunks and gives rank i chunks i and 2cp−1−i,
// so that every rank does the same causal work (the load balance of Megatron's and Llama 3's
// context parallelism); --zigzag 0 gives rank i the i-th contiguous block.
//
//   mpirun -np 4 ./build/06_context_parallel --cp 4 --seq 4096 --batch 1
//   mpirun -np 4 ./build/06_context_parallel --cp 4 --cp-mode ulysses --heads 8 --kv-heads 4
//   ./build/06_context_parallel --dry-run --preset 8b --cp 16 --seq 1048576 --batch 1 --dtype bf16
#ifndef TS_06_CONTEXT_PARALLEL_CU
#define TS_06_CONTEXT_PARALLEL_CU
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "02_data_parallel.cu"  // dp::GradReducer: the gradients are all-reduced over cp
#include "tensor/device.h"
#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "kernels/profile.h"
#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/attention_core.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/train.h"
#ifdef TS_CUDA
#include "kernels/kernels_cuda.h"  // the CUDA twins of attention_merge and swap_leading
#endif

namespace cp {
using namespace ts;

enum class Mode { Ring, Ulysses };
struct Options {
  Mode mode = Mode::Ring;
  bool zigzag = true;
};
inline const char* mode_name(Mode m) { return m == Mode::Ring ? "ring" : "ulysses"; }
// What the memory table's comm row holds (the buffers that travel, Tag::Comm).
inline std::string comm_holds(const Options& o, int C) {
  if (C == 1) return "";
  return o.mode == Mode::Ring ? "the ring's K/V blocks in flight and the dK/dV accumulators that travel home"
                              : "the all-to-all send and receive buffers";
}

// ----- which tokens a rank holds --------------------------------------------------------------------

// The absolute positions of rank r's tokens of a sequence of T. Zigzag: 2C chunks of T/(2C),
// rank r holds chunks r and 2C−1−r (an early one and a late one). Contiguous: block r of T/C.
inline std::vector<int32_t> positions(int T, int C, int r, bool zigzag) {
  std::vector<int32_t> p;
  auto chunk = [&](int i, int len) {
    for (int j = 0; j < len; j++) p.push_back(int32_t(i * len + j));
  };
  if (zigzag) {
    chunk(r, T / (2 * C));
    chunk(2 * C - 1 - r, T / (2 * C));
  } else {
    chunk(r, T / C);
  }
  return p;
}

inline Tensor device_ints(const std::vector<int32_t>& v, Device dev) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I32, dev, Tag::Workspace);
  std::vector<float> f(v.begin(), v.end());  // exact: positions and token ids are below 2^24
  from_host_f32(t, f.data());
  return t;
}

// This rank's tokens of each of the B sequences: full [B·T] -> [B·S], S = pos.size().
inline Tensor local_tokens(const Tensor& full, int B, int T, const std::vector<int32_t>& pos) {
  const std::vector<float> all = to_host_f32(full);
  std::vector<int32_t> mine;
  for (int b = 0; b < B; b++)
    for (int32_t p : pos) mine.push_back(int32_t(all[size_t(b) * T + p]));
  return device_ints(mine, full.device());
}

// The causal work of queries at qpos against keys at kpos: the (query, key) pairs with
// kpos[j] <= qpos[i], the score products attention forms per head and sequence.
inline double visible_pairs(const std::vector<int32_t>& qpos, std::vector<int32_t> kpos) {
  std::sort(kpos.begin(), kpos.end());
  double n = 0;
  for (int32_t q : qpos) n += double(std::upper_bound(kpos.begin(), kpos.end(), q) - kpos.begin());
  return n;
}

// Attention work a rank did: key blocks computed (ring: one per visible block; Ulysses: one) and
// score pairs (query, key) over every sequence and head it computed. Forward only.
struct AttentionWork {
  double blocks = 0, pairs = 0;
};

// ----- ring attention -------------------------------------------------------------------------------

// Tensors travelling round the ring: start() sends the held ones to rank r+1 and receives rank
// r−1's into spare buffers (async, so the caller computes meanwhile: Liu et al.'s overlap of
// communication with the blockwise computation); finish() waits and makes the received ones held.
class Rotation {
 public:
  Rotation(Comm& group, std::vector<Tensor> held, int tag0, std::string name)
      : c_(group), held_(std::move(held)), tag0_(tag0), name_(std::move(name)) {}
  const Tensor& operator[](size_t i) const { return held_[i]; }
  void start() {
    const int n = c_.size(), r = c_.rank();
    std::vector<Tensor>& spare = slots_[slot_];
    if (spare.empty())
      for (const Tensor& t : held_) spare.push_back(Tensor::empty(t.shape, t.dtype, t.device(), Tag::Comm));
    start_us_ = Trace::get().now_us();
    for (size_t i = 0; i < held_.size(); i++)
      work_.push_back(c_.send_recv_async(held_[i], (r + 1) % n, spare[i], (r + n - 1) % n, tag0_ + int(i)));
  }
  void finish() {
    for (Work& w : work_) w.wait();
    work_.clear();
    Trace::get().add(name_, Lane::Comm, start_us_, Trace::get().now_us() - start_us_);
    held_ = slots_[slot_];
    slot_ ^= 1;  // the block just sent is free again: the next one arrives there
  }

 private:
  Comm& c_;
  std::vector<Tensor> held_, slots_[2];
  int tag0_, slot_ = 0;
  std::string name_;
  std::vector<Work> work_;
  double start_us_ = 0;
};

// The merge of two partial attentions: the online-softmax rule (Milakov & Gimelshein 2018;
// flash attention's, across key blocks instead of tiles; the merge of ring attention, Liu et al.
// 2023). A block b gives each query row its softmax-weighted output o_b over b's keys and the log
// of its normaliser, lse_b = log Σ_{j in b} exp(s_j). Two blocks over disjoint keys combine exactly:
//   lse = log(exp(lse_a) + exp(lse_b)) = max + log(exp(lse_a − max) + exp(lse_b − max)),
//   o   = exp(lse_a − lse) · o_a + exp(lse_b − lse) · o_b,
// each weight being the share of the row's total softmax mass that the block holds; after every
// block, o is the attention over the keys so far and lse its normaliser (kept for backward).
// out [B, S, H, hd] (T) and lse [B, H, S] fp32 hold (o_a, lse_a) and are updated in place with
// part (T) and part_lse fp32 of the same shapes. A row with no visible key in a block has lse −inf
// and weight 0; a row with none in either stays lse −inf with out unchanged (never NaN).
// On the CPU one row (b, s, h) per iteration, the weights taken relative to the larger lse (so
// neither exp overflows); on a GPU the CUDA twin in common/kernels/kernels_cuda.cu.
template <class T>
void attention_merge_cpu(T* out, float* lse, const T* part, const float* plse, int64_t B, int64_t S, int64_t H,
                         int64_t hd) {
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * S * H; row++) {
    const int64_t b = row / (S * H), s = row / H % S, h = row % H, l = (b * H + h) * S + s;
    const float la = lse[l], lb = plse[l], m = std::max(la, lb);
    if (m == ninf) continue;  // no visible key in either part
    const float wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
    lse[l] = m + std::log(sum);
    const float ca = wa / sum, cb = wb / sum;
    T* o = out + row * hd;
    const T* p = part + row * hd;
    for (int64_t d = 0; d < hd; d++) o[d] = st<T>(ca * ld(o[d]) + cb * ld(p[d]));
  }
}

inline void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part, const Tensor& part_lse) {
  TS_PROFILE_OP("attention_merge", out);
  const char* op = "attention_merge";
  detail::check_float(op, "out", out);
  TS_CHECK(out.dim() == 4, "%s: out must be [B, S, H, hd], got %s", op, out.str().c_str());
  detail::check_like(op, "part", part, out, "out");
  detail::check_shape(op, "lse", lse, {out.size(0), out.size(2), out.size(1)});
  detail::check_dtype(op, "lse", lse, DType::F32);
  detail::check_like(op, "part_lse", part_lse, lse, "lse");
#ifdef TS_CUDA
  if (detail::common_device(op, {&out, &lse, &part, &part_lse}) == Device::CUDA)
    return cuda::attention_merge(out, lse, part, part_lse);
#endif
  detail::by_dtype(out.dtype, [&](auto t) {
    using T = decltype(t);
    attention_merge_cpu(out.data<T>(), lse.f32(), part.data<T>(), part_lse.f32(), out.size(0), out.size(1),
                        out.size(2), out.size(3));
  });
}

// Rank r's queries against every rank's keys, one K/V block per ring step: at step t it holds
// the block of rank r − t. Forward merges each block's (output, lse) into the running result
// (attention_merge above); a block the causal mask hides from all of r's queries is not
// computed, but still passed on. Only the kv_heads travel, never K/V expanded to the query heads.
class RingAttention : public AttentionCore {
 public:
  RingAttention(Comm& group, int T, bool zigzag, Device dev) : cp_(group) {
    const int C = group.size();
    for (int r = 0; r < C; r++) {
      hpos_.push_back(positions(T, C, r, zigzag));
      pos_.push_back(device_ints(hpos_.back(), dev));
    }
    for (int s = 0; s < C; s++) pairs_.push_back(visible_pairs(hpos_[group.rank()], hpos_[s]));
  }

  void forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor& pos) override {
    const int C = cp_.size(), r = cp_.rank();
    Rotation kv(cp_, {k, v}, 0, "cp ring K/V (forward)");
    Tensor part, part_lse;
    for (int t = 0; t < C; t++) {
      const int src = (r - t + C) % C;
      if (t > 0) kv.finish();
      if (t + 1 < C) kv.start();
      if (t == 0) {
        attention_forward(out, lse, q, k, v, pos, pos_[src]);  // the diagonal block: always visible
      } else if (pairs_[src] > 0) {
        if (!part.defined()) {
          part = Tensor::empty(out.shape, out.dtype, out.device(), Tag::Workspace);
          part_lse = Tensor::empty(lse.shape, DType::F32, lse.device(), Tag::Workspace);
        }
        attention_forward(part, part_lse, q, kv[0], kv[1], pos, pos_[src]);
        attention_merge(out, lse, part, part_lse);
      } else {
        continue;
      }
      work_.blocks += 1;
      work_.pairs += pairs_[src] * double(q.size(0) * q.size(2));
    }
  }

  // Each block's dq, dk, dv from the merged output and lse: P_ij = exp(s_ij − lse_i) is already
  // the global softmax, so the per-block gradients add up to the full ones. dq sums here; the
  // block's dK/dV accumulate on the ranks it visits (r+1, …, r−1) and travel with it, arriving
  // home after cp−1 hops, where the owner adds its own part (computed first, while K/V leave).
  void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos) override {
    const int C = cp_.size(), r = cp_.rank();
    Rotation kv(cp_, {k, v}, 0, "cp ring K/V (backward)");
    if (C > 1) kv.start();
    attention_backward(dq, dk, dv, dout, out, lse, q, k, v, pos, pos);
    if (C == 1) return;
    auto like = [](const Tensor& t, Tag tag) { return Tensor::empty(t.shape, t.dtype, t.device(), tag); };
    Tensor pdq = like(q, Tag::Workspace), pdk = like(k, Tag::Workspace), pdv = like(k, Tag::Workspace);
    Tensor acc_k = like(k, Tag::Comm), acc_v = like(k, Tag::Comm);
    ts::zero(acc_k);
    ts::zero(acc_v);
    Rotation acc(cp_, {acc_k, acc_v}, 2, "cp ring dK/dV");
    for (int t = 1; t < C; t++) {
      const int src = (r - t + C) % C;
      kv.finish();
      if (t + 1 < C) kv.start();
      const bool visible = pairs_[src] > 0;
      if (visible) {
        attention_backward(pdq, pdk, pdv, dout, out, lse, q, kv[0], kv[1], pos, pos_[src]);
        add_inplace(dq, pdq);
      }
      if (t > 1) acc.finish();  // block src's dK/dV so far, from rank r − 1
      if (visible) {
        add_inplace(acc[0], pdk);
        add_inplace(acc[1], pdv);
      }
      acc.start();
    }
    acc.finish();  // our own block's dK/dV from every other rank
    add_inplace(dk, acc[0]);
    add_inplace(dv, acc[1]);
  }

  const AttentionWork& work() const { return work_; }

 private:
  Comm& cp_;
  std::vector<std::vector<int32_t>> hpos_;  // every rank's token positions
  std::vector<Tensor> pos_;                 // the same on the device
  std::vector<double> pairs_;               // visible pairs of this rank's queries per key block
  AttentionWork work_;
};

// ----- Ulysses ---------------------------------------------------------------------------------------

// The packing around Ulysses' all-to-alls (sequence shards <-> head shards): dst = src with the two
// leading indices of [a, b, w] swapped, dst[j, i, :] = src[i, j, :], any dtype, w = numel / (a·b).
// On the CPU one memcpy per w-run; on a GPU the CUDA twin in common/kernels/kernels_cuda.cu.
inline void swap_leading(const Tensor& dst, const Tensor& src, int64_t a, int64_t b) {
  TS_PROFILE_OP("swap_leading", dst);
  const char* op = "swap_leading";
  detail::check_defined(op, "src", src);
  detail::check_numel(op, "dst", dst, src.numel(), src.dtype);
  TS_CHECK(a > 0 && b > 0 && src.numel() % (a * b) == 0, "%s: %s is not [%lld, %lld, w]", op, src.str().c_str(),
           (long long)a, (long long)b);
  TS_CHECK(!(dst.raw() == src.raw() && src.numel() > 0), "%s: dst and src must be separate", op);
#ifdef TS_CUDA
  if (detail::common_device(op, {&dst, &src}) == Device::CUDA) return cuda::swap_leading(dst, src, a, b);
#endif
  const size_t row = size_t(src.numel() / (a * b)) * dtype_size(src.dtype);
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
#pragma omp parallel for schedule(static)
  for (int64_t ij = 0; ij < a * b; ij++) {
    const int64_t i = ij / b, j = ij % b;
    std::memcpy(d + (j * a + i) * row, s + ij * row, row);
  }
}

// All-to-all from sequence shards to head shards and back. The full sequence is kept in rank
// order (rank 0's tokens, rank 1's, …): attention masks by position, so no reordering is needed.
// Forward: q, k, v in, the output back (four all-to-alls). The head-sharded q, k, v and lse are
// what the backward needs; they have exactly the sizes of the sequence-sharded ones, so they are
// kept in those buffers (the model reads q, k, v and lse only to hand them back to the core).
// Backward: dout and the output in, dq, dk, dv back (five).
class UlyssesAttention : public AttentionCore {
 public:
  UlyssesAttention(Comm& group, int T, bool zigzag, Device dev) : cp_(group) {
    std::vector<int32_t> all;
    for (int r = 0; r < group.size(); r++)
      for (int32_t p : positions(T, group.size(), r, zigzag)) all.push_back(p);
    pos_ = device_ints(all, dev);
    pairs_ = visible_pairs(all, all);
  }

  void forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor&) override {
    Tensor qh = to_heads(q, "q"), kh = to_heads(k, "k"), vh = to_heads(v, "v");
    Tensor oh = Tensor::empty(qh.shape, qh.dtype, qh.device(), Tag::Workspace);
    attention_forward(oh, head_lse(lse, qh), qh, kh, vh, pos_, pos_);
    to_sequence(out, oh, "out");
    copy(q, qh.reshape(q.shape));
    copy(k, kh.reshape(k.shape));
    copy(v, vh.reshape(v.shape));
    work_.blocks += 1;
    work_.pairs += pairs_ * double(qh.size(0) * qh.size(2));
  }

  void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&) override {
    const Tensor qh = q.reshape(head_shape(q)), kh = k.reshape(head_shape(k)), vh = v.reshape(head_shape(v));
    Tensor doh = to_heads(dout, "dout"), oh = to_heads(out, "out");
    auto work = [](const Tensor& t) { return Tensor::empty(t.shape, t.dtype, t.device(), Tag::Workspace); };
    Tensor dqh = work(qh), dkh = work(kh), dvh = work(kh);
    attention_backward(dqh, dkh, dvh, doh, oh, head_lse(lse, qh), qh, kh, vh, pos_, pos_);
    to_sequence(dq, dqh, "dq");
    to_sequence(dk, dkh, "dk");
    to_sequence(dv, dvh, "dv");
  }

  const AttentionWork& work() const { return work_; }

 private:
  // [B, S, X, hd] (sequence shard, all X heads) <-> [B, C·S, X/C, hd] (head shard, every token).
  std::vector<int64_t> head_shape(const Tensor& x) const {
    const int64_t C = cp_.size();
    return {x.size(0), x.size(1) * C, x.size(2) / C, x.size(3)};
  }
  // lse [B, H, S] holds the head-sharded [B, H/C, C·S]: the same number of rows.
  static Tensor head_lse(const Tensor& lse, const Tensor& qh) { return lse.reshape({qh.size(0), qh.size(2), qh.size(1)}); }

  // Chunk p of what this rank sends is head group p of its tokens; chunk p it receives is rank
  // p's tokens of this rank's head group.
  Tensor to_heads(const Tensor& x, const char* what) {
    TraceScope s(std::string("cp all_to_all (") + what + " to heads)", Lane::Comm);
    const int64_t C = cp_.size(), B = x.size(0), rows = x.size(0) * x.size(1);
    Tensor send = Tensor::empty({x.numel()}, x.dtype, x.device(), Tag::Comm);
    Tensor recv = Tensor::empty({x.numel()}, x.dtype, x.device(), Tag::Comm);
    swap_leading(send, x, rows, C);  // [B·S, C, w] -> [C, B·S, w]
    cp_.all_to_all(recv, send);
    Tensor y = Tensor::empty(head_shape(x), x.dtype, x.device(), Tag::Workspace);
    swap_leading(y, recv, C, B);  // [C, B, S·w] -> [B, C, S·w] = [B, C·S, X/C, hd]
    return y;
  }
  // The inverse: dst [B, S, X, hd] from y [B, C·S, X/C, hd].
  void to_sequence(const Tensor& dst, const Tensor& y, const char* what) {
    TraceScope s(std::string("cp all_to_all (") + what + " to sequence)", Lane::Comm);
    const int64_t C = cp_.size(), B = dst.size(0), rows = dst.size(0) * dst.size(1);
    Tensor send = Tensor::empty({y.numel()}, y.dtype, y.device(), Tag::Comm);
    Tensor recv = Tensor::empty({y.numel()}, y.dtype, y.device(), Tag::Comm);
    swap_leading(send, y, B, C);  // [B, C, S·w] -> [C, B, S·w]: chunk p = rank p's tokens
    cp_.all_to_all(recv, send);
    swap_leading(dst, recv, C, rows);  // [C, B·S, w] -> [B·S, C, w]
  }

  Comm& cp_;
  Tensor pos_;  // the positions of the full sequence in rank order
  double pairs_;
  AttentionWork work_;
};

// Installs the attention core; returns a view of its work counters.
inline std::function<AttentionWork()> install(Model& m, Comm& group, const Options& o) {
  if (o.mode == Mode::Ring) {
    auto core = std::make_unique<RingAttention>(group, m.cfg.seq, o.zigzag, m.dev);
    RingAttention* c = core.get();
    m.attention = std::move(core);
    return [c] { return c->work(); };
  }
  auto core = std::make_unique<UlyssesAttention>(group, m.cfg.seq, o.zigzag, m.dev);
  UlyssesAttention* c = core.get();
  m.attention = std::move(core);
  return [c] { return c->work(); };
}

// This rank's tokens of every sequence, on the device: inputs, targets (global sequences [s0,
// s0 + n) of the step, as every technique reads them) and their positions.
struct LocalBatch {
  Tensor inputs, targets;
};
inline LocalBatch local_batch(const MicroBatch& b, int n, int T, const std::vector<int32_t>& pos) {
  return {local_tokens(b.inputs, n, T, pos), local_tokens(b.targets, n, T, pos)};
}

// ----- checks ----------------------------------------------------------------------------------------

inline void validate(const RunConfig& rc, int C, const Options& o) {
  const ModelConfig& m = rc.model;
  if (C < 1) config_error("--cp must be >= 1 (got %d)", C);
  if (o.zigzag && m.seq % (2 * C))
    config_error("--seq %d is not divisible by 2·cp = %d (zigzag cuts each sequence into 2·cp chunks; --zigzag 0 needs only a multiple of cp)",
                 m.seq, 2 * C);
  if (!o.zigzag && m.seq % C) config_error("--seq %d is not divisible by --cp %d", m.seq, C);
  if (o.mode == Mode::Ulysses && m.heads % C)
    config_error("--cp-mode ulysses: --heads %d is not divisible by --cp %d (the all-to-all shards heads)", m.heads, C);
  if (o.mode == Mode::Ulysses && m.kv_heads % C)
    config_error("--cp-mode ulysses: --kv-heads %d is not divisible by --cp %d (the all-to-all shards kv heads)",
                 m.kv_heads, C);
}

// ----- the playbook's formula: memory per rank (notes/06 derives it) --------------------------------

// The model at this rank's share of each sequence: what one rank stores per micro-batch.
inline ModelConfig local_model(const ModelConfig& m, int C) {
  ModelConfig l = m;
  l.seq = m.seq / C;
  return l;
}

// Weights, gradients and optimizer states whole (replicated over cp); activations of T/cp tokens
// per sequence: every saved tensor is per token (attention saves only lse), so exactly 1/cp.
inline MemoryPrediction predict_memory(const RunConfig& rc, int C) {
  MemoryPrediction p = predict_states(param_count(rc.model), param_count(rc.model), rc.dtype, rc.master_weights);
  p.activations = predict_activations(local_model(rc.model, C), rc.micro_batch, rc.dtype, rc.recompute);
  return p;
}

// ----- the lab (lab/06_context_parallel.cu: the plan, the reports, the step time this run predicts) -----
void print_plan(RunLog& log, const RunConfig& rc, int C, const Options& o);
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, const Options& o,
                 const std::function<AttentionWork()>& work, long first);
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, int C, const Options& o, double bucket_mb);

}  // namespace cp

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 6
using namespace ts;

static const char* kDoc =
    "06_context_parallel: context parallelism, ring attention (zigzag-balanced) or Ulysses all-to-all.\n"
    "usage: mpirun -np C 06_context_parallel --cp C [--cp-mode ring|ulysses] [--zigzag 1|0] [flags]";

// Every cp rank reads the same sequences and keeps its tokens of each; the loss is the sum of
// every rank's token losses over the global token count, and the gradients are SUM-all-reduced
// over cp (each rank's are the gradient of its tokens' share of the mean loss).
static StepResult train_step(Model& model, AdamW& opt, dp::GradReducer& reducer, const TokenData& data,
                             const RunConfig& rc, Mesh& mesh, const std::vector<int32_t>& mine, const Tensor& pos,
                             long step) {
  const int T = rc.model.seq, mb = rc.micro_batch;
  ts::zero(model.grads);
  for (int s0 = 0; s0 < rc.batch; s0 += mb) {
    reducer.set_sync(s0 + mb == rc.batch);
    const cp::LocalBatch b = cp::local_batch(make_microbatch(data, step, rc.batch, T, s0, mb, model.dev), mb, T, mine);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T), pos);
  }
  reducer.finish();
  // The gradients are identical on every rank now: the norm needs no communication.
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  return {global_mean_loss(model.take_loss(), double(rc.batch) * T, {mesh.cp().mpi()}), norm};
}

// Replicas are identical: rank 0 writes the whole model.
static void save(const RunConfig& rc, Model& model, AdamW& opt, Mesh& mesh, const cp::Options& o, long step) {
  std::vector<CheckpointSlice> slices;
  if (mesh.rank == 0) slices.push_back({0, model.table.total, weights_f32(model.params, opt), &opt});
  Json m = Json::object();
  m["cp"] = mesh.cfg.cp;
  m["cp_mode"] = std::string(o.mode == cp::Mode::Ring ? "ring" : "ulysses");
  m["zigzag"] = o.zigzag;
  save_checkpoint(rc.save_dir, rc, model.table, slices, step, m);
}

// The chapter's flags: the degree, ring or Ulysses, the zigzag layout, the dp_cp bucket size.
struct CpFlags {
  cp::Options options;
  double bucket_mb = 25;
};
static CpFlags read_cp_flags(Args& args, MeshConfig& mc) {
  mc.cp = args.get_int("--cp", 1, "context-parallel degree (= number of ranks)", degree_range());
  const std::string mode = args.get_str("--cp-mode", "ring", "ring | ulysses");
  const int zigzag = args.get_int("--zigzag", 1, "1: rank i holds chunks i and 2cp-1-i of 2cp (balanced); 0: contiguous");
  const double bucket_mb = args.get_double("--bucket-mb", 25, "gradient all-reduce bucket size in MiB", dp::bucket_mb_range());
  if (mode != "ring" && mode != "ulysses") config_error("--cp-mode must be ring or ulysses (got '%s')", mode.c_str());
  if (zigzag != 0 && zigzag != 1) config_error("--zigzag must be 1 or 0 (got %d)", zigzag);
  // Ulysses trades the sequence split for a head split over the cp ranks: at cp 1 it is ring's
  // single rank under another name, and the run would report a technique it never used.
  if (mode == "ulysses" && mc.cp == 1) config_error("--cp-mode ulysses needs --cp 2 or more (got --cp 1)");
  return {{mode == "ring" ? cp::Mode::Ring : cp::Mode::Ulysses, zigzag == 1}, bucket_mb};
}

int main(int argc, char** argv) {
  CpFlags f;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { f = read_cp_flags(a, mc); });
  RunConfig& rc = run.rc;
  const int C = run.mc.cp;
  cp::validate(rc, C, f.options);
  if (!run.start([&] { cp::print_plan(run.log(), rc, C, f.options); }, [&] { return cp::predict_memory(rc, C); })) return 0;
  Model& model = run.build_model();
  const std::function<cp::AttentionWork()> work = cp::install(model, run.mesh.cp(), f.options);
  const std::vector<int32_t> mine = cp::positions(rc.model.seq, C, run.mesh.cp_rank, f.options.zigzag);
  const Tensor pos = cp::device_ints(mine, model.dev);
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  const long first = run.init(model, opt);  // every rank initialises (or loads) the same full weights
  dp::GradReducer reducer(model, run.mesh.dp_cp(), /*bucketed=*/true, f.bucket_mb);
  Loop loop;
  loop.step = [&](long step) { return train_step(model, opt, reducer, run.data, rc, run.mesh, mine, pos, step); };
  loop.save = [&](long step) { save(rc, model, opt, run.mesh, f.options, step); };
  cp::add_reports(loop, run.log(), rc, run.mesh, f.options, work, first);
  return run.train(loop, cp::step_time_model(rc, C, f.options, f.bucket_mb), "dp_cp");
}
#endif  // TS_PROGRAM == 6
#endif  // TS_06_CONTEXT_PARALLEL_CU
