// skip_collective, in 02_data_parallel: the last rank skips its second gradient all-reduce, as a
// rank whose code took another branch would. The others wait in it; the flight recorder's files
// must say which rank skipped which collective (tests/test_reliability.cpp, "flight recorder").
// Wraps the Comm::all_reduce_async that 02's bucketed gradient reduction calls.
#include "bug.h"
#include "comm/comm.h"

ts::Work real_all_reduce_async(ts::Comm* self, const ts::Tensor& t, ts::ReduceOp op)
    __asm__("__real__ZN2ts4Comm16all_reduce_asyncERKNS_6TensorENS_8ReduceOpE");
ts::Work skip_all_reduce_async(ts::Comm* self, const ts::Tensor& t, ts::ReduceOp op)
    __asm__("__wrap__ZN2ts4Comm16all_reduce_asyncERKNS_6TensorENS_8ReduceOpE");

ts::Work skip_all_reduce_async(ts::Comm* self, const ts::Tensor& t, ts::ReduceOp op) {
  static int calls = 0;
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (ts::world_rank() == world - 1 && ++calls == 2) {
    bug::announce("skip_collective");
    return ts::Work();
  }
  return real_all_reduce_async(self, t, op);
}
