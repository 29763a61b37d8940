// bench_comm.cu — bus bandwidth of each collective over message sizes, reported the way
// nccl-tests does:
//   algbw = size / time
//   busbw = algbw × factor, factor = 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
//           reduce-scatter and all-to-all, 1 for broadcast
// so busbw is the per-link rate the ring achieves and is comparable across rank counts.
// size is the full buffer: all-reduce's tensor, all-gather's output, reduce-scatter's input.
//
//   mpirun -np 4 build/bench/bench_comm [--device auto|cpu|cuda] [--min-bytes B] [--max-bytes B] [--dtype f32|bf16]
//                                       [--algorithms]
// --algorithms: instead, each written-out all-reduce (--collectives; common/comm/algorithms.h) and
// the library's over the sizes, the α–β line t = a + b·size fitted to each by least squares, and
// the sizes where two lines cross (notes/collectives.md, "The algorithms measured"). On two
// simulated nodes: MPIR_CVAR_NUM_CLIQUES=2 mpirun -np 4 ... --algorithms.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/algorithms.h"
#include "comm/comm.h"
#include "comm/watchdog.h"
#include "comm/flight_recorder.h"
#include "comm/mesh.h"

using namespace ts;

struct Op {
  const char* name;
  double factor;  // busbw / algbw for n ranks, set below
};

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// One collective of `bytes` (the full buffer) on c.
static void run_op(Comm& c, const std::string& op, const Tensor& full, const Tensor& part, const Tensor& other) {
  if (op == "all_reduce") c.all_reduce(full);
  else if (op == "all_gather") c.all_gather(full, part);
  else if (op == "reduce_scatter") c.reduce_scatter(part, full);
  else if (op == "broadcast") c.broadcast(full, 0);
  else c.all_to_all(other, full);
}

// What the flight recorder adds to a call: its bookkeeping alone (record, start, complete: the
// three calls every collective makes), and an 8-byte all-reduce with the ring on and off.
static void flight_recorder_cost(Comm& c) {
  const int n = 200000;
  double t0 = now();
  for (int i = 0; i < n; i++) {
    const uint64_t id = flight::collective(c.mpi(), "all_reduce", 2, DType::F32, -1, "all_reduce #0 on group 'bench'");
    flight::started(id);
    flight::completed(id);
  }
  const double book = (now() - t0) / n;
  Tensor small = Tensor::zeros({2}, DType::F32, Device::CPU, Tag::Comm);
  double with_ring[2] = {0, 0};
  for (int on = 1; on >= 0; on--) {
    flight::configure(on ? 2000 : 0, "");
    c.barrier();
    const int iters = 20000;
    t0 = now();
    for (int i = 0; i < iters; i++) c.all_reduce(small);
    double t = (now() - t0) / iters;
    watched_allreduce(&t, &with_ring[on], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD, "all_reduce (the slowest rank's time)");
  }
  flight::configure(2000, "");
  if (c.rank() == 0)
    printf("flight recorder: %.0f ns of bookkeeping per call (ring of 2000); an 8-byte all_reduce takes %.2f us with it, "
           "%.2f us without\n", book * 1e9, with_ring[1] * 1e6, with_ring[0] * 1e6);
}

// The median over `iters` all-reduces of `t` (each timed alone, after a barrier) of the slowest
// rank's time: on a machine whose cores other jobs share, a rank descheduled mid-call makes one
// call slow, and the median leaves it out where the mean would not.
static double time_all_reduce(Comm& c, const Tensor& t, int iters, Device dev) {
  c.all_reduce(t);
  std::vector<double> times;
  for (int it = 0; it < iters; it++) {
    c.barrier();
    const double t0 = now();
    c.all_reduce(t);
    device_sync(dev);
    double mine = now() - t0, slowest = 0;
    watched_allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD, "all_reduce (the slowest rank's time)");
    times.push_back(slowest);
  }
  std::nth_element(times.begin(), times.begin() + long(times.size() / 2), times.end());
  return times[times.size() / 2];
}

// t = a + b·s by least squares on the relative error (weights 1/t²), so that the small messages,
// whose times are a thousand times shorter, still decide the intercept a (the latency terms).
static void fit_line(const std::vector<double>& s, const std::vector<double>& t, double& a, double& b) {
  double s00 = 0, s01 = 0, s11 = 0, y0 = 0, y1 = 0;
  for (size_t i = 0; i < s.size(); i++) {
    const double w = 1 / (t[i] * t[i]);
    s00 += w, s01 += w * s[i], s11 += w * s[i] * s[i], y0 += w * t[i], y1 += w * s[i] * t[i];
  }
  const double det = s00 * s11 - s01 * s01;
  a = (y0 * s11 - y1 * s01) / det;
  b = (s00 * y1 - s01 * y0) / det;
}

