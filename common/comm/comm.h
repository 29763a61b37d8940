// comm.h — process groups and their collectives (the playbook's "communication primitives").
//
// One Comm per process group. Every collective is issued non-blocking and completed by a wait
// loop with a deadline (the watchdog), so a collective that never matches ends the job with a
// message instead of hanging it. Transport per tensor device:
//   CPU tensors                          MPI, directly on the tensor's memory
//   CUDA tensors, every rank owns a GPU  NCCL on the group's communication stream
//   CUDA tensors, ranks share a GPU      MPI, staged through a host buffer (Tag::Comm)
// Every call is counted per op: calls, payload bytes and the bytes this rank puts on the wire
// under the ring algorithms of the playbook (see notes/collectives.md for the formulas).
#pragma once
#include <mpi.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensor/core.h"

#ifdef TS_CUDA
#include <nccl.h>
#if defined(TS_CUDA_EMU) && !defined(TS_EMU_NCCL)
#error "the emulated GPU's build found NVIDIA's nccl.h: common/emu/ must come first on the include path"
#endif
#endif

namespace ts {

enum class ReduceOp { Sum, Avg, Max };  // Avg = Sum, then x (1/N)

// Per group and op. payload_bytes: what the caller handed over (all_reduce K, reduce_scatter its
// full input, all_gather its full output, send/recv the message). wire_bytes: what this rank
// sends under the ring algorithm, e.g. all-reduce 2(N-1)/N K.
struct OpStats {
  long calls = 0;
  double payload_bytes = 0;
  double wire_bytes = 0;
};

// The wait handle of an async collective. Movable; wait() twice is fine; destroying a Work that
// was never waited waits (so tensors are never freed under an in-flight transfer).
class Work {
 public:
  struct Pending;  // transport-specific in-flight state (comm.cu)
  Work();
  explicit Work(std::unique_ptr<Pending> p);
  Work(Work&& o) noexcept;
  Work& operator=(Work&& o) noexcept;
  ~Work();
  // MPI: blocks under the watchdog's deadline. NCCL: makes the compute stream wait for the
  // transfer and returns at once: whatever is queued next runs after it, and the host waits only
  // when it reads a result (sync_compute_stream, watched by the same deadline).
  void wait();
  bool done();  // polls once; true (and finished) when complete

 private:
  std::unique_ptr<Pending> p_;
};

class Comm {
 public:
  // Takes ownership of `comm` (this group's ranks) and of `nccl` (its ncclComm_t, or null when
  // CUDA tensors go through MPI); both are freed with the Comm.
  Comm(std::string name, MPI_Comm comm, void* nccl = nullptr);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm mpi() const { return comm_; }
  // "mpi", "mpi-staged" or "nccl": the transport a tensor on `dev` travels by.
  const char* transport(Device dev) const;
  void* nccl() const { return nccl_; }  // the ncclComm_t, or null

  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum);  // in place
  void all_reduce(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  // in.numel() == size()*out.numel(); rank r gets the reduction of chunk r. out may be chunk r
  // of in (in place).
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  // out.numel() == size()*in.numel(); chunk r of out comes from rank r. in may be chunk
  // rank() of out (in place).
  void all_gather(const Tensor& out, const Tensor& in);
  void broadcast(const Tensor& t, int root);
  // Tags match messages on MPI; NCCL has none and matches a pair's messages in issue order.
  void send(const Tensor& t, int peer, int tag = 0);
  // For a caller whose two ends post a link's messages in different orders, relying on tags and
  // on a send completing before its receive is posted: its point-to-point messages then travel by
  // MPI, staged through the host, even where NCCL carries the group (whose sends wait for their
  // receive and whose matching ignores tags). Collectives keep NCCL.
  void match_p2p_by_tag() { p2p_by_tag_ = true; }
  void recv(const Tensor& t, int peer, int tag = 0);
  // Both at once, so a ring of send_recv cannot deadlock.
  void send_recv(const Tensor& send, int dst, const Tensor& recv, int src, int tag = 0);
  // Chunk p of in goes to rank p; chunk p of out comes from rank p. Equal chunks.
  void all_to_all(const Tensor& out, const Tensor& in);
  // Element counts per peer, chunks contiguous in peer order (MoE token dispatch).
  void all_to_all_v(const Tensor& out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                    const std::vector<int64_t>& send_counts);
  void barrier();

  Work all_reduce_async(const Tensor& t, ReduceOp op = ReduceOp::Sum);
  Work all_reduce_async(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  Work reduce_scatter_async(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  Work all_gather_async(const Tensor& out, const Tensor& in);
  Work broadcast_async(const Tensor& t, int root);
  Work send_async(const Tensor& t, int peer, int tag = 0);
  Work recv_async(const Tensor& t, int peer, int tag = 0);
  Work send_recv_async(const Tensor& send, int dst, const Tensor& recv, int src, int tag = 0);
  Work all_to_all_async(const Tensor& out, const Tensor& in);
  Work all_to_all_v_async(const Tensor& out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                          const std::vector<int64_t>& send_counts);
  Work barrier_async();

  const std::map<std::string, OpStats>& stats() const { return stats_; }
  void reset_stats() { stats_.clear(); }
  void set_stats(std::map<std::string, OpStats> s) { stats_ = std::move(s); }  // uncount what ran since stats()

 private:
  void count(const char* op, double payload, double wire);
  // Every collective is one Call (what makes it itself: its NCCL call, its MPI call, its flight
  // record) handed to issue(), the skeleton they share: the early out of a group of one, the
  // label, the flight recorder, then NCCL or MPI (comm.cu).
  struct Call;
  Work issue(const Call& c);
  // "all_reduce #12 on group 'dp' ...": the watchdog's name for a call, numbered as the flight
  // recorder numbers it (the n-th collective on the group; the n-th message of a pair and tag).
  std::string label(const char* op, int tag, long seq) const;
  // Frees the NCCL communicator, the stream and the MPI communicator now; the Comm is unusable
  // afterwards. The destructor calls it, and so does comm_finalize() for every live Comm.
  void release();
  friend void comm_finalize();

  std::string name_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::map<std::string, OpStats> stats_;
  void* nccl_ = nullptr;    // ncclComm_t when NCCL carries this group's CUDA tensors
  void* stream_ = nullptr;  // cudaStream_t: the group's communication stream
  bool p2p_by_tag_ = false;  // match_p2p_by_tag()
};

}  // namespace ts
