// A small program the error-path tests run under mpirun: each mode does one deliberately wrong
// thing, and the test asserts the job ends non-zero, in time, with the right message.
//   mesh DP PP CP TP EP          build that mesh (validation must reject a bad one)
//   unmatched-collective SECS    rank 0 all-reduces alone; the watchdog must abort the job
//   unmatched-recv SECS          rank 0 waits for a message (tag 7) that is never sent
//   fatal                        rank 1 calls fatal() while the others wait in a barrier
//   rank-error                   rank 1 calls rank_error() while the others wait in a barrier
#include <cstdlib>
#include <string>

#include "comm/comm.h"
#include "comm/watchdog.h"
#include "tensor/hooks.h"
#include "comm/mesh.h"

using namespace ts;

int main(int argc, char** argv) {
  comm_init(&argc, &argv);
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "mesh" && argc == 7) {
    MeshConfig c{atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6])};
    Mesh m = make_mesh(c, Device::CPU);
    print_mesh(m);
    comm_finalize();
    return 0;
  }
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Mesh m = make_mesh({world, 1, 1, 1, 1}, Device::CPU);
  set_current_step(42);
  Tensor t = Tensor::zeros({16}, DType::F32, Device::CPU, Tag::Workspace);
  if (mode == "unmatched-collective" && argc == 3) {
    set_comm_timeout(atof(argv[2]));
    if (m.rank == 0) m.world_comm().all_reduce(t);
  } else if (mode == "unmatched-recv" && argc == 3) {
    set_comm_timeout(atof(argv[2]));
    if (m.rank == 0) m.world_comm().recv(t, 1, 7);
  } else if (mode == "fatal") {
    if (m.rank == 1) fatal("deliberate failure on rank 1");
    m.world_comm().barrier();
  } else if (mode == "rank-error") {
    if (m.rank == 1) rank_error("bad input that only rank 1 read");
    m.world_comm().barrier();
  } else {
    config_error("usage: comm_error_prog mesh DP PP CP TP EP | unmatched-collective SECS | unmatched-recv SECS | fatal | rank-error");
  }
  comm_finalize();
  return 0;
}