// The cost model's shape of each algorithm's all-reduce, t = steps·α + factor·K/β (notes/collectives.md):
// the fitted a and b give α = a/steps and β = factor/b. Two-level's steps and bytes mix its two
// levels, so its α and β are per message averaged over them; the library's algorithm is MPI's own
// choice (steps 0: not split).
static void model_shape(Comm& c, Collectives a, double& steps, double& factor) {
  const double N = c.size(), D = std::floor(std::log2(N));
  steps = 0, factor = 0;
  if (a == Collectives::Ring) steps = 2 * (N - 1), factor = 2 * (N - 1) / N;
  if (a == Collectives::HalvingDoubling) steps = 2 * std::log2(N), factor = 2 * (N - 1) / N;
  if (a == Collectives::Tree) steps = 4 * D, factor = 2 * D;  // unpipelined, the two trees in turn
  if (a == Collectives::TwoLevel) {
    const std::vector<int>& node = nodes_of(c);
    const double M = *std::max_element(node.begin(), node.end()) + 1, L = N / M;
    steps = 2 * (L - 1) + 2 * (M - 1), factor = 2 * (L - 1) / L + 2 * (M - 1) / (L * M);
  }
}

// time[a][s]: algorithm algos[a]'s all-reduce of sizes[s] bytes. Three rounds over every size and
// algorithm in turn, each the median of its calls, and the median of the three: load from other
// jobs that comes and goes then falls on every algorithm alike rather than on the one it meets.
static std::vector<std::vector<double>> time_grid(Comm& c, Device dev, DType dt, const std::vector<Collectives>& algos,
                                                  const std::vector<double>& sizes) {
  const int rounds = 3;
  std::vector<std::vector<std::vector<double>>> runs(algos.size(), std::vector<std::vector<double>>(sizes.size()));
  for (int round = 0; round < rounds; round++)
    for (size_t s = 0; s < sizes.size(); s++) {
      const int64_t count = int64_t(sizes[s]) / int64_t(dtype_size(dt));
      Tensor t = Tensor::zeros({count}, dt, dev, Tag::Comm);
      const int iters = int(std::min(30.0, std::max(3.0, 32.0 * (1 << 20) / sizes[s])));
      for (size_t a = 0; a < algos.size(); a++) {
        set_collectives(collectives_name(algos[a]));
        runs[a][s].push_back(time_all_reduce(c, t, iters, dev));
      }
    }
  set_collectives("library");
  std::vector<std::vector<double>> time(algos.size(), std::vector<double>(sizes.size()));
  for (size_t a = 0; a < algos.size(); a++)
    for (size_t s = 0; s < sizes.size(); s++) {
      std::vector<double>& r = runs[a][s];
      std::sort(r.begin(), r.end());
      time[a][s] = r[r.size() / 2];
    }
  return time;
}

// Each algorithm's all-reduce over the sizes, its fitted a (µs) and 1/b (GB/s), then the crossovers.
static void algorithm_fits(Comm& c, Device dev, DType dt, double min_bytes, double max_bytes) {
  const int n = c.size();
  std::string nodes;
  for (int q : nodes_of(c)) nodes += " " + std::to_string(q);
  if (c.rank() == 0)
    printf("# all_reduce by algorithm: %d ranks, node of each rank:%s; %s %s; t = median of 3 rounds of the median over "
           "calls of the slowest rank's time (us)\n", n, nodes.c_str(), device_name(dev), dtype_name(dt));
  std::vector<Collectives> algos;
  for (Collectives a : {Collectives::Library, Collectives::Ring, Collectives::Tree, Collectives::HalvingDoubling,
                        Collectives::TwoLevel})  // a fall-back would only time the ring again
    if (a == Collectives::Library || algorithm_for(c, CollectiveOp::AllReduce, a) == a) algos.push_back(a);
  std::vector<double> sizes;
  for (double bytes = min_bytes; bytes <= max_bytes; bytes *= 4)
    sizes.push_back(double(std::max<int64_t>(n, int64_t(bytes / dtype_size(dt)) / n * n) * dtype_size(dt)));
  const std::vector<std::vector<double>> time = time_grid(c, dev, dt, algos, sizes);
  struct Fit { Collectives a; double lat, per_byte; };
  std::vector<Fit> fits;
  if (c.rank() == 0) {
    printf("%-17s", "size(B):");
    for (double s : sizes) printf(" %10.0f", s);
    printf("  | fit: a(us)  1/b(GB/s) | alpha(us)  beta(GB/s)\n");
  }
  for (size_t a = 0; a < algos.size(); a++) {
    Fit f{algos[a], 0, 0};
    fit_line(sizes, time[a], f.lat, f.per_byte);
    fits.push_back(f);
    double steps = 0, factor = 0;
    model_shape(c, f.a, steps, factor);
    if (c.rank() != 0) continue;
    printf("%-17s", collectives_name(f.a));
    for (double t : time[a]) printf(" %10.1f", t * 1e6);
    printf("  | %9.1f %10.3f", f.lat * 1e6, 1e-9 / f.per_byte);
    if (steps > 0) printf(" | %9.1f %10.3f\n", f.lat * 1e6 / steps, factor * 1e-9 / f.per_byte);
    else printf(" |         -          -\n");
  }
  // Two lines a1 + b1·s and a2 + b2·s cross at s = (a2 − a1)/(b1 − b2): below it the one with the
  // smaller a is faster, above it the one with the smaller b.
  if (c.rank() != 0) return;
  printf("crossovers (bytes; below it the first is faster):\n");
  for (size_t i = 0; i < fits.size(); i++)
    for (size_t j = i + 1; j < fits.size(); j++) {
      const Fit &p = fits[i], &q = fits[j];
      const double s = (q.lat - p.lat) / (p.per_byte - q.per_byte);
      const Fit &lo = p.lat < q.lat ? p : q, &hi = p.lat < q.lat ? q : p;
      if (s > 0 && std::isfinite(s))
        printf("  %-16s vs %-16s %12.0f\n", collectives_name(lo.a), collectives_name(hi.a), s);
      else
        printf("  %-16s vs %-16s %12s (%s faster at every size)\n", collectives_name(lo.a), collectives_name(hi.a), "none",
               collectives_name(lo.per_byte <= hi.per_byte ? lo.a : hi.a));
    }
}

