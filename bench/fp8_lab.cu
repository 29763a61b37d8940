// fp8_lab.cu — FP8's three failure modes, one GEMM at a time, on the CPU in seconds: the numbers
// behind notes/fp8.md's failure lab. Every GEMM is C = X·Wᵀ with X [M, K] and W [N, K] drawn
// N(0, 1), quantized by common/fp8's recipes and multiplied by fp8::gemm; the error is
// ‖C − C_exact‖ / ‖C_exact‖ against the product of the unquantized fp32 operands in double.
//
//   outliers    one channel (column) of X scaled by M: a per-tensor scale maps the outlier to
//               e4m3's 448, and once M exceeds e4m3's dynamic range (2^-9 .. 448, about 2^17.8)
//               the other channels fall into subnormals or flush to zero; 1 × 128 tiles confine
//               the damage to the tiles that hold the outlier.
//   jump        delayed scaling: the scale comes from the history's amax, and this step's tensor
//               is J times larger. Values past ±448 saturate; current scaling never does.
//   accumulate  an accumulator that keeps 14 mantissa bits (about what Hopper's FP8 MMA keeps,
//               DeepSeek-V3 §3.3.2) rounds every addition to the running sum's ulp, so its error
//               grows with K; promoting to fp32 every N_C = 128 products bounds it at N_C's.
//
// Usage: fp8_lab [outliers|jump|accumulate|all]   (default all); prints tables.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tensor/rng.h"
#include "kernels/fp8.h"

using namespace ts;

namespace {

Tensor gaussian(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> v(size_t(rows * cols));
  for (size_t i = 0; i < v.size(); i++) v[i] = rng_normal(seed, uint64_t(i));
  Tensor t = Tensor::empty({rows, cols}, DType::F32, Device::CPU, Tag::Workspace);
  from_host_f32(t, v.data());
  return t;
}

// ‖C − X·Wᵀ‖ / ‖X·Wᵀ‖, the exact product in double.
double rel_error(const Tensor& C, const Tensor& X, const Tensor& W) {
  const std::vector<float> c = to_host_f32(C), x = to_host_f32(X), w = to_host_f32(W);
  const int64_t M = X.size(0), K = X.size(1), N = W.size(0);
  double num = 0, den = 0;
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++) s += double(x[size_t(m * K + k)]) * w[size_t(n * K + k)];
      const double d = c[size_t(m * N + n)] - s;
      num += d * d;
      den += s * s;
    }
  return std::sqrt(num / den);
}

// The FP8 product with X and W quantized per tensor, current scaling.
double fp8_error(const Tensor& X, const Tensor& W) {
  const fp8::Quantized qx = fp8::quantize_current(X, DType::F8E4M3, fp8::kWhole, fp8::kWhole);
  const fp8::Quantized qw = fp8::quantize_current(W, DType::F8E4M3, fp8::kWhole, fp8::kWhole);
  Tensor C = Tensor::empty({X.size(0), W.size(0)}, DType::F32, Device::CPU, Tag::Workspace);
  fp8::gemm(C, qx, false, qw, true);
  return rel_error(C, X, W);
}

// The values a quantized e4m3 operand stands for: decode(q) / its tile's scale.
std::vector<double> dequantized(const fp8::Quantized& q) {
  const int64_t R = q.q.size(0), C = q.q.size(1), sc = q.scales.size(1);
  const std::vector<float> s = to_host_f32(q.scales);
  const uint8_t* codes = q.q.data<uint8_t>();
  std::vector<double> v(size_t(R * C));
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) {
      const int64_t tr = q.tr >= R ? 0 : r / q.tr, tc = q.tc >= C ? 0 : c / q.tc;
      v[size_t(r * C + c)] = double(fp8::decode_e4m3(codes[r * C + c])) / s[size_t(tr * sc + tc)];
    }
  return v;
}

// What the other channels (1..K-1) of X·Wᵀ come to after quantization, against their exact sum.
// tile: kWhole (one scale per tensor) or DeepSeek-V3's 1 × tile for X and tile × tile for W.
double rest_error(const Tensor& X, const Tensor& W, int tile) {
  const fp8::Quantized qx = fp8::quantize_current(X, DType::F8E4M3, tile == fp8::kWhole ? tile : 1, tile);
  const fp8::Quantized qw = fp8::quantize_current(W, DType::F8E4M3, tile, tile);
  const std::vector<double> dx = dequantized(qx), dw = dequantized(qw);
  const std::vector<float> x = to_host_f32(X), w = to_host_f32(W);
  const int64_t M = X.size(0), K = X.size(1), N = W.size(0);
  double num = 0, den = 0;
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double exact = 0, got = 0;
      for (int64_t k = 1; k < K; k++) {
        exact += double(x[size_t(m * K + k)]) * w[size_t(n * K + k)];
        got += dx[size_t(m * K + k)] * dw[size_t(n * K + k)];
      }
      num += (got - exact) * (got - exact);
      den += exact * exact;
    }
  return std::sqrt(num / den);
}

