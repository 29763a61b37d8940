// bench_kernels.cu — every op of kernels.h, forward and backward, at a model's shapes, on the CPU
// and, when a GPU is visible, on CUDA; fp32 and bf16 activations. Shapes: "small" (dim 256, seq
// 256, batch 8, 8 heads, 4 kv heads, head dim 32, ffn 688, vocab 256: the CPU benchmark's) and
// "124m" (dim 768, seq 1024, batch 4, 12 heads, head dim 64, ffn 2048, vocab 50304: big enough
// that CUDA timings measure the GPU rather than launch overhead).
//
// Each op is warmed up, then timed over several repetitions; the median is reported as GFLOP/s
// for the matmul-shaped ops and GB/s of compulsory traffic for the memory-bound ones.
// On the CPU set OPENBLAS_CORETYPE=SkylakeX.
//
// Then the prediction of every kernel of 01's step at the 124m shape on an H100 SXM and an H200
// (common/training/gpu_speed.h), attention v1 and v2, next to the median this run measured for the
// same call (CUDA, bf16, --shape 124m; "—" otherwise), and the step's tokens/s and MFU.
// --predict prints the prediction alone.
// Usage: bench_kernels [--shape small|124m] [--device cpu|cuda|all] [--predict] [substring]
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "training/config_flags.h"
#include "tensor/rng.h"
#include "kernels/kernels.h"
#include "training/config.h"
#include "training/gpu_speed.h"

using namespace ts;

