// bench_gemm.cu — the GEMM-only limit of a training step on the CPU: every matrix product of
// one forward + backward of the model at a given shape, timed as plain OpenBLAS cblas_sgemm calls
// at that product's M, N, K. The sum is the time a step would take if it did nothing but its
// matmuls at the BLAS's speed: no norms, no softmax, no optimizer, no copies. A trainer's
// tokens/s over this limit's tokens/s is the fraction of the step it spends on matmuls.
//
// The products of one step, with T = batch × seq tokens and each linear layer y = x Wᵀ
// (W stored [out, in], as the model stores it):
//   forward   y  = x Wᵀ        M = T,   N = out, K = in
//   backward  dx = dy W        M = T,   N = in,  K = out
//             dW = dyᵀ x       M = out, N = in,  K = T
// for q, k, v, o, gate, up, down in every layer and the LM head; and per layer, sequence and
// query head (GQA shares a key-value head among heads / kv_heads query heads, which changes
// no product's shape):
//   forward   scores = Q Kᵀ  (seq × seq × head_dim),  out = P V   (seq × head_dim × seq)
//   backward  dV = Pᵀ dO,  dP = dO Vᵀ,  dQ = dS K,  dK = dSᵀ Q
// Attention is causal: half of each seq × seq product is masked out, and a kernel that skips
// the masked blocks does half the work, so the attention products count half their dense time.
// Their dense FLOPs add up to the model's flops_per_token × tokens, less the norm weights' share
// (checked below).
//
// Usage: bench_gemm [--dim D --layers L --heads H --kv-heads KV --ffn F --vocab V --seq S
//                    --batch B] [--threads N] [--reps R] [--seconds T]
// Threads: --threads, else OPENBLAS_NUM_THREADS, else 1. Set OPENBLAS_CORETYPE on CPUs that
// Debian's OpenBLAS misdetects (make bench does). Prints one table row per distinct product and
// a last line `gemm_limit tokens_per_s=… step_ms=… threads=…` for scripts.
// --seconds T measures a sustained rate instead: whole steps of products (causal ones at half
// their count), one after another for T seconds, and prints `gemm_sustained tokens_per_s=…`, the
// mean over that time. Two such processes started together overlap for all of it, which the
// fastest-round limit, timed product by product, does not guarantee.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/model.h"
#include "kernels/kernels.h"

using namespace ts;

