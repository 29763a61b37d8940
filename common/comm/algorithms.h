// algorithms.h — the collectives written out over point-to-point (the playbook's appendix: the
// ring, NCCL's double binary tree, recursive halving-doubling, the two-level hierarchy), chosen
// per run with --collectives. "library" (the default) leaves every collective to MPI or NCCL.
// Derivations and costs: notes/collectives.md, "The algorithms written out".
//
// Each algorithm moves data only with its group's own send/recv (Comm::send_recv: MPI on the CPU,
// NCCL send/recv on the group's stream for CUDA tensors) and sums with add_inplace on the
// tensor's device, so it runs wherever the library collective runs, the emulated GPU included.
//
// What each covers (anything else falls back to the ring: one line on stderr from the group's rank 0,
// once per group and op):
//   ring              all-reduce (= reduce-scatter + all-gather), reduce-scatter, all-gather,
//                     broadcast (a pipelined chain from the root)
//   tree              all-reduce, broadcast (NCCL's double binary tree, each tree half the data)
//   halving-doubling  all-reduce, reduce-scatter, all-gather on a power-of-two group
//   two-level         all-reduce on a group with the same number of ranks on every node
// Reductions: Sum and Avg of f32 and bf16; Max and integer reductions stay with the library.
#pragma once
#include <string>
#include <vector>

#include "comm/comm.h"

namespace ts {

enum class Collectives { Library, Ring, Tree, HalvingDoubling, TwoLevel };
enum class CollectiveOp { AllReduce, ReduceScatter, AllGather, Broadcast };

// --collectives NAME: refuses an unknown name (one line, every rank).
void set_collectives(const std::string& name);
Collectives collectives();
const char* collectives_name(Collectives a);
const char* collectives_names();  // "library|ring|tree|halving-doubling|two-level"

// The hook in Comm's collective entry points: runs the call with the chosen written-out algorithm
// and returns true, or returns false (library, a group of one, or a reduction it does not cover).
// Blocking: the call has completed (on the GPU: is queued before the compute stream's next work)
// when it returns. The group's byte counters keep the library's entry, not the messages it sent.
bool run_written_out(Comm& c, CollectiveOp op, const Tensor& out, const Tensor& in, ReduceOp r, int root);

// The algorithm that would carry `op` on `c` under `a` after the fall-backs above.
Collectives algorithm_for(Comm& c, CollectiveOp op, Collectives a);

// The node of each rank of c's group, as MPI reports it (MPI_Comm_split_type), numbered 0.. in
// order of each node's lowest group rank; found once per group and kept on its communicator.
const std::vector<int>& nodes_of(Comm& c);

}  // namespace ts
