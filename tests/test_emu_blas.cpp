// ranks: 1
// The emulated cuBLAS and cuBLASLt (common/emu/blas.cu) against references written here:
// cublasGemmEx for every op combination (NN, NT, TN, TT), fp32 and bf16, with leading dimensions
// above the minimum (padding filled with NaN, which must not leak in, and with a sentinel, which
// must not be overwritten), exactly on small integers and within an fp32 bound on random floats;
// every documented argument error returns its status and is named; beta = 0 never reads C; k = 0
// gives beta C; the product runs on the handle's stream, late; the cuBLASLt FP8 matmul (TN, scale
// pointers read when it runs) against a decode-then-multiply loop, all 256 codes of both formats
// decoded, and the heuristic refusing what NVIDIA documents as unsupported (non-TN, e5m2 × e5m2,
// a dimension not a multiple of 16, a misaligned leading dimension), so the callers' decode paths
// run. Only in the emulated build (make CUDA=emu).
#include <catch2/catch.hpp>

#ifdef TS_CUDA_EMU
#include <cublasLt.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "tensor/device.h"
#include "kernels/kernels.h"
#include "emu.h"

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Reproducible data: a 64-bit LCG.
struct Lcg {
  uint64_t s;
  uint32_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(s >> 33);
  }
  float uniform() { return float(next()) / float(1u << 31) * 2.f - 1.f; }  // [-1, 1)
  int integer(int lo, int hi) { return lo + int(next() % uint32_t(hi - lo + 1)); }
};

