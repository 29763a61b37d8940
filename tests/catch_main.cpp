// The Catch2 runner for every test binary, compiled once. MPI is initialised around the session
// so the same runner serves single-rank tests and multi-rank ones under mpirun; a rank whose
// tests fail makes the whole job fail.
//
// Only rank 0 reports to the terminal, so the driver reads one summary line. The other ranks
// report to a file each, printed only when that rank had a failure.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
#ifdef TS_CUDA_EMU
  // The emulated GPU's NCCL calls MPI from its streams' threads (common/emu/nccl.cu).
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
#else
  MPI_Init(&argc, &argv);
#endif
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<char*> args(argv, argv + argc);
  const std::string report = "/tmp/ts_catch_" + std::to_string(getpid()) + "_rank" + std::to_string(rank) + ".txt";
  std::string out_flag = "--out", out_path = report;
  if (rank > 0) {
    args.push_back(&out_flag[0]);
    args.push_back(&out_path[0]);
  }
  Catch::Session session;
  int rc = session.applyCommandLine(int(args.size()), args.data());
  int failed = rc ? 1 : session.run();
  if (rank > 0) {
    if (failed) {
      std::ifstream f(report);
      std::cerr << "---- rank " << rank << " report ----\n" << f.rdbuf() << std::flush;
    }
    std::remove(report.c_str());
  }
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  // The process's scratch directory (tests/test_util.h: the runs' checkpoints and logs, hundreds
  // of MB) goes once every case has passed; after a failure it stays, to be read.
  if (!any) {
    std::error_code ignored;
    std::filesystem::remove_all("/tmp/ts_test_" + std::to_string(getpid()), ignored);
  }
  MPI_Finalize();
  return any ? 1 : 0;
}