void outliers() {
  printf("outliers: X [256, 1024] N(0,1) with channel 0 scaled by M, W [256, 1024] N(0,1); e4m3;\n");
  printf("error of the other 1023 channels' share of X·Wᵀ after quantization\n");
  printf("%10s %14s %22s\n", "M", "tensorwise", "blockwise 1x128/128^2");
  const Tensor W = gaussian(256, 1024, 2);
  for (double M : {1.0, 1e2, 1e3, 1e4, 1e5, 1e6}) {
    Tensor X = gaussian(256, 1024, 1);
    std::vector<float> x = to_host_f32(X);
    for (int64_t r = 0; r < 256; r++) x[size_t(r * 1024)] *= float(M);
    from_host_f32(X, x.data());
    printf("%10.0e %14.3e %22.3e\n", M, rest_error(X, W, fp8::kWhole), rest_error(X, W, 128));
  }
}

void jump() {
  printf("\njump: delayed scaling's scale from a history amax a, this step's X N(0,1)·J (amax ≈ J·a)\n");
  printf("%6s %16s %18s %16s\n", "J", "saturated", "delayed error", "current error");
  const Tensor W = gaussian(128, 1024, 4);
  const fp8::Quantized qw = fp8::quantize_current(W, DType::F8E4M3, fp8::kWhole, fp8::kWhole);
  const Tensor X0 = gaussian(128, 1024, 3);
  const float history = fp8::amax(X0);
  for (float J : {1.f, 2.f, 4.f, 16.f, 64.f}) {
    Tensor X = gaussian(128, 1024, 3);
    std::vector<float> x = to_host_f32(X);
    long over = 0;
    for (float& v : x) {
      v *= J;
      over += std::fabs(v) > history;
    }
    from_host_f32(X, x.data());
    fp8::Quantized qx;
    qx.tr = qx.tc = fp8::kWhole;
    qx.scales = Tensor::empty({1, 1}, DType::F32, Device::CPU, Tag::Workspace);
    const float s = fp8::scale_for(history, DType::F8E4M3);
    from_host_f32(qx.scales, &s);
    qx.q = Tensor::empty(X.shape, DType::F8E4M3, Device::CPU, Tag::Workspace);
    fp8::quantize(qx, X);
    Tensor C = Tensor::empty({128, 128}, DType::F32, Device::CPU, Tag::Workspace);
    fp8::gemm(C, qx, false, qw, true);
    printf("%6.0f %15.2f%% %18.3e %16.3e\n", J, 100.0 * double(over) / double(x.size()), rel_error(C, X, W),
           fp8_error(X, W));
  }
}

// The accumulator's own error: the same quantized operands, summed in fp32 as the reference.
// |N(0,1)| operands make every partial sum grow with k, the case DeepSeek-V3 measures (a sum
// of positive terms swamps each new product by the running sum's ulp).
void accumulate() {
  printf("\naccumulate: X [16, K], W [16, K] |N(0,1)| in e4m3 (per tensor); error against fp32 accumulation\n");
  printf("%8s %18s %24s\n", "K", "14 bits", "14 bits, N_C = 128");
  for (int64_t K : {128, 1024, 4096, 16384, 65536}) {
    Tensor X = gaussian(16, K, 5), W = gaussian(16, K, 6);
    for (Tensor* t : {&X, &W}) {
      std::vector<float> v = to_host_f32(*t);
      for (float& e : v) e = std::fabs(e);
      from_host_f32(*t, v.data());
    }
    const fp8::Quantized qx = fp8::quantize_current(X, DType::F8E4M3, fp8::kWhole, fp8::kWhole);
    const fp8::Quantized qw = fp8::quantize_current(W, DType::F8E4M3, fp8::kWhole, fp8::kWhole);
    auto product = [&](const fp8::Accum& acc) {
      Tensor C = Tensor::empty({16, 16}, DType::F32, Device::CPU, Tag::Workspace);
      fp8::gemm(C, qx, false, qw, true, 0.f, acc);
      return to_host_f32(C);
    };
    const std::vector<float> ref = product({});
    auto error = [&](const fp8::Accum& acc) {
      const std::vector<float> c = product(acc);
      double num = 0, den = 0;
      for (size_t i = 0; i < c.size(); i++) {
        num += double(c[i] - ref[i]) * (c[i] - ref[i]);
        den += double(ref[i]) * ref[i];
      }
      return std::sqrt(num / den);
    };
    printf("%8lld %18.3e %24.3e\n", (long long)K, error({14, 0}), error({14, 128}));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "all";
  if (what != "all" && what != "outliers" && what != "jump" && what != "accumulate") {
    fprintf(stderr, "error: fp8_lab: unknown experiment '%s' (outliers, jump, accumulate or all)\n", what.c_str());
    return 2;
  }
  if (what == "all" || what == "outliers") outliers();
  if (what == "all" || what == "jump") jump();
  if (what == "all" || what == "accumulate") accumulate();
  return 0;
}