void* device_bytes(const void* host, size_t bytes) {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess);
  if (host) REQUIRE(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);  // a pageable copy returns before it has run
  return p;
}
std::vector<uint8_t> host_bytes(const void* dev, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  REQUIRE(cudaMemcpy(h.data(), dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

// Host values stored as a GEMM type (fp32 or bf16, the project's float_to_bf16) and read back.
std::vector<uint8_t> encode(const std::vector<float>& v, cudaDataType t) {
  std::vector<uint8_t> b(v.size() * (t == CUDA_R_32F ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == CUDA_R_32F) {
      memcpy(&b[4 * i], &v[i], 4);
    } else {
      const uint16_t h = ts::float_to_bf16(v[i]).bits;
      memcpy(&b[2 * i], &h, 2);
    }
  }
  return b;
}
std::vector<float> decode(const std::vector<uint8_t>& b, cudaDataType t) {
  std::vector<float> v(b.size() / (t == CUDA_R_32F ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == CUDA_R_32F) {
      memcpy(&v[i], &b[4 * i], 4);
    } else {
      ts::bf16 h;
      memcpy(&h.bits, &b[2 * i], 2);
      v[i] = ts::bf16_to_float(h);
    }
  }
  return v;
}
float round_to(cudaDataType t, float x) { return t == CUDA_R_32F ? x : ts::bf16_to_float(ts::float_to_bf16(x)); }

// A column-major matrix rows × cols with leading dimension ld on the host; the rows past `rows`
// of each column hold `pad`.
struct HostMat {
  int rows, cols, ld;
  std::vector<float> v;
  HostMat(int r, int c, int l, float pad) : rows(r), cols(c), ld(l), v(size_t(l) * size_t(c), pad) {}
  float& at(int i, int j) { return v[size_t(i) + size_t(j) * size_t(ld)]; }
  float at(int i, int j) const { return v[size_t(i) + size_t(j) * size_t(ld)]; }
};

// The plain triple loop in double: C = alpha op(A) op(B) + beta C, and for each element the
// sum of the magnitudes of its terms, which bounds fp32's rounding error.
struct Reference {
  std::vector<double> value, magnitude;  // m × n, dense column-major
};
Reference triple_loop(bool ta, bool tb, int m, int n, int k, double alpha, const HostMat& A, const HostMat& B,
                      double beta, const HostMat& C) {
  Reference r{std::vector<double>(size_t(m) * n), std::vector<double>(size_t(m) * n)};
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0, mag = 0;
      for (int q = 0; q < k; ++q) {
        const double t = double(ta ? A.at(q, i) : A.at(i, q)) * double(tb ? B.at(j, q) : B.at(q, j));
        s += t;
        mag += std::fabs(t);
      }
      const double c = beta != 0 ? beta * double(C.at(i, j)) : 0.0;
      r.value[size_t(i + j * m)] = alpha * s + c;
      r.magnitude[size_t(i + j * m)] = std::fabs(alpha) * mag + std::fabs(c);
    }
  return r;
}

struct Handle {
  cublasHandle_t h = nullptr;
  Handle() { REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS); }
  ~Handle() { cublasDestroy(h); }
};

// One cublasGemmEx on device copies of A, B, C; returns C as it comes back.
struct GemmCase {
  cublasOperation_t ta, tb;
  int m, n, k;
  cudaDataType ab, c;  // A's and B's type, C's type
  float alpha, beta;
};
HostMat run_gemm(const GemmCase& g, const HostMat& A, const HostMat& B, const HostMat& C) {
  Handle h;
  void* dA = device_bytes(encode(A.v, g.ab).data(), A.v.size() * (g.ab == CUDA_R_32F ? 4 : 2));
  void* dB = device_bytes(encode(B.v, g.ab).data(), B.v.size() * (g.ab == CUDA_R_32F ? 4 : 2));
  const size_t c_bytes = C.v.size() * (g.c == CUDA_R_32F ? 4 : 2);
  void* dC = device_bytes(encode(C.v, g.c).data(), c_bytes);
  REQUIRE(cublasGemmEx(h.h, g.ta, g.tb, g.m, g.n, g.k, &g.alpha, dA, g.ab, A.ld, dB, g.ab, B.ld, &g.beta, dC, g.c,
                       C.ld, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  HostMat out = C;
  out.v = decode(host_bytes(dC, c_bytes), g.c);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
  return out;
}

// A and B for a case, stored with padded leading dimensions whose padding is NaN (a product that
// reads it is NaN), and C with a sentinel in its padding (a product that writes it changes it).
constexpr float kSentinel = 12345.f;
struct Operands {
  HostMat A, B, C;
};
Operands make_operands(const GemmCase& g, Lcg& rng, bool integers) {
  const bool ta = g.ta != CUBLAS_OP_N, tb = g.tb != CUBLAS_OP_N;
  const int ar = ta ? g.k : g.m, ac = ta ? g.m : g.k, br = tb ? g.n : g.k, bc = tb ? g.k : g.n;
  Operands o{HostMat(ar, ac, ar + 3, kNaN), HostMat(br, bc, br + 2, kNaN), HostMat(g.m, g.n, g.m + 4, kSentinel)};
  auto fill = [&](HostMat& x, cudaDataType t) {
    for (int j = 0; j < x.cols; ++j)
      for (int i = 0; i < x.rows; ++i)
        x.at(i, j) = round_to(t, integers ? float(rng.integer(-4, 4)) : rng.uniform());
  };
  fill(o.A, g.ab);
  fill(o.B, g.ab);
  fill(o.C, g.c);
  return o;
}

void check_gemm(const GemmCase& g, bool integers) {
  Lcg rng{uint64_t(g.m * 131 + g.n * 17 + g.k + g.ta * 7 + g.tb * 3 + g.c)};
  const Operands o = make_operands(g, rng, integers);
  const HostMat out = run_gemm(g, o.A, o.B, o.C);
  const bool ta = g.ta != CUBLAS_OP_N, tb = g.tb != CUBLAS_OP_N;
  const Reference r = triple_loop(ta, tb, g.m, g.n, g.k, g.alpha, o.A, o.B, g.beta, o.C);
  const double u = std::ldexp(1.0, -24);  // fp32's unit roundoff
  for (int j = 0; j < g.n; ++j) {
    for (int i = 0; i < g.m; ++i) {
      const double want = r.value[size_t(i + j * g.m)];
      const float got = out.at(i, j);
      if (integers) {  // every sum exact in fp32; a bf16 C is the exact value rounded once
        REQUIRE(got == round_to(g.c, float(want)));
      } else {
        double bound = (g.k + 2) * u * r.magnitude[size_t(i + j * g.m)];
        if (g.c == CUDA_R_16BF) bound += std::ldexp(std::fabs(want), -8);  // bf16's half ulp
        REQUIRE(std::fabs(double(got) - want) <= bound);
      }
    }
    for (int i = g.m; i < out.ld; ++i) REQUIRE(out.at(i, j) == round_to(g.c, kSentinel));  // C's padding untouched
  }
}

const char* op_str(cublasOperation_t op) { return op == CUBLAS_OP_N ? "N" : "T"; }

}  // namespace

TEST_CASE("emulated cuBLAS: cublasGemmEx for NN, NT, TN, TT, fp32 and bf16, padded leading dimensions", "[emu]") {
  const cudaDataType types[3][2] = {{CUDA_R_32F, CUDA_R_32F}, {CUDA_R_16BF, CUDA_R_16BF}, {CUDA_R_16BF, CUDA_R_32F}};
  for (cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T})
    for (cublasOperation_t tb : {CUBLAS_OP_N, CUBLAS_OP_T})
      for (const auto& t : types) {
        INFO("op " << op_str(ta) << op_str(tb) << ", A/B type " << t[0] << ", C type " << t[1]);
        check_gemm({ta, tb, 5, 7, 9, t[0], t[1], 2.f, -1.f}, true);        // exact
        check_gemm({ta, tb, 33, 17, 65, t[0], t[1], 0.75f, 0.5f}, false);  // within fp32's bound
      }
  // Large enough that the columns are split over threads: the same bound holds.
  check_gemm({CUBLAS_OP_T, CUBLAS_OP_N, 128, 96, 160, CUDA_R_32F, CUDA_R_32F, 1.f, 0.f}, false);
}

TEST_CASE("emulated cuBLAS: beta = 0 does not read C, k = 0 gives beta C, an empty C is a no-op", "[emu]") {
  Handle h;
  const int m = 4, n = 3, k = 2;
  const std::vector<float> a = {1, 2, 3, 4, 5, 6, 7, 8}, b = {1, -1, 2, 0.5f, -3, 1};  // A 4 × 2, B 2 × 3
  float* dA = static_cast<float*>(device_bytes(a.data(), a.size() * 4));
  float* dB = static_cast<float*>(device_bytes(b.data(), b.size() * 4));
  float* dC = static_cast<float*>(device_bytes(nullptr, m * n * 4));  // fresh device memory: NaN
  const float one = 1.f, zero = 0.f, half = 0.5f;
  REQUIRE(cublasGemmEx(h.h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F, m, dB, CUDA_R_32F, k, &zero, dC,
                       CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  std::vector<float> c(m * n);
  REQUIRE(cudaMemcpy(c.data(), dC, c.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) REQUIRE(c[i + j * m] == a[i] * b[2 * j] + a[i + 4] * b[2 * j + 1]);
  // k = 0: C = beta C, and A and B are not read (null here).
  REQUIRE(cublasGemmEx(h.h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, 0, &one, nullptr, CUDA_R_32F, m, nullptr, CUDA_R_32F, 1,
                       &half, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  std::vector<float> c2(m * n);
  REQUIRE(cudaMemcpy(c2.data(), dC, c2.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int i = 0; i < m * n; ++i) REQUIRE(c2[i] == 0.5f * c[i]);
  // m = 0: nothing to compute, nothing read (C null).
  REQUIRE(cublasGemmEx(h.h, CUBLAS_OP_N, CUBLAS_OP_N, 0, n, k, &one, dA, CUDA_R_32F, 1, dB, CUDA_R_32F, k, &one,
                       nullptr, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
}

TEST_CASE("emulated cuBLAS: sums run for k ascending in fp32, one rounding per product (an FFMA)", "[emu]") {
  Handle h;
  const float e = std::ldexp(1.f, -12);
  // A 1 × 2 = [-1, 1 + e], B 2 × 1 = [1, 1 + e]. For k ascending with fused multiply-adds the sum is
  // fma(1 + e, 1 + e, -1) = 2e + e², exact. A separately rounded product (1 + 2e + e² is a tie
  // between 1 + 2e and its neighbour, to even: 1 + 2e) gives 2e, and so does k descending.
  const std::vector<float> a = {-1.f, 1.f + e}, b = {1.f, 1.f + e};
  float* dA = static_cast<float*>(device_bytes(a.data(), 8));
  float* dB = static_cast<float*>(device_bytes(b.data(), 8));
  float* dC = static_cast<float*>(device_bytes(nullptr, 4));
  const float one = 1.f, zero = 0.f;
  REQUIRE(cublasGemmEx(h.h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 2, &one, dA, CUDA_R_32F, 1, dB, CUDA_R_32F, 2, &zero, dC,
                       CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  float c = 0;
  REQUIRE(cudaMemcpy(&c, dC, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(c == 2 * e + e * e);
  // An fp32 accumulator, not a wider one: 1 + 1e8 - 1e8 loses the 1 (fp32's spacing at 1e8 is 8).
  const std::vector<float> a2 = {1.f, 1e8f, -1e8f}, b2 = {1.f, 1.f, 1.f};
  float* dA2 = static_cast<float*>(device_bytes(a2.data(), 12));
  float* dB2 = static_cast<float*>(device_bytes(b2.data(), 12));
  REQUIRE(cublasGemmEx(h.h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 3, &one, dA2, CUDA_R_32F, 1, dB2, CUDA_R_32F, 3, &zero, dC,
                       CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cudaMemcpy(&c, dC, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(c == 0.f);
  for (float* p : {dA, dB, dC, dA2, dB2}) cudaFree(p);
}

TEST_CASE("emulated cuBLAS: each invalid argument returns cuBLAS's status and is named", "[emu]") {
  Handle h;
  const int m = 8, n = 8, k = 8;
  float* dA = static_cast<float*>(device_bytes(nullptr, m * k * 4));  // exactly 256 bytes
  float* dB = static_cast<float*>(device_bytes(nullptr, k * n * 4));
  float* dC = static_cast<float*>(device_bytes(nullptr, m * n * 4));
  std::vector<float> host(m * k, 1.f);
  const float one = 1.f;
  struct Args {
    cublasHandle_t h;
    cublasOperation_t ta, tb;
    int m, n, k;
    const void *alpha, *A;
    cudaDataType at;
    int lda;
    const void* B;
    cudaDataType bt;
    int ldb;
    const void* beta;
    void* C;
    cudaDataType ct;
    int ldc;
    cublasComputeType_t compute;
    cublasGemmAlgo_t algo;
  };
  const Args ok{h.h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F, m, dB, CUDA_R_32F, k,
                &one, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT};
  auto call = [](const Args& a) {
    emu::clear_report();
    return cublasGemmEx(a.h, a.ta, a.tb, a.m, a.n, a.k, a.alpha, a.A, a.at, a.lda, a.B, a.bt, a.ldb, a.beta, a.C,
                        a.ct, a.ldc, a.compute, a.algo);
  };
  auto expect = [&](Args a, cublasStatus_t status, const char* named) {
    INFO("expects " << int(status) << " naming \"" << named << "\"");
    REQUIRE(call(a) == status);
    INFO("report: " << emu::last_report());
    REQUIRE(emu::last_report().find(named) != std::string::npos);
  };
  REQUIRE(call(ok) == CUBLAS_STATUS_SUCCESS);
  Args a = ok;
  a.h = nullptr, expect(a, CUBLAS_STATUS_NOT_INITIALIZED, "handle");
  a = ok, a.m = -1, expect(a, CUBLAS_STATUS_INVALID_VALUE, "m = -1");
  a = ok, a.n = -2, expect(a, CUBLAS_STATUS_INVALID_VALUE, "n = -2");
  a = ok, a.k = -3, expect(a, CUBLAS_STATUS_INVALID_VALUE, "k = -3");
  a = ok, a.ta = cublasOperation_t(7), expect(a, CUBLAS_STATUS_INVALID_VALUE, "transa");
  a = ok, a.lda = m - 1, expect(a, CUBLAS_STATUS_INVALID_VALUE, "lda = 7");               // N: lda >= m
  a = ok, a.ta = CUBLAS_OP_T, a.k = 4, a.lda = 3, expect(a, CUBLAS_STATUS_INVALID_VALUE, "lda = 3");  // T: >= k
  a = ok, a.ldb = k - 1, expect(a, CUBLAS_STATUS_INVALID_VALUE, "ldb = 7");
  a = ok, a.tb = CUBLAS_OP_T, a.n = 4, a.ldb = 3, expect(a, CUBLAS_STATUS_INVALID_VALUE, "ldb = 3");  // T: >= n
  a = ok, a.ldc = m - 1, expect(a, CUBLAS_STATUS_INVALID_VALUE, "ldc = 7");
  a = ok, a.m = 0, a.lda = 0, expect(a, CUBLAS_STATUS_INVALID_VALUE, "lda = 0");  // ld >= max(1, rows)
  a = ok, a.alpha = nullptr, expect(a, CUBLAS_STATUS_INVALID_VALUE, "alpha");
  a = ok, a.beta = dC, expect(a, CUBLAS_STATUS_INVALID_VALUE, "beta");  // a device pointer in host pointer mode
  a = ok, a.algo = cublasGemmAlgo_t(5000), expect(a, CUBLAS_STATUS_INVALID_VALUE, "algo");
  a = ok, a.A = host.data(), expect(a, CUBLAS_STATUS_INVALID_VALUE, "A (");                    // host memory
  a = ok, a.lda = m + 1, expect(a, CUBLAS_STATUS_INVALID_VALUE, "past the end");              // A too short
  a = ok, a.C = dA, expect(a, CUBLAS_STATUS_INVALID_VALUE, "overlaps");                       // C is A
  a = ok, a.bt = CUDA_R_16BF, expect(a, CUBLAS_STATUS_NOT_SUPPORTED, "not a combination");    // A fp32, B bf16
  a = ok, a.at = a.bt = CUDA_R_16F, expect(a, CUBLAS_STATUS_NOT_SUPPORTED, "does not implement");
  a = ok, a.compute = CUBLAS_COMPUTE_32F_FAST_TF32, expect(a, CUBLAS_STATUS_NOT_SUPPORTED, "does not implement");
  cublasHandle_t dead;
  REQUIRE(cublasCreate(&dead) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasDestroy(dead) == CUBLAS_STATUS_SUCCESS);
  a = ok, a.h = dead, expect(a, CUBLAS_STATUS_NOT_INITIALIZED, "not a live handle");
  REQUIRE(cublasSetAtomicsMode(h.h, cublasAtomicsMode_t(2)) == CUBLAS_STATUS_INVALID_VALUE);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
}

TEST_CASE("emulated cuBLAS: the product runs on the handle's stream, late", "[emu]") {
  Handle h;
  cudaStream_t s;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  REQUIRE(cublasSetStream(h.h, s) == CUBLAS_STATUS_SUCCESS);
  cudaStream_t got = nullptr;
  REQUIRE(cublasGetStream(h.h, &got) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(got == s);
  const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8}, c0 = {-1, -1, -1, -1};  // 2 × 2 each
  float* dA = static_cast<float*>(device_bytes(a.data(), 16));
  float* dB = static_cast<float*>(device_bytes(b.data(), 16));
  float* dC = static_cast<float*>(device_bytes(c0.data(), 16));
  const float one = 1.f, zero = 0.f;
  REQUIRE(cublasGemmEx(h.h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, dA, CUDA_R_32F, 2, dB, CUDA_R_32F, 2, &zero, dC,
                       CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  // The emulator runs queued work only once something observes it (emu.h): C, read straight from
  // the emulated device's memory, is still what it was. (On a GPU it may or may not be done yet.)
  for (int i = 0; i < 4; ++i) REQUIRE(dC[i] == -1.f);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::vector<float> c(4);
  REQUIRE(cudaMemcpy(c.data(), dC, 16, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(c == std::vector<float>{1 * 5 + 3 * 6, 2 * 5 + 4 * 6, 1 * 7 + 3 * 8, 2 * 7 + 4 * 8});
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

// ===== cuBLASLt FP8 ==================================================================================

namespace {

// The OCP 8-bit formats from the spec's formula (OFP8 §4): (-1)^s · 2^(e - bias) · (1 + f / 2^M)
// for e > 0, (-1)^s · 2^(1 - bias) · f / 2^M for e = 0; E5M2's e = 31 is infinity or NaN, E4M3's
// only special is S.1111.111 (NaN).
double ocp_value(uint8_t code, bool e5m2) {
  const int E = e5m2 ? 5 : 4, M = e5m2 ? 2 : 3, bias = (1 << (E - 1)) - 1;
  const int s = code >> 7, e = (code >> M) & ((1 << E) - 1), f = code & ((1 << M) - 1);
  const double sign = s ? -1.0 : 1.0;
  if (e5m2 && e == 31) return f ? std::nan("") : sign * HUGE_VAL;
  if (!e5m2 && e == 15 && f == 7) return std::nan("");
  if (e == 0) return sign * std::pow(2.0, 1 - bias) * f / (1 << M);
  return sign * std::pow(2.0, e - bias) * (1.0 + double(f) / (1 << M));
}
bool finite_code(uint8_t c, bool e5m2) { return e5m2 ? (c & 0x7c) != 0x7c : (c & 0x7f) != 0x7f; }

// Descriptors for D = op(A) op(B) + C of the given types, op(A) m × k and op(B) k × n.
struct Lt {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  Lt(cudaDataType at, cudaDataType bt, cudaDataType ct, int m, int n, int k, int lda, int ldb, int ldc,
     cublasOperation_t ta = CUBLAS_OP_T, cublasOperation_t tb = CUBLAS_OP_N,
     cublasComputeType_t compute = CUBLAS_COMPUTE_32F) {
    REQUIRE(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescCreate(&op, compute, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == CUBLAS_STATUS_SUCCESS);
    const bool t = ta != CUBLAS_OP_N, u = tb != CUBLAS_OP_N;
    REQUIRE(cublasLtMatrixLayoutCreate(&a, at, t ? k : m, t ? m : k, lda) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&b, bt, u ? n : k, u ? k : n, ldb) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&c, ct, m, n, ldc) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
    const uint64_t ws = 1 << 20;
    REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
            CUBLAS_STATUS_SUCCESS);
  }
  ~Lt() {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(h);
  }
  // The heuristic's answer: its status, and how many algorithms it returned in *out.
  cublasStatus_t heuristic(cublasLtMatmulHeuristicResult_t* out, int* found) {
    emu::clear_report();
    return cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref, 1, out, found);
  }
};

// Random finite codes of a format, laid out column-major rows × cols with leading dimension ld
// (padding: NaN codes, which must not be read).
std::vector<uint8_t> random_codes(Lcg& rng, bool e5m2, int rows, int cols, int ld) {
  std::vector<uint8_t> q(size_t(ld) * cols, 0xff);
  for (int j = 0; j < cols; ++j)
    for (int i = 0; i < rows; ++i) {
      uint8_t c;
      do c = uint8_t(rng.next()); while (!finite_code(c, e5m2));
      q[size_t(i + j * ld)] = c;
    }
  return q;
}

struct Fp8Case {
  bool a_e5m2, b_e5m2;
  cudaDataType out;
  int m, n, k;
  float alpha, beta, scale_a, scale_b;
};

// One TN FP8 matmul with C = D in place, against the decode-then-multiply loop in double.
void check_fp8(const Fp8Case& t) {
  const cudaDataType at = t.a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, bt = t.b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
  const int lda = t.k + 16, ldb = t.k, ldc = t.m + 16;  // A padded, C padded (all multiples of 16 bytes)
  Lcg rng{uint64_t(t.m * 7 + t.n * 5 + t.k * 3 + t.a_e5m2 * 2 + t.b_e5m2 + t.out)};
  const std::vector<uint8_t> qa = random_codes(rng, t.a_e5m2, t.k, t.m, lda);
  const std::vector<uint8_t> qb = random_codes(rng, t.b_e5m2, t.k, t.n, ldb);
  HostMat C(t.m, t.n, ldc, kSentinel);
  for (int j = 0; j < t.n; ++j)
    for (int i = 0; i < t.m; ++i) C.at(i, j) = round_to(t.out, t.beta != 0 ? rng.uniform() * 100 : kNaN);
  const size_t c_bytes = C.v.size() * (t.out == CUDA_R_32F ? 4 : 2);
  void* dA = device_bytes(qa.data(), qa.size());
  void* dB = device_bytes(qb.data(), qb.size());
  void* dC = device_bytes(encode(C.v, t.out).data(), c_bytes);
  const float scales[2] = {t.scale_a, t.scale_b};
  float* dS = static_cast<float*>(device_bytes(scales, 8));
  void* ws = device_bytes(nullptr, 1 << 20);
  Lt lt(at, bt, t.out, t.m, t.n, t.k, lda, ldb, ldc);
  const float* sa = dS;
  const float* sb = dS + 1;
  REQUIRE(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa) == 0);
  REQUIRE(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb) == 0);
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  REQUIRE(lt.heuristic(&heur, &found) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(found == 1);
  REQUIRE(cublasLtMatmul(lt.h, lt.op, &t.alpha, dA, lt.a, dB, lt.b, &t.beta, dC, lt.c, dC, lt.c, &heur.algo, ws,
                         1 << 20, nullptr) == CUBLAS_STATUS_SUCCESS);
  const std::vector<float> d = decode(host_bytes(dC, c_bytes), t.out);
  const double u = std::ldexp(1.0, -24), scale = double(t.alpha) * t.scale_a * t.scale_b;
  for (int j = 0; j < t.n; ++j) {
    for (int i = 0; i < t.m; ++i) {
      double s = 0, mag = 0;
      for (int q = 0; q < t.k; ++q) {
        const double p = ocp_value(qa[size_t(q + i * lda)], t.a_e5m2) * ocp_value(qb[size_t(q + j * ldb)], t.b_e5m2);
        s += p;
        mag += std::fabs(p);
      }
      const double c = t.beta != 0 ? double(t.beta) * C.at(i, j) : 0.0;
      const double want = scale * s + c;
      double bound = (t.k + 3) * u * (std::fabs(scale) * mag + std::fabs(c));
      if (t.out == CUDA_R_16BF) bound += std::ldexp(std::fabs(want), -8);
      INFO("D(" << i << ", " << j << ") = " << d[size_t(i + j * ldc)] << ", want " << want);
      REQUIRE(std::fabs(double(d[size_t(i + j * ldc)]) - want) <= bound);
    }
    for (int i = t.m; i < ldc; ++i) REQUIRE(d[size_t(i + j * ldc)] == round_to(t.out, kSentinel));
  }
  for (void* p : {dA, dB, dC, static_cast<void*>(dS), ws}) cudaFree(p);
}

}  // namespace

TEST_CASE("emulated cuBLASLt: the emulated device is an sm_90, where FP8 matmuls are native", "[emu]") {
  int dev = -1, major = 0, minor = 0;
  REQUIRE(cudaGetDevice(&dev) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess);
  REQUIRE(10 * major + minor == 90);
}

TEST_CASE("emulated cuBLASLt: FP8 TN matmul with scale pointers against decode-then-multiply", "[emu]") {
  for (cudaDataType out : {CUDA_R_32F, CUDA_R_16BF}) {
    INFO("output " << out);
    check_fp8({false, false, out, 32, 16, 48, 0.25f, 1.f, 0.5f, 4.f});  // e4m3 × e4m3, accumulating into C
    check_fp8({false, true, out, 16, 48, 32, 1.f, 0.f, 2.f, 0.125f});   // e4m3 × e5m2, C (NaN) not read
    check_fp8({true, false, out, 48, 32, 16, -0.5f, 2.f, 1.f, 1.f});    // e5m2 × e4m3
  }
}

TEST_CASE("emulated cuBLASLt: all 256 codes of both formats decode as the OCP spec says", "[emu]") {
  // Spot values from the spec: the largest finite values, the smallest subnormals, one, zeros.
  REQUIRE(ocp_value(0x7e, false) == 448.0);
  REQUIRE(ocp_value(0x7b, true) == 57344.0);
  REQUIRE(ocp_value(0x01, false) == std::ldexp(1.0, -9));
  REQUIRE(ocp_value(0x01, true) == std::ldexp(1.0, -16));
  REQUIRE(ocp_value(0x38, false) == 1.0);
  REQUIRE(ocp_value(0x3c, true) == 1.0);
  REQUIRE(std::signbit(ocp_value(0x80, false)));
  // D [256, 16] = Aᵀ B with A's column i holding code i in its first row (zeros below) and B's first
  // row e4m3 1.0: D(i, j) is code i's value.
  const int m = 256, n = 16, k = 16;
  std::vector<uint8_t> qa(size_t(k) * m, 0), qb(size_t(k) * n, 0);
  for (int i = 0; i < m; ++i) qa[size_t(i * k)] = uint8_t(i);
  for (int j = 0; j < n; ++j) qb[size_t(j * k)] = 0x38;
  void* dB = device_bytes(qb.data(), qb.size());
  for (bool e5m2 : {false, true}) {
    void* dA = device_bytes(qa.data(), qa.size());
    float* dD = static_cast<float*>(device_bytes(nullptr, size_t(m) * n * 4));
    Lt lt(e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, m, n, k, k, k, m);
    const float one = 1.f, zero = 0.f;
    REQUIRE(cublasLtMatmul(lt.h, lt.op, &one, dA, lt.a, dB, lt.b, &zero, dD, lt.c, dD, lt.c, nullptr, nullptr, 0,
                           nullptr) == CUBLAS_STATUS_SUCCESS);
    std::vector<float> d(size_t(m) * n);
    REQUIRE(cudaMemcpy(d.data(), dD, d.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const double want = ocp_value(uint8_t(i), e5m2);
        INFO((e5m2 ? "e5m2" : "e4m3") << " code " << i);
        if (std::isnan(want))
          REQUIRE(std::isnan(d[size_t(i + j * m)]));
        else
          REQUIRE(double(d[size_t(i + j * m)]) == want);
      }
    cudaFree(dA);
    cudaFree(dD);
  }
  cudaFree(dB);
}

TEST_CASE("emulated cuBLASLt: the scale pointers are read when the matmul runs, not at the call", "[emu]") {
  const int m = 16, n = 16, k = 16;
  std::vector<uint8_t> qa(size_t(k) * m, 0x38), qb(size_t(k) * n, 0x38);  // all ones: D = 16 · scales
  void* dA = device_bytes(qa.data(), qa.size());
  void* dB = device_bytes(qb.data(), qb.size());
  float* dD = static_cast<float*>(device_bytes(nullptr, m * n * 4));
  const float one = 1.f, zero = 0.f;
  float* dS = static_cast<float*>(device_bytes(&one, 4));
  cudaStream_t s;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  Lt lt(CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, m, n, k, k, k, m);
  REQUIRE(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dS, sizeof dS) == 0);
  REQUIRE(cublasLtMatmul(lt.h, lt.op, &one, dA, lt.a, dB, lt.b, &zero, dD, lt.c, dD, lt.c, nullptr, nullptr, 0, s) ==
          CUBLAS_STATUS_SUCCESS);
  // Late execution (emu.h): the queued matmul has not run, so a scale written now is the one it reads.
  REQUIRE(std::isnan(dD[0]));
  *dS = 3.f;
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::vector<float> d(m * n);
  REQUIRE(cudaMemcpy(d.data(), dD, d.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (float v : d) REQUIRE(v == 48.f);
  // A scale on the host is refused: the kernel reads it on the device.
  float host_scale = 1.f;
  const float* hs = &host_scale;
  REQUIRE(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &hs, sizeof hs) == 0);
  emu::clear_report();
  REQUIRE(cublasLtMatmul(lt.h, lt.op, &one, dA, lt.a, dB, lt.b, &zero, dD, lt.c, dD, lt.c, nullptr, nullptr, 0, s) ==
          CUBLAS_STATUS_INVALID_VALUE);
  REQUIRE(emu::last_report().find("A_SCALE_POINTER") != std::string::npos);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  for (void* p : {dA, dB, static_cast<void*>(dD), static_cast<void*>(dS)}) cudaFree(p);
}

TEST_CASE("emulated cuBLASLt: no algorithm for what NVIDIA's FP8 rules exclude", "[emu]") {
  const cudaDataType e4 = CUDA_R_8F_E4M3, e5 = CUDA_R_8F_E5M2;
  struct Refused {
    const char* what;
    Lt* lt;
    const char* named;
  };
  // The supported case first, so each refusal below differs from it in one thing.
  Lt tn(e4, e4, CUDA_R_32F, 32, 32, 32, 32, 32, 32);
  Lt nn(e4, e4, CUDA_R_32F, 32, 32, 32, 32, 32, 32, CUBLAS_OP_N, CUBLAS_OP_N);
  Lt tt(e4, e4, CUDA_R_32F, 32, 32, 32, 32, 32, 32, CUBLAS_OP_T, CUBLAS_OP_T);
  Lt e5e5(e5, e5, CUDA_R_32F, 32, 32, 32, 32, 32, 32);
  Lt m24(e4, e4, CUDA_R_32F, 24, 32, 32, 32, 32, 32);
  Lt n8(e4, e4, CUDA_R_32F, 32, 8, 32, 32, 32, 32);
  Lt k40(e4, e4, CUDA_R_32F, 32, 32, 40, 48, 48, 32);
  Lt lda40(e4, e4, CUDA_R_32F, 32, 32, 32, 40, 32, 32);
  Lt ldc36(e4, e4, CUDA_R_32F, 32, 32, 32, 32, 32, 36);  // 36 fp32: 144 bytes, a multiple of 16: fine
  Lt ldc34(e4, e4, CUDA_R_32F, 32, 32, 32, 32, 32, 34);  // 136 bytes: not
  Lt tf32(e4, e4, CUDA_R_32F, 32, 32, 32, 32, 32, 32, CUBLAS_OP_T, CUBLAS_OP_N, CUBLAS_COMPUTE_32F_FAST_TF32);
  Lt f16(e4, e4, CUDA_R_16F, 32, 32, 32, 32, 32, 32);
  Lt bf16in(CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, 32, 32, 32, 32, 32, 32);
  cublasLtMatmulHeuristicResult_t heur;
  int found = -1;
  REQUIRE(tn.heuristic(&heur, &found) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(found == 1);
  REQUIRE(heur.state == CUBLAS_STATUS_SUCCESS);
  REQUIRE(ldc36.heuristic(&heur, &found) == CUBLAS_STATUS_SUCCESS);
  const Refused refused[] = {{"NN", &nn, "TN"},
                             {"TT", &tt, "TN"},
                             {"e5m2 x e5m2", &e5e5, "E5M2"},
                             {"m = 24", &m24, "multiples of 16"},
                             {"n = 8", &n8, "multiples of 16"},
                             {"k = 40", &k40, "multiples of 16"},
                             {"lda = 40", &lda40, "16 bytes"},
                             {"ldc = 34 floats", &ldc34, "16 bytes"},
                             {"compute 32F_FAST_TF32", &tf32, "CUBLAS_COMPUTE_32F"},
                             {"fp16 output", &f16, "C and D"},
                             {"bf16 inputs", &bf16in, "FP8"}};
  for (const Refused& r : refused) {
    found = -1;
    const cublasStatus_t st = r.lt->heuristic(&heur, &found);
    INFO(r.what << ": " << emu::last_report());
    REQUIRE(st == CUBLAS_STATUS_NOT_SUPPORTED);
    REQUIRE(found == 0);
    REQUIRE(emu::last_report().find(r.named) != std::string::npos);
  }
  // cublasLtMatmul itself refuses them too, with or without an algorithm.
  const float one = 1.f;
  REQUIRE(cublasLtMatmul(nn.h, nn.op, &one, nullptr, nn.a, nullptr, nn.b, &one, nullptr, nn.c, nullptr, nn.c, nullptr,
                         nullptr, 0, nullptr) == CUBLAS_STATUS_NOT_SUPPORTED);
  // Malformed queries: no room for results, shapes that do not compose.
  REQUIRE(cublasLtMatmulAlgoGetHeuristic(tn.h, tn.op, tn.a, tn.b, tn.c, tn.c, tn.pref, 0, &heur, &found) ==
          CUBLAS_STATUS_INVALID_VALUE);
  REQUIRE(cublasLtMatmulAlgoGetHeuristic(tn.h, tn.op, tn.a, tn.b, m24.c, m24.c, tn.pref, 1, &heur, &found) ==
          CUBLAS_STATUS_INVALID_VALUE);
  REQUIRE(emu::last_report().find("do not compose") != std::string::npos);
  const int8_t wrong_size = 1;  // TRANSA is an int32_t
  REQUIRE(cublasLtMatmulDescSetAttribute(tn.op, CUBLASLT_MATMUL_DESC_TRANSA, &wrong_size, 1) ==
          CUBLAS_STATUS_INVALID_VALUE);
}

TEST_CASE("emulated cuBLASLt: operands must be device memory, aligned as the preference promised", "[emu]") {
  const int m = 32, n = 32, k = 32;
  std::vector<uint8_t> q(8192, 0x38);  // room for D (32 × 32 floats) too
  uint8_t* dA = static_cast<uint8_t*>(device_bytes(q.data(), q.size()));
  void* dB = device_bytes(q.data(), q.size());
  float* dD = static_cast<float*>(device_bytes(nullptr, m * n * 4 + 256));
  const float one = 1.f, zero = 0.f;
  Lt lt(CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, m, n, k, k, k, m);
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  REQUIRE(lt.heuristic(&heur, &found) == CUBLAS_STATUS_SUCCESS);
  auto matmul = [&](const void* A, const void* hostB, void* D) {
    emu::clear_report();
    return cublasLtMatmul(lt.h, lt.op, &one, A, lt.a, hostB ? hostB : dB, lt.b, &zero, D, lt.c, D, lt.c, &heur.algo,
                          nullptr, 0, nullptr);
  };
  // The default preference promises 256-byte aligned matrices; A 16 bytes in breaks the promise.
  REQUIRE(matmul(dA + 16, nullptr, dD) == CUBLAS_STATUS_INVALID_VALUE);
  REQUIRE(emu::last_report().find("256-byte aligned") != std::string::npos);
  REQUIRE(matmul(dA, q.data(), dD) == CUBLAS_STATUS_INVALID_VALUE);  // B on the host
  REQUIRE(emu::last_report().find("not device memory") != std::string::npos);
  REQUIRE(matmul(dA, nullptr, dA) == CUBLAS_STATUS_INVALID_VALUE);  // D over A
  REQUIRE(emu::last_report().find("overlaps") != std::string::npos);
  // Told to expect 16-byte alignment, the heuristic's algorithm takes it.
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    const uint32_t sixteen = 16;
    REQUIRE(cublasLtMatmulPreferenceSetAttribute(lt.pref, attr, &sixteen, sizeof sixteen) == CUBLAS_STATUS_SUCCESS);
  }
  REQUIRE(lt.heuristic(&heur, &found) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(matmul(dA + 16, nullptr, dD + 4) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<float> d(m * n);
  REQUIRE(cudaMemcpy(d.data(), dD + 4, d.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (float v : d) REQUIRE(v == float(k));
  for (void* p : {static_cast<void*>(dA), dB, static_cast<void*>(dD)}) cudaFree(p);
}

#endif  // TS_CUDA_EMU