namespace {

struct Gemm {
  std::string roles;   // which products of the step have this shape
  int M, N, K;
  bool transA, transB;  // row-major, as the model's matmul calls them
  long per_step;        // calls of this shape in one step
  double weight;        // share of the dense work that must be done: 0.5 for causal attention
};

// Adds `count` calls of (M, N, K, transA, transB), merging with an identical shape already listed.
void add(std::vector<Gemm>& g, const std::string& role, int M, int N, int K, bool ta, bool tb, long count,
         double weight = 1.0) {
  for (Gemm& e : g)
    if (e.M == M && e.N == N && e.K == K && e.transA == ta && e.transB == tb && e.weight == weight) {
      e.roles += "," + role;
      e.per_step += count;
      return;
    }
  g.push_back({role, M, N, K, ta, tb, count, weight});
}

std::vector<Gemm> step_gemms(const ModelConfig& c, int batch) {
  const int T = batch * c.seq, D = c.dim, hd = c.head_dim(), S = c.seq;
  struct Linear {
    const char* name;
    int in, out;
    long count;
  };
  const Linear linears[] = {{"q", D, c.heads * hd, c.layers},  {"k", D, c.kv_dim(), c.layers},
                            {"v", D, c.kv_dim(), c.layers},    {"o", c.heads * hd, D, c.layers},
                            {"gate", D, c.ffn, c.layers},      {"up", D, c.ffn, c.layers},
                            {"down", c.ffn, D, c.layers},      {"lm_head", D, c.vocab, 1}};
  std::vector<Gemm> g;
  for (const Linear& l : linears) {
    const std::string n = l.name;
    add(g, n + " fwd", T, l.out, l.in, false, true, l.count);
    add(g, n + " dx", T, l.in, l.out, false, false, l.count);
    add(g, n + " dW", l.out, l.in, T, true, false, l.count);
  }
  const long heads = long(c.layers) * batch * c.heads;
  add(g, "QK^T", S, S, hd, false, true, heads, 0.5);
  add(g, "P.V", S, hd, S, false, false, heads, 0.5);
  add(g, "dV=P^T.dO", S, hd, S, true, false, heads, 0.5);
  add(g, "dP=dO.V^T", S, S, hd, false, true, heads, 0.5);
  add(g, "dQ=dS.K", S, hd, S, false, false, heads, 0.5);
  add(g, "dK=dS^T.Q", S, hd, S, true, false, heads, 0.5);
  return g;
}

// A product's operands, uniform in [-0.5, 0.5), and `count` calls of it as the model makes them.
struct Operands {
  std::vector<float> A, B, C;
  explicit Operands(const Gemm& e) : A(size_t(e.M) * e.K), B(size_t(e.K) * e.N), C(size_t(e.M) * e.N) {
    uint32_t s = 12345;
    for (auto* v : {&A, &B})
      for (float& x : *v) x = float((s = s * 1664525u + 1013904223u) >> 8) / float(1 << 24) - 0.5f;
  }
  void calls(const Gemm& e, long count) {
    for (long i = 0; i < count; i++)
      cblas_sgemm(CblasRowMajor, e.transA ? CblasTrans : CblasNoTrans, e.transB ? CblasTrans : CblasNoTrans, e.M, e.N,
                  e.K, 1.0f, A.data(), e.transA ? e.M : e.K, B.data(), e.transB ? e.K : e.N, 0.0f, C.data(), e.N);
  }
};

// Seconds for one step's worth of calls of this shape: the fastest of `reps` rounds after a
// warm-up one. A limit is what the BLAS can do, and on a shared machine the fastest round is the
// one that other load disturbed least.
double time_gemm(const Gemm& e, int reps) {
  Operands o(e);
  o.calls(e, e.per_step);
  std::vector<double> t;
  for (int r = 0; r < reps; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    o.calls(e, e.per_step);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return *std::min_element(t.begin(), t.end());
}

// Whole steps of products, each product's calls at its weight (the causal ones half), for at
// least `seconds`; the step's tokens times the steps run, over the time taken.
double sustained_tokens_per_s(const std::vector<Gemm>& gemms, double tokens, int seconds) {
  std::vector<Operands> ops(gemms.begin(), gemms.end());
  auto step = [&] {
    for (size_t g = 0; g < gemms.size(); g++) ops[g].calls(gemms[g], std::lround(gemms[g].per_step * gemms[g].weight));
  };
  step();  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  long steps = 0;
  while (elapsed < seconds) {
    step();
    steps++;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return tokens * steps / elapsed;
}

int usage() {
  fprintf(stderr,
          "usage: bench_gemm [--dim D] [--layers L] [--heads H] [--kv-heads KV] [--ffn F] [--vocab V] [--seq S] "
          "[--batch B] [--threads N] [--reps R] [--seconds T]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  ModelConfig c;
  c.dim = 256, c.layers = 4, c.heads = 8, c.kv_heads = 4, c.ffn = 688, c.vocab = 256, c.seq = 256;
  int batch = 8, reps = 5, sustain = 0, threads = std::max(1, atoi(getenv("OPENBLAS_NUM_THREADS") ? getenv("OPENBLAS_NUM_THREADS") : "1"));
  struct Flag {
    const char* name;
    int* value;
  };
  const Flag flags[] = {{"--dim", &c.dim},   {"--layers", &c.layers}, {"--heads", &c.heads},     {"--kv-heads", &c.kv_heads},
                        {"--ffn", &c.ffn},   {"--vocab", &c.vocab},   {"--seq", &c.seq},         {"--batch", &batch},
                        {"--threads", &threads}, {"--reps", &reps},     {"--seconds", &sustain}};
  for (int i = 1; i < argc; i++) {
    const Flag* f = std::find_if(std::begin(flags), std::end(flags), [&](const Flag& x) { return !strcmp(x.name, argv[i]); });
    if (f == std::end(flags) || i + 1 >= argc || atoi(argv[i + 1]) <= 0) return usage();
    *f->value = atoi(argv[++i]);
  }
  if (c.dim % c.heads || c.heads % c.kv_heads) return usage();
  openblas_set_num_threads(threads);

  const std::vector<Gemm> gemms = step_gemms(c, batch);
  const double tokens = double(batch) * c.seq;
  if (sustain) {
    printf("gemm_sustained tokens_per_s=%.0f seconds=%d threads=%d\n", sustained_tokens_per_s(gemms, tokens, sustain),
           sustain, threads);
    return 0;
  }
  double dense = 0, needed = 0, seconds = 0;
  printf("GEMM-only limit of a training step: dim %d, %d layers, %d heads (%d kv), ffn %d, vocab %d, seq %d, batch %d\n",
         c.dim, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq, batch);
  printf("cblas_sgemm, %d OpenBLAS thread%s, the fastest of %d rounds\n", threads, threads == 1 ? "" : "s", reps);
  printf("%-36s %5s %5s %5s %4s %9s %9s %9s\n", "products", "M", "N", "K", "op", "per step", "ms/step", "GFLOP/s");
  for (const Gemm& e : gemms) {
    const double s = time_gemm(e, reps), flop = 2.0 * e.M * e.N * e.K * e.per_step;
    dense += flop, needed += flop * e.weight, seconds += s * e.weight;
    printf("%-36s %5d %5d %5d   %c%c %9ld %9.2f %9.1f%s\n", e.roles.c_str(), e.M, e.N, e.K, e.transA ? 'T' : 'N',
           e.transB ? 'T' : 'N', e.per_step, s * e.weight * 1e3, flop / s * 1e-9, e.weight < 1 ? "  (causal: half)" : "");
  }
  // flops_per_token counts 6 FLOPs per token for every parameter but the embedding, the norm
  // weights (which no matmul reads) included.
  const double formula = (flops_per_token(c) - 6.0 * (2 * c.layers + 1) * c.dim) * tokens;
  printf("step: %.2f GFLOP dense (= the model's flops_per_token × tokens, less the norm weights), %.2f GFLOP with "
         "causal attention halved\n", dense * 1e-9, needed * 1e-9);
  if (std::abs(dense / formula - 1) > 1e-9) {
    fprintf(stderr, "bench_gemm: the products listed miss part of the model's FLOPs\n");
    return 1;
  }
  printf("gemm_limit tokens_per_s=%.0f step_ms=%.1f gflops=%.1f threads=%d\n", tokens / seconds, seconds * 1e3,
         needed / seconds * 1e-9, threads);
  return 0;
}
