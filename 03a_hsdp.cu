// 03a_hsdp.cu — HSDP, hybrid sharded data parallelism: 03's ZeRO inside groups of ranks, plain data
// parallelism across them. Read after 03_zero.cu; it adds --dp-shard to 03.
//
// ZeRO over all N_d ranks of dp gathers every unit from, and reduce-scatters every unit to, all
// N_d ranks: at scale those collectives cross the slow network every micro-batch, and their latency
// terms grow with N_d. HSDP (PyTorch FSDP's HYBRID_SHARD, torchtitan's dp_replicate × dp_shard;
// DeepSpeed's hpZ keeps a secondary copy of the weights inside a node for the same reason) factors
// dp = R × S:
//   * the S ranks of a shard group (consecutive dp ranks: a node, typically) run 03 exactly, over S
//     ranks: the weights, gradients and optimizer states are sharded S ways, the gathers and the
//     reduce-scatters stay inside the group;
//   * the R shard groups are replicas: rank j of every group holds chunk j, and the R holders of a
//     chunk all-reduce it after each reduce-scatter (02's all-reduce, on 1/S of the gradients), so
//     each chunk ends as the sum over all of dp's tokens — the same sum as 03's, in another order.
// Memory per rank is 03's formula with N_d = S, e.g. (2Ψ + 2Ψ + 12Ψ)/S at stage 3 (more than
// ZeRO-3 over all of dp: the price of keeping the weights' traffic inside the node). Per rank and
// reduction, (S−1)/S · 4Ψ inside the group and 2(R−1)/R · 4Ψ/S across (lab/03_zero.h prices both).
//
//   mpirun -np 4 ./build/03_zero --dp 4 --zero 3 --dp-shard 2
#ifndef TS_03A_HSDP_CU
#define TS_03A_HSDP_CU
#include <memory>
#include <string>

#include "03_zero.cu"
#include "comm/mesh.h"  // split_group

namespace zero {
using namespace ts;

// Rank d of `dense` (the ranks that reduce one gradient: dp, or dp × cp in 08) sits at position
// d mod S of shard group d / S, and at position d / S of replica group d mod S (the R ranks that
// hold the same chunks).
inline Groups hsdp_groups(Comm& dense, int S) {
  const int d = dense.rank(), R = dense.size() / S;
  // Split as the mesh splits its axes: over MPI, and over NCCL where the dense group has it.
  return {split_group(dense.mpi(), dense.nccl(), d / S, d % S, S, "dp_shard", "HSDP's 'dp_shard' groups"),
          split_group(dense.mpi(), dense.nccl(), d % S, d / S, R, "dp_replicate", "HSDP's 'dp_replicate' groups")};
}

// --dp-shard S over a dense group of n ranks: 0 (the default) or n is ZeRO over all of it, 1 is
// refused (nothing sharded: 02), else S must divide n. Returns S, or 0 for no regrouping.
inline int hsdp_shard(int S, int n, const char* group) {
  if (S == 0 || S == n) return 0;
  if (S == 1) config_error("--dp-shard 1 shards nothing: that is 02's data parallelism (--dp-shard 0: ZeRO over all of %s)", group);
  if (n % S != 0) config_error("--dp-shard %d does not divide %s (%d ranks): HSDP needs replicas × shard group", S, group, n);
  return S;
}
inline const char* kDpShardHelp = "ZeRO: HSDP, shard over groups of this many ranks, replicated across them (0: no groups)";

inline void read_hsdp_flags(Args& args, ZeroPlan& p) {
  const int S = hsdp_shard(args.get_int("--dp-shard", 0, kDpShardHelp, between(0, 1 << 20)), p.n, "--dp");
  if (S > 0) p.replicas = p.n / S, p.n = S;
}

inline const bool kHsdpRegistered =
    (regrouping() = Regrouping{read_hsdp_flags, [](Mesh& m, const ZeroPlan& p) { return hsdp_groups(m.dp(), p.n); }}, true);

}  // namespace zero
#endif  // TS_03A_HSDP_CU