namespace {

struct Shape {
  int64_t batch, seq, dim, heads, kv_heads, head_dim, ffn, vocab;
  int64_t tokens() const { return batch * seq; }
};
const Shape kSmall{8, 256, 256, 8, 4, 32, 688, 256}, k124m{4, 1024, 768, 12, 12, 64, 2048, 50304};
constexpr int kWarmup = 2, kReps = 9;

struct Op {
  std::string name;
  double work;  // FLOPs when flops, else bytes moved
  bool flops;
  std::function<void()> run;
};

Tensor randn(std::vector<int64_t> shape, DType dt, Device dev, uint64_t seed, float stdev = 1.0f) {
  Tensor f = Tensor::empty(shape, DType::F32, dev, Tag::Activations);
  const int64_t cols = f.numel();
  init_normal(f.reshape({cols}), seed, stdev, 0, 0, cols);
  if (dt == DType::F32) return f;
  Tensor t = Tensor::empty(std::move(shape), dt, dev, Tag::Activations);
  convert(t, f);
  return t;
}

Tensor ints(const std::vector<int32_t>& v, Device dev) {
  Tensor h = Tensor::empty({int64_t(v.size())}, DType::I32, Device::CPU, Tag::Activations);
  std::copy(v.begin(), v.end(), h.i32());
  if (dev == Device::CPU) return h;
  Tensor d = Tensor::empty(h.shape, DType::I32, dev, Tag::Activations);
  copy(d, h);
  return d;
}

double median_ms(const Op& op, Device dev) {
  for (int i = 0; i < kWarmup; i++) op.run();
  device_sync(dev);
  std::vector<double> ms;
  for (int i = 0; i < kReps; i++) {
    const auto t0 = std::chrono::steady_clock::now();
    op.run();
    device_sync(dev);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + kReps / 2, ms.end());
  return ms[kReps / 2];
}

// The ops at the model's shapes, with their FLOP or byte counts.
std::vector<Op> make_ops(const Shape& sh, Device dev, DType dt) {
  const int64_t N = sh.tokens(), D = sh.dim, F = sh.ffn, V = sh.vocab, B = sh.batch, S = sh.seq, H = sh.heads,
                KVH = sh.kv_heads, hd = sh.head_dim;
  const double es = double(dtype_size(dt));  // bytes per activation element
  std::vector<int32_t> tokv(N), posv(S);
  for (int64_t n = 0; n < N; n++) tokv[n] = int32_t((n * 31 + 7) % V);
  for (int64_t s = 0; s < S; s++) posv[s] = int32_t(s);
  Tensor tok = ints(tokv, dev), pos = ints(posv, dev);
  auto act = [&](std::vector<int64_t> shape, uint64_t seed, float sd = 1.0f) { return randn(shape, dt, dev, seed, sd); };
  auto f32 = [&](std::vector<int64_t> shape, uint64_t seed, float sd = 1.0f) {
    return randn(shape, DType::F32, dev, seed, sd);
  };

  Tensor x = act({N, D}, 1), y = act({N, D}, 2), dy = act({N, D}, 3), dx = act({N, D}, 4);
  Tensor table = act({V, D}, 5), dtable = f32({V, D}, 6), w = f32({D}, 7), dw = f32({D}, 8), rstd = f32({N}, 9);
  Tensor Wg = act({F, D}, 10, 0.02f), dWg = f32({F, D}, 11), g = act({N, F}, 12), u = act({N, F}, 13);
  Tensor h = act({N, F}, 14), dh = act({N, F}, 15), dg = act({N, F}, 16), du = act({N, F}, 17);
  Tensor q = act({B, S, H, hd}, 18), k = act({B, S, KVH, hd}, 19), v = act({B, S, KVH, hd}, 20);
  Tensor o = act({B, S, H, hd}, 21), dout = act({B, S, H, hd}, 22), lse = f32({B, H, S}, 23);
  Tensor dq = act({B, S, H, hd}, 24), dk = act({B, S, KVH, hd}, 25), dv = act({B, S, KVH, hd}, 26);
  Tensor logits = act({N, V}, 27, 3.0f), dlogits = act({N, V}, 28), losses = f32({N}, 29);
  const int64_t P = 4 << 20;  // an optimizer shard of 4M parameters
  Tensor p = f32({P}, 30), pg = f32({P}, 31), m = f32({P}, 32, 0.01f), mv = f32({P}, 33, 0.01f);
  Tensor pc = Tensor::empty({P}, dt, dev, Tag::Params);
  attention_forward(o, lse, q, k, v, pos, pos);
  rmsnorm_forward(y, rstd, x, w, 1e-5f);

  // Causal attention does half of the dense S^2 work; backward runs 5 of its matmuls to forward's 2.
  const double attn_fwd = 2.0 * 2.0 * B * H * S * S * hd / 2.0, attn_bwd = attn_fwd * 5.0 / 2.0;
  const AdamWParams hp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 10};
  return {
      {"add", 3 * N * D * es, false, [=] { add(y, x, dx); }},
      {"embedding_forward", 2 * N * D * es, false, [=] { embedding_forward(x, table, tok); }},
      {"embedding_backward", N * D * (es + 8), false, [=] { embedding_backward(dtable, dy, tok); }},
      {"rmsnorm_forward", 2 * N * D * es, false, [=] { rmsnorm_forward(y, rstd, x, w, 1e-5f); }},
      {"rmsnorm_backward", 3 * N * D * es, false, [=] { rmsnorm_backward(dx, dw, dy, x, w, rstd); }},
      {"rope_forward", 2 * N * H * hd * es, false, [=] { rope_forward(q, pos, 10000.0f); }},
      {"rope_backward", 2 * N * H * hd * es, false, [=] { rope_backward(dq, pos, 10000.0f); }},
      {"linear_forward D->F", 2.0 * N * D * F, true, [=] { linear_forward(g, x, Wg); }},
      {"linear_backward D->F", 4.0 * N * D * F, true, [=] { linear_backward(dx, dWg, dg, x, Wg); }},
      {"attention_forward", attn_fwd, true, [=] { attention_forward(o, lse, q, k, v, pos, pos); }},
      {"attention_backward", attn_bwd, true,
       [=] { attention_backward(dq, dk, dv, dout, o, lse, q, k, v, pos, pos); }},
      {"swiglu_forward", 3 * N * F * es, false, [=] { swiglu_forward(h, g, u); }},
      {"swiglu_backward", 5 * N * F * es, false, [=] { swiglu_backward(dg, du, dh, g, u); }},
      {"cross_entropy fwd+bwd", 2 * N * V * es, false,
       [=] { cross_entropy_forward_backward(losses, dlogits, logits, tok, 1.0f / N); }},
      {"adamw_step (4M)", P * (28 + es), false, [=] { adamw_step(p, pg, m, mv, hp, true, 1.0f, pc); }},
      {"sum_squares (4M)", P * 4.0, false, [=] { sum_squares(pg); }},
      {"init_normal (4M)", P * 4.0, false, [=] { init_normal(pg, 42, 0.02f, 0, 0, P); }},
  };
}

