// ranks: 1
// The no-hang paths, each run as its own small MPI job (tests/comm_error_prog.cpp) whose
// runtime the test bounds with `timeout`: an unmatched collective or receive is aborted by the
// watchdog, a mesh that does not fit the world exits with one message, fatal() on one rank ends
// every rank.
#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

struct Job {
  int rc;           // the job's exit status; 124 if `timeout` had to kill it
  std::string out;  // stdout and stderr of every rank
  double secs;
};

static Job run_job(int np, const std::string& args, int bound_s) {
  const char* b = getenv("TS_BUILD");
  std::string prog = std::string(b ? b : "build") + "/tests/comm_error_prog";
  INFO("helper program " << prog << " (built by make with the tests)");
  REQUIRE(access(prog.c_str(), X_OK) == 0);
  char log[] = "/tmp/ts_comm_errors_XXXXXX";
  int fd = mkstemp(log);
  REQUIRE(fd >= 0);
  close(fd);
  // The inner mpirun must not mistake itself for a rank of the job this test runs in.
  std::string cmd = "env -u PMI_RANK -u PMI_SIZE -u PMI_FD -u MPI_LOCALNRANKS -u MPI_LOCALRANKID timeout " +
                    std::to_string(bound_s) + " mpirun -np " + std::to_string(np) + " " + prog + " " + args + " >" +
                    log + " 2>&1";
  auto t0 = std::chrono::steady_clock::now();
  int st = std::system(cmd.c_str());
  Job j;
  j.secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  j.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  j.out = ss.str();
  unlink(log);
  return j;
}

static int occurrences(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) n++;
  return n;
}

TEST_CASE("the watchdog aborts an unmatched collective within the timeout") {
  Job j = run_job(2, "unmatched-collective 2", 30);
  INFO(j.out);
  CHECK(j.rc != 0);
  CHECK(j.rc != 124);
  CHECK(j.secs < 25);
  CHECK(j.out.find("watchdog: rank 0 waited") != std::string::npos);
  CHECK(j.out.find("all_reduce #1 on group 'world'") != std::string::npos);
  CHECK(j.out.find("at step 42") != std::string::npos);
}

TEST_CASE("the watchdog aborts a receive that is never matched, naming the tag") {
  Job j = run_job(2, "unmatched-recv 2", 30);
  INFO(j.out);
  CHECK(j.rc != 0);
  CHECK(j.rc != 124);
  CHECK(j.out.find("recv #1 on group 'world' (2 ranks, tag 7)") != std::string::npos);
}

TEST_CASE("a mesh that does not match the world size: one message, non-zero exit") {
  Job j = run_job(2, "mesh 3 1 1 1 1", 30);
  INFO(j.out);
  CHECK(j.rc != 0);
  CHECK(j.rc != 124);
  CHECK(occurrences(j.out, "needs 3 ranks but the job has 2") == 1);
}

TEST_CASE("ep that does not divide dp x cp, and a zero degree, are rejected") {
  Job j = run_job(2, "mesh 2 1 1 1 3", 30);
  INFO(j.out);
  CHECK(j.rc != 0);
  CHECK(occurrences(j.out, "ep=3 must divide dp x cp = 2") == 1);
  Job z = run_job(2, "mesh 2 1 1 0 1", 30);
  INFO(z.out);
  CHECK(z.rc != 0);
  CHECK(occurrences(z.out, "every mesh degree must be at least 1") == 1);
}

TEST_CASE("a valid mesh runs and prints its table") {
  Job j = run_job(4, "mesh 1 2 1 2 1", 30);
  INFO(j.out);
  CHECK(j.rc == 0);
  CHECK(j.out.find("rank 3: dp=0 pp=1 cp=0 tp=1 ep=0") != std::string::npos);
}

TEST_CASE("fatal on one rank ends every rank") {
  Job j = run_job(2, "fatal", 60);
  INFO(j.out);
  CHECK(j.rc != 0);
  CHECK(j.rc != 124);
  CHECK(j.secs < 30);
  CHECK(j.out.find("deliberate failure on rank 1") != std::string::npos);
}

TEST_CASE("an error only one rank sees ends every rank at once, with that rank's message", "[fault]") {
  Job j = run_job(2, "rank-error", 60);
  INFO(j.out);
  CHECK(j.rc != 0);
  CHECK(j.rc != 124);
  CHECK(j.secs < 10);
  CHECK(occurrences(j.out, "error [rank 1]: bad input that only rank 1 read") == 1);
}
