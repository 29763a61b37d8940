// fake_world.h — one rank of an N-rank job, in one process and without mpirun:
//   08_5d_mesh --device shape --fake-world 256 --fake-rank 37 --tp 8 --pp 4 --dp 8 ...
// The mesh, its groups (their sizes, this rank's place in each, the world ranks they hold), the
// pipeline schedule and every shard are rank R's of the real job; every collective and message
// is counted per group and op as the real one is (Comm::count), and completes at once, moving
// nothing: the other N − 1 ranks do not exist. Its tensors are shape-only (tensor/shape_only.h),
// so a 70B or 405B rank's memory is measured by the allocator at the real shape on a laptop —
// Megatron-LM's --fake-process-group and PyTorch's fake backend, without a GPU.
//
// How: each group's communicator is a private duplicate of MPI_COMM_SELF that this file
// registers with its fake size and rank. The MPI calls the comm layer makes (comm.cu's issue, the
// watched host operations) reach the definitions below first, under MPI's profiling interface:
// on a registered communicator they answer the fake size and rank and complete at once; on any
// other they are MPI's own (PMPI_*). A host buffer (an error string, a count) receives what this
// rank sent, as if every rank had sent the same; a tensor's bytes are never touched.
// MPI_COMM_WORLD itself stays the process's (one rank): the run prints as rank 0 does.
#pragma once
#include "comm/mesh.h"

namespace ts {

// Rank `rank` of a job of `world` ranks from now on (0: off): training/fake_world_flags.h reads
// --fake-world and --fake-rank and checks them first.
void set_fake_world(int world, int rank);
bool fake_world();
int fake_world_size();
int fake_world_rank();
// make_mesh's twin in a fake world: rank R's mesh; a world the mesh does not factor is a
// config_error naming both.
Mesh make_fake_mesh(const MeshConfig& cfg, Device dev);

}  // namespace ts