int main(int argc, char** argv) {
  comm_init(&argc, &argv);
  std::string device = "auto";
  DType dt = DType::F32;
  double min_bytes = 4096, max_bytes = 16 << 20;
  bool algorithms = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) device = argv[++i];
    else if (a == "--min-bytes" && i + 1 < argc) min_bytes = atof(argv[++i]);
    else if (a == "--max-bytes" && i + 1 < argc) max_bytes = atof(argv[++i]);
    else if (a == "--dtype" && i + 1 < argc) dt = std::string(argv[++i]) == "bf16" ? DType::BF16 : DType::F32;
    else if (a == "--algorithms") algorithms = true;
    else config_error("bench_comm: unknown argument '%s' (--device --min-bytes --max-bytes --dtype --algorithms)", a.c_str());
  }
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Device dev = parse_device(device);
  Mesh mesh = make_mesh({world, 1, 1, 1, 1}, dev);
  Comm& c = mesh.world_comm();
  const int n = c.size();
  if (algorithms) {
    algorithm_fits(c, dev, dt, min_bytes, max_bytes);
    mesh = Mesh();
    comm_finalize();
    return 0;
  }
  const double ring = double(n - 1) / n;
  std::vector<Op> ops = {{"all_reduce", 2 * ring}, {"all_gather", ring}, {"reduce_scatter", ring},
                         {"broadcast", 1}, {"all_to_all", ring}};
  const size_t es = dtype_size(dt);
  if (mesh.rank == 0) {
    printf("# bench_comm: %d ranks, %s %s tensors via %s; time = max over ranks of the mean of the timed iterations\n",
           n, device_name(dev), dtype_name(dt), c.transport(dev));
    printf("%-15s %12s %8s %12s %12s %12s\n", "op", "size(B)", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
  }
  for (const Op& op : ops) {
    for (double bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      int64_t count = std::max<int64_t>(n, int64_t(bytes / es) / n * n);  // divisible into n chunks
      Tensor full = Tensor::zeros({count}, dt, dev, Tag::Comm);
      Tensor part = Tensor::zeros({count / n}, dt, dev, Tag::Comm);
      Tensor other = Tensor::zeros({count}, dt, dev, Tag::Comm);
      // Enough iterations for ~64 MiB of traffic, within [3, 50].
      int iters = int(std::min(50.0, std::max(3.0, 64.0 * (1 << 20) / bytes)));
      run_op(c, op.name, full, part, other);  // warm-up: connections, buffers
      c.barrier();
      double t0 = now();
      for (int it = 0; it < iters; it++) run_op(c, op.name, full, part, other);
      device_sync(dev);
      double t = (now() - t0) / iters, tmax = 0;
      watched_allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD, "all_reduce (the slowest rank's time)");
      double size = double(count) * es, algbw = size / tmax / 1e9;
      if (mesh.rank == 0)
        printf("%-15s %12.0f %8d %12.1f %12.3f %12.3f\n", op.name, size, iters, tmax * 1e6, algbw, algbw * op.factor);
    }
  }
  flight_recorder_cost(c);
  mesh = Mesh();
  comm_finalize();
  return 0;
}