// One rung's table at 124m, batch `batch`: every kernel on the H100 and H200, the measured median
// beside the H100's (the run's own GPU), then the step.
void print_prediction(AttnRung rung, int batch, const std::map<std::string, double>& measured, bool all_rows) {
  ModelConfig m;
  apply_preset("124m", m);
  const KernelRates r = hopper_kernel_rates();
  const StepPrediction h100 = predict_01_step(*find_gpu("h100"), r, m, batch, rung),
                       h200 = predict_01_step(*find_gpu("h200"), r, m, batch, rung);
  printf("\n01 at 124m, bf16, batch %d x seq %d, attention %s: predicted per call\n", batch, m.seq, rung_name(rung));
  printf("%-30s %5s %9s %9s %9s %-13s %9s %9s\n", "kernel", "calls", "GFLOP", "MB", "H100 ms", "limit", "H200 ms",
         "measured");
  for (size_t i = 0; i < h100.kernels.size(); i++) {
    const KernelCost &a = h100.kernels[i], &b = h200.kernels[i];
    if (!all_rows && a.name.find("attention") == std::string::npos && a.name.find("flash") == std::string::npos) continue;
    auto it = a.bench.empty() ? measured.end() : measured.find(a.bench);
    char meas[32] = "—";
    if (it != measured.end()) snprintf(meas, sizeof meas, "%.3f", it->second);
    printf("%-30s %5.0f %9.3f %9.2f %9.4f %-13s %9.4f %9s\n", a.name.c_str(), a.calls, a.flops * 1e-9, a.bytes * 1e-6,
           a.seconds * 1e3, a.limit.c_str(), b.seconds * 1e3, meas);
  }
  for (const auto* p : {&h100, &h200})
    printf("step on the %s: %.2f ms, %.0f tokens/s, MFU %.1f%%\n", p == &h100 ? "H100" : "H200", p->step_s * 1e3,
           p->tokens_per_s, 100 * p->mfu);
}

void print_predictions(const std::map<std::string, double>& measured) {
  print_prediction(AttnRung::V1, 4, measured, true);
  print_prediction(AttnRung::V2, 4, measured, false);
  // 01's bf16 run in scripts/gpu-check.sh (batch 8): what its tokens/s and MFU should read.
  ModelConfig m;
  apply_preset("124m", m);
  printf("\nat batch 8 (scripts/gpu-check.sh's 01 bf16 run):\n");
  for (AttnRung rung : {AttnRung::V1, AttnRung::V2})
    for (const char* gpu : {"h100", "h200"}) {
      const StepPrediction p = predict_01_step(*find_gpu(gpu), hopper_kernel_rates(), m, 8, rung);
      printf("  %s, attention %s: %.2f ms, %.0f tokens/s, MFU %.1f%%\n", gpu, rung_name(rung), p.step_s * 1e3,
             p.tokens_per_s, 100 * p.mfu);
    }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::string only, shape = "small", want = "all";
  bool predict_only = false;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--predict") predict_only = true;
    else if (a == "--shape" && i + 1 < argc) shape = argv[++i];
    else if (a == "--device" && i + 1 < argc) want = argv[++i];
    else only = a;
  }
  if ((shape != "small" && shape != "124m") || (want != "cpu" && want != "cuda" && want != "all")) {
    fprintf(stderr, "usage: bench_kernels [--shape small|124m] [--device cpu|cuda|all] [--predict] [substring]\n");
    MPI_Finalize();
    return 2;
  }
  if (predict_only) {
    print_predictions({});
    MPI_Finalize();
    return 0;
  }
  const Shape sh = shape == "124m" ? k124m : kSmall;
  std::vector<Device> devs;
  if (want != "cuda") devs.push_back(Device::CPU);
  if (want != "cpu" && cuda_available()) devs.push_back(Device::CUDA);
  if (want == "cuda" && devs.empty()) {
    fprintf(stderr, "bench_kernels --device cuda: no GPU visible to this build\n");
    MPI_Finalize();
    return 1;
  }
  printf("kernel benchmark (%s): batch %lld, seq %lld, dim %lld, heads %lld/%lld, head dim %lld, ffn %lld, vocab %lld\n",
         shape.c_str(), (long long)sh.batch, (long long)sh.seq, (long long)sh.dim, (long long)sh.heads,
         (long long)sh.kv_heads, (long long)sh.head_dim, (long long)sh.ffn, (long long)sh.vocab);
  printf("CPU threads %d; median of %d after %d warm-up\n\n", omp_get_max_threads(), kReps, kWarmup);
  printf("%-24s %-5s %-5s %10s %12s\n", "op", "dev", "dtype", "ms", "rate");
  std::map<std::string, double> measured;  // CUDA bf16 medians at 124m: the prediction's shape
  for (Device dev : devs)
    for (DType dt : {DType::F32, DType::BF16})
      for (const Op& op : make_ops(sh, dev, dt)) {
        if (op.name.find(only) == std::string::npos) continue;
        const double ms = median_ms(op, dev);
        if (shape == "124m" && dev == Device::CUDA && dt == DType::BF16) measured[op.name] = ms;
        printf("%-24s %-5s %-5s %10.3f %8.1f %s\n", op.name.c_str(), device_name(dev), dtype_name(dt), ms,
               op.work / ms * 1e-6, op.flops ? "GFLOP/s" : "GB/s");
        fflush(stdout);
      }
  print_predictions(measured);
  MPI_Finalize();
  return 0;
}
