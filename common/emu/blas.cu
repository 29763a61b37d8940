// blas.cu — the emulated GPU's cuBLAS (cublasGemmEx) and cuBLASLt (the FP8 matmul), on the CPU.
//
// Every call is checked as NVIDIA's cuBLAS documentation says the library checks it, and returns
// the status the documentation gives for each failure. The emulator also checks what the real
// library cannot see and leaves to a fault or to garbage: an operand that is host memory or shorter
// than its dimensions say, a pointer less aligned than the caller promised, an output that overlaps
// an input. Every refusal is reported by name (emu::report), so a test can tell which rule failed.
//
// The product itself runs as a kernel would: queued on the stream (emu::enqueue), late, in stream
// order, reading its operands only then. It is computed in fp32 with one fixed order, the products
// of each output added for k ascending, each with a single rounding (std::fma, the GPU's FFMA), so
// results are reproducible: they do not depend on the host compiler or on how many threads run.
#include "cublasLt.h"
#include "cublas_v2.h"
#include "tensor/core.h"  // bf16 as the project rounds it
#include "kernels/fp8.h"   // and its FP8 codes
#include "emu.h"
#include "tsan.h"  // SANITIZE=thread: the product's reads and writes, declared
#include "shadow.h"  // the memcheck build: D is written

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

// ===== the library's objects =======================================================================
// Opaque to the caller (the headers only declare them); each one lives in a registry from its
// Create to its Destroy, so a null, destroyed or made-up handle is refused instead of read.

struct cublasContext {
  cudaStream_t stream = nullptr;  // a new handle works on the null stream
  cublasAtomicsMode_t atomics = CUBLAS_ATOMICS_NOT_ALLOWED;
};
struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  int32_t compute = CUBLAS_COMPUTE_32F, scale_type = CUDA_R_32F, pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N, sm_count = 0;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* scale_a = nullptr;  // device floats, or null for 1
  const void* scale_b = nullptr;
  int8_t fast_accum = 0;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint32_t search_mode = 0;
  uint64_t max_workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: the documented default
};

namespace {

std::mutex g_live_mu;
std::unordered_set<const void*> g_live;

template <class T> T* create_object() {
  T* x = new T();
  std::lock_guard<std::mutex> lk(g_live_mu);
  g_live.insert(x);
  return x;
}
bool live(const void* x) {
  std::lock_guard<std::mutex> lk(g_live_mu);
  return x && g_live.count(x);
}
template <class T> void destroy_object(T* x) {
  {
    std::lock_guard<std::mutex> lk(g_live_mu);
    g_live.erase(x);
  }
  delete x;
}

// ===== element types =================================================================================

size_t type_bytes(cudaDataType t) {
  switch (t) {
    case CUDA_R_64F: return 8;
    case CUDA_R_32F: case CUDA_R_32I: return 4;
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    case CUDA_R_8I: case CUDA_R_8F_E4M3: case CUDA_R_8F_E5M2: return 1;
    default: return 0;
  }
}
const char* type_name(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_8I: return "CUDA_R_8I";
    case CUDA_R_32I: return "CUDA_R_32I";
    case CUDA_R_8F_E4M3: return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2: return "CUDA_R_8F_E5M2";
    default: return "an unlisted cudaDataType";
  }
}
bool is_fp8(cudaDataType t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

// bf16 as the project rounds it everywhere (core.h): nearest, ties to even, NaN kept quiet, as
// the hardware's cvt.rn.bf16.f32 does.
float bf16_to_float(uint16_t h) { return ts::bf16_to_float(ts::bf16{h}); }
uint16_t float_to_bf16(float f) { return ts::float_to_bf16(f).bits; }

// The OCP 8-bit floats cuBLASLt calls CUDA_R_8F_E4M3 and CUDA_R_8F_E5M2, decoded as the project
// decodes them everywhere (fp8.h): all 256 values of each format once, every one exact in fp32.
std::vector<float> fp8_values(float (*decode)(uint8_t)) {
  std::vector<float> t(256);
  for (int c = 0; c < 256; ++c) t[size_t(c)] = decode(uint8_t(c));
  return t;
}
const float* fp8_table(bool e5m2) {
  static const std::vector<float> e4m3 = fp8_values(ts::fp8::decode_e4m3), e5m2_values = fp8_values(ts::fp8::decode_e5m2);
  return e5m2 ? e5m2_values.data() : e4m3.data();
}

// Element i of a typed array, as a float (only the types the products below read and write).
float load(const void* p, cudaDataType t, int64_t i) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_16BF: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case CUDA_R_8F_E4M3: return fp8_table(false)[static_cast<const uint8_t*>(p)[i]];
    case CUDA_R_8F_E5M2: return fp8_table(true)[static_cast<const uint8_t*>(p)[i]];
    default: return NAN;
  }
}
void store(void* p, cudaDataType t, int64_t i, float v) {
  if (t == CUDA_R_32F)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);  // CUDA_R_16BF, the only other output type
}

// ===== the product ===================================================================================

// A column-major matrix as stored: rows × cols, column j starting at element j · ld.
struct Mat {
  const void* p = nullptr;
  cudaDataType type = CUDA_R_32F;
  int64_t rows = 0, cols = 0, ld = 1;
  // The bytes from its first element to its last, the extent it must have in device memory.
  size_t span() const { return rows && cols ? size_t((cols - 1) * ld + rows) * type_bytes(type) : 0; }
};

// One queued product: D = alpha · scale_a · scale_b · op(A) op(B) + beta · C, op(A) m × k and
// op(B) k × n. C is read only when beta != 0, and may be D itself (then with D's layout).
struct Product {
  const char* fn;  // the call that queued it, for reports
  Mat a, b, c, d;
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.f, beta = 0.f;
  const float* scale_a = nullptr;  // device pointers read when the product runs; null: 1
  const float* scale_b = nullptr;
};

// op(X) widened to fp32, dense column-major (rows of op(X) × its columns).
std::vector<float> widen(const Mat& x, bool trans) {
  const int64_t r = trans ? x.cols : x.rows, c = trans ? x.rows : x.cols;
  std::vector<float> out(size_t(r * c));
  for (int64_t j = 0; j < c; ++j)
    for (int64_t i = 0; i < r; ++i) out[size_t(i + j * r)] = load(x.p, x.type, trans ? j + i * x.ld : i + j * x.ld);
  return out;
}

// A queued product's memory may have been freed, or the device may have faulted, between the call
// and the moment the product runs; the hardware would fault there, so the emulator does.
bool still_device(const Product& p, const char* name, const void* ptr, size_t bytes) {
  if (!ptr || !bytes || emu::is_device(ptr, bytes)) return true;
  emu::device_fault(cudaErrorIllegalAddress, "%s: %s (%p) was freed before the queued product ran", p.fn, name, ptr);
  return false;
}

// SANITIZE=thread: a matrix's columns (ld apart), read or written by the product's stream thread.
void declare(const Mat& x, bool write) {
  const size_t es = type_bytes(x.type);
  for (int64_t j = 0; x.p && j < x.cols; ++j) {
    char* col = static_cast<char*>(const_cast<void*>(x.p)) + size_t(j * x.ld) * es;
    write ? emu::tsan::write(col, size_t(x.rows) * es) : emu::tsan::read(col, size_t(x.rows) * es);
  }
}

void run_product(const Product& p) {
  if (!still_device(p, "A", p.a.p, p.a.span()) || !still_device(p, "B", p.b.p, p.b.span()) ||
      !still_device(p, "C", p.beta != 0.f ? p.c.p : nullptr, p.c.span()) ||
      !still_device(p, "D", p.d.p, p.d.span()) || !still_device(p, "the A scale", p.scale_a, 4) ||
      !still_device(p, "the B scale", p.scale_b, 4))
    return;
  if (emu::tsan::kOn) {
    declare(p.a, false), declare(p.b, false), declare(p.d, true);
    if (p.beta != 0.f) declare(p.c, false);
    if (p.scale_a) emu::tsan::read(p.scale_a, 4);
    if (p.scale_b) emu::tsan::read(p.scale_b, 4);
  }
  // The scales are read here, on the stream, as the hardware reads them: not when the call was made.
  const float scale = p.alpha * (p.scale_a ? *p.scale_a : 1.f) * (p.scale_b ? *p.scale_b : 1.f);
  const std::vector<float> A = widen(p.a, p.ta), B = widen(p.b, p.tb);  // m × k and k × n
  const int64_t m = p.m, n = p.n, k = p.k;
  void* d = const_cast<void*>(p.d.p);
  // Columns are independent, so splitting them over threads changes no result.
#pragma omp parallel for schedule(static) if (m * n * k > (int64_t(1) << 20))
  for (int64_t j = 0; j < n; ++j) {
    std::vector<float> acc(size_t(m), 0.f);
    for (int64_t q = 0; q < k; ++q) {
      const float bq = B[size_t(q + j * k)];
      const float* aq = &A[size_t(q * m)];
      for (int64_t i = 0; i < m; ++i) acc[size_t(i)] = std::fma(aq[i], bq, acc[size_t(i)]);  // k ascending
    }
    for (int64_t i = 0; i < m; ++i) {
      float v = scale * acc[size_t(i)];
      if (p.beta != 0.f) v = std::fma(p.beta, load(p.c.p, p.c.type, i + j * p.c.ld), v);  // beta 0: C unread
      store(d, p.d.type, i + j * p.d.ld, v);
    }
  }
  const size_t es = type_bytes(p.d.type);
  for (int64_t j = 0; emu::shadow::on() && j < n; ++j) emu::shadow::written(static_cast<char*>(d) + size_t(j * p.d.ld) * es, size_t(m) * es);
}

// ===== checks shared by both libraries ================================================================

// A matrix the product reads or writes must lie in one device allocation, whole. The real library
// would fault on a host pointer, or read past the end of a short one; the emulator refuses it.
bool check_matrix(const char* fn, const char* name, const Mat& x, uint32_t align = 1) {
  if (!x.p) {
    emu::report("%s: %s is null", fn, name);
    return false;
  }
  if (!emu::is_device(x.p, 1)) {
    emu::report("%s: %s (%p) is not device memory (a host pointer?); cuBLAS reads its operands on the GPU", fn,
                name, x.p);
    return false;
  }
  if (!emu::is_device(x.p, x.span())) {
    emu::report("%s: %s (%p), %lld x %lld with leading dimension %lld, spans %zu bytes: past the end of its "
                "cudaMalloc allocation",
                fn, name, x.p, (long long)x.rows, (long long)x.cols, (long long)x.ld, x.span());
    return false;
  }
  if (uintptr_t(x.p) % align) {
    emu::report("%s: %s (%p) is not %u-byte aligned, as the algorithm was chosen for", fn, name, x.p, align);
    return false;
  }
  return true;
}

// Whether two matrices' byte ranges overlap (an output overlapping an input races on the GPU).
bool overlap(const Mat& x, const Mat& y) {
  const uintptr_t a = uintptr_t(x.p), b = uintptr_t(y.p);
  return x.span() && y.span() && a < b + y.span() && b < a + x.span();
}
bool check_no_overlap(const char* fn, const char* out, const Mat& o, const char* in, const Mat& i) {
  if (!overlap(o, i)) return true;
  emu::report("%s: the output %s (%p) overlaps the input %s (%p); the product would read what it overwrites", fn, out,
              o.p, in, i.p);
  return false;
}

// alpha and beta are read on the host at the call (CUBLAS_POINTER_MODE_HOST, the default, and
// CUBLASLT_POINTER_MODE_HOST); a device pointer there would be dereferenced on the host.
bool check_host_scalar(const char* fn, const char* name, const void* p) {
  if (!p) {
    emu::report("%s: %s is null", fn, name);
    return false;
  }
  if (emu::is_device(p, 1)) {
    emu::report("%s: %s (%p) is a device pointer, but the pointer mode is host: it is read on the host", fn, name, p);
    return false;
  }
  return true;
}

}  // namespace

// ===== cuBLAS ==========================================================================================

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  emu::cover("cublas cublasCreate");
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = nullptr;
  if (emu::sticky_error() != cudaSuccess) {
    emu::report("cublasCreate: the device has a sticky error (%s)", cudaGetErrorName(emu::sticky_error()));
    return CUBLAS_STATUS_NOT_INITIALIZED;  // "the CUDA Runtime initialization failed"
  }
  *handle = create_object<cublasContext>();
  return CUBLAS_STATUS_SUCCESS;
}

// A handle that is null or not live: every call but cublasCreate returns NOT_INITIALIZED for it.
static bool check_handle(const char* fn, const void* handle) {
  if (live(handle)) return true;
  emu::report("%s: the handle (%p) is %s", fn, handle, handle ? "not a live handle (destroyed?)" : "null");
  return false;
}

// "cublasDestroy(): ... will implicitly call cudaDeviceSynchronize()".
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  emu::cover("cublas cublasDestroy");
  if (!check_handle("cublasDestroy", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  cudaDeviceSynchronize();
  destroy_object(handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  emu::cover("cublas cublasSetStream");
  if (!check_handle("cublasSetStream", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  emu::cover("cublas cublasGetStream");
  if (!check_handle("cublasGetStream", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode) {
  emu::cover("cublas cublasSetAtomicsMode");
  if (!check_handle("cublasSetAtomicsMode", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_ATOMICS_NOT_ALLOWED && mode != CUBLAS_ATOMICS_ALLOWED) {
    emu::report("cublasSetAtomicsMode: mode %d is not a cublasAtomicsMode_t", int(mode));
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->atomics = mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t* mode) {
  emu::cover("cublas cublasGetAtomicsMode");
  if (!check_handle("cublasGetAtomicsMode", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->atomics;
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

const char* op_name(int op) {
  return op == CUBLAS_OP_N ? "CUBLAS_OP_N" : op == CUBLAS_OP_T ? "CUBLAS_OP_T" : "CUBLAS_OP_C";
}

// cublasGemmEx's table of type combinations ("cublasGemmEx()": computeType, scaleType,
// Atype/Btype, Ctype), and which of them the emulator computes. Returns SUCCESS, NOT_SUPPORTED for
// a combination the table lacks ("the combination of the parameters Atype, Btype and Ctype ... is
// not supported"), or NOT_SUPPORTED for a listed one the emulator does not implement, saying so.
cublasStatus_t gemm_types(cudaDataType a, cudaDataType b, cudaDataType c, cublasComputeType_t compute) {
  emu::cover("cublas gemm_types");
  auto is = [compute](cublasComputeType_t x, cublasComputeType_t pedantic) {
    return compute == x || compute == pedantic;
  };
  const bool c32f = is(CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC);
  // The combinations the project uses, computed here with fp32 products and sums.
  const bool bf16_in = a == CUDA_R_16BF && (c == CUDA_R_16BF || c == CUDA_R_32F);
  if (c32f && a == b && ((a == CUDA_R_32F && c == CUDA_R_32F) || bf16_in)) return CUBLAS_STATUS_SUCCESS;
  // The table's other real rows.
  const bool fast = compute == CUBLAS_COMPUTE_32F_FAST_16F || compute == CUBLAS_COMPUTE_32F_FAST_16BF ||
                    compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  const bool c16f = is(CUBLAS_COMPUTE_16F, CUBLAS_COMPUTE_16F_PEDANTIC);
  const bool c64f = is(CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC);
  const bool c32i = is(CUBLAS_COMPUTE_32I, CUBLAS_COMPUTE_32I_PEDANTIC);
  const bool listed = a == b && ((c32f && a == CUDA_R_16F && (c == CUDA_R_16F || c == CUDA_R_32F)) ||
                                 (c32f && a == CUDA_R_8I && c == CUDA_R_32F) ||
                                 (fast && a == CUDA_R_32F && c == CUDA_R_32F) ||
                                 (c16f && a == CUDA_R_16F && c == a) || (c64f && a == CUDA_R_64F && c == a) ||
                                 (c32i && a == CUDA_R_8I && c == CUDA_R_32I));
  emu::report("cublasGemmEx: Atype %s, Btype %s, Ctype %s with compute type %d: %s", type_name(a), type_name(b),
              type_name(c), int(compute),
              listed ? "cuBLAS supports it but the emulated cuBLAS does not implement it"
                     : "not a combination cuBLAS supports");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

// The argument checks cublasGemmEx documents as CUBLAS_STATUS_INVALID_VALUE: negative sizes, an
// operation that is not N, T or C, leading dimensions below the rows of the matrix as stored, an
// unknown algorithm, null alpha or beta.
cublasStatus_t gemm_arguments(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb,
                              int ldc, const void* alpha, const void* beta, cublasGemmAlgo_t algo) {
  emu::cover("cublas gemm_arguments");
  const char* fn = "cublasGemmEx";
  auto bad = [&](const char* what, long long v, long long least) {
    emu::report("%s: %s = %lld, below %lld", fn, what, v, least);
    return CUBLAS_STATUS_INVALID_VALUE;
  };
  for (auto [name, op] : {std::pair<const char*, int>{"transa", ta}, {"transb", tb}})
    if (op != CUBLAS_OP_N && op != CUBLAS_OP_T && op != CUBLAS_OP_C) {
      emu::report("%s: %s = %d is not CUBLAS_OP_N, CUBLAS_OP_T or CUBLAS_OP_C", fn, name, op);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  if (m < 0) return bad("m", m, 0);
  if (n < 0) return bad("n", n, 0);
  if (k < 0) return bad("k", k, 0);
  const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, a_rows)) {
    emu::report("%s: lda = %d < max(1, %d), the rows of A as stored (transa %s: A is %d x %d)", fn, lda, a_rows,
                op_name(ta), a_rows, ta == CUBLAS_OP_N ? k : m);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (ldb < std::max(1, b_rows)) {
    emu::report("%s: ldb = %d < max(1, %d), the rows of B as stored (transb %s: B is %d x %d)", fn, ldb, b_rows,
                op_name(tb), b_rows, tb == CUBLAS_OP_N ? n : k);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (ldc < std::max(1, m)) {
    emu::report("%s: ldc = %d < max(1, m = %d)", fn, ldc, m);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool known_algo = (algo >= CUBLAS_GEMM_DEFAULT && algo <= CUBLAS_GEMM_ALGO23) ||
                          (algo >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && algo <= CUBLAS_GEMM_ALGO15_TENSOR_OP);
  if (!known_algo) {
    emu::report("%s: algo %d is not a cublasGemmAlgo_t", fn, int(algo));
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!check_host_scalar(fn, "alpha", alpha) || !check_host_scalar(fn, "beta", beta))
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

// The operands' memory: A and B when k > 0 (k = 0 reads neither), C always (written, and read
// when beta != 0); C may not overlap A or B.
bool gemm_memory(const Product& p) {
  const char* fn = p.fn;
  if (p.k > 0 && (!check_matrix(fn, "A", p.a) || !check_matrix(fn, "B", p.b))) return false;
  if (!check_matrix(fn, "C", p.d)) return false;
  return p.k == 0 || (check_no_overlap(fn, "C", p.d, "A", p.a) && check_no_overlap(fn, "C", p.d, "B", p.b));
}

}  // namespace

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  emu::cover("cublas cublasGemmEx");
  const char* fn = "cublasGemmEx";
  if (!check_handle(fn, handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  cublasStatus_t st = gemm_arguments(transa, transb, m, n, k, lda, ldb, ldc, alpha, beta, algo);
  if (st == CUBLAS_STATUS_SUCCESS) st = gemm_types(Atype, Btype, Ctype, computeType);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;  // an empty C: nothing to compute or read
  Product p;
  p.fn = fn;
  p.ta = transa != CUBLAS_OP_N;
  p.tb = transb != CUBLAS_OP_N;
  p.m = m, p.n = n, p.k = k;
  p.a = {A, Atype, p.ta ? k : m, p.ta ? m : k, lda};
  p.b = {B, Btype, p.tb ? n : k, p.tb ? k : n, ldb};
  p.c = p.d = {C, Ctype, m, n, ldc};
  if (!gemm_memory(p)) return CUBLAS_STATUS_INVALID_VALUE;
  // Host pointer mode: alpha and beta are read now; with COMPUTE_32F they are floats.
  p.alpha = *static_cast<const float*>(alpha);
  p.beta = *static_cast<const float*>(beta);
  if (emu::sticky_error() != cudaSuccess) {
    emu::report("%s: the device has a sticky error (%s); nothing is launched", fn,
                cudaGetErrorName(emu::sticky_error()));
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  emu::enqueue(handle->stream, fn, [p] { run_product(p); });
  return CUBLAS_STATUS_SUCCESS;
}

// ===== cuBLASLt ========================================================================================

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  emu::cover("cublas cublasLtCreate");
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = nullptr;
  if (emu::sticky_error() != cudaSuccess) {
    emu::report("cublasLtCreate: the device has a sticky error (%s)", cudaGetErrorName(emu::sticky_error()));
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *handle = create_object<cublasLtContext>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  emu::cover("cublas cublasLtDestroy");
  if (!check_handle("cublasLtDestroy", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  destroy_object(handle);
  return CUBLAS_STATUS_SUCCESS;
}

// Descriptors: a null pointer to create into, or a dead descriptor, is CUBLAS_STATUS_INVALID_VALUE.
static bool check_object(const char* fn, const char* name, const void* x) {
  if (live(x)) return true;
  emu::report("%s: %s (%p) is %s", fn, name, x, x ? "not a live descriptor (destroyed?)" : "null");
  return false;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
  emu::cover("cublas cublasLtMatmulDescCreate");
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = create_object<cublasLtMatmulDescOpaque_t>();
  (*desc)->compute = computeType;
  (*desc)->scale_type = scaleType;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  emu::cover("cublas cublasLtMatmulDescDestroy");
  if (!check_object("cublasLtMatmulDescDestroy", "desc", desc)) return CUBLAS_STATUS_INVALID_VALUE;
  destroy_object(desc);
  return CUBLAS_STATUS_SUCCESS;
}

namespace {
// Sets one attribute from (buf, size): "CUBLAS_STATUS_INVALID_VALUE if buf is NULL or sizeInBytes
// doesn't match the size of the internal storage for the selected attribute".
template <class T> cublasStatus_t set_field(const char* fn, int attr, T& field, const void* buf, size_t size) {
  if (!buf || size != sizeof(T)) {
    emu::report("%s: attribute %d takes %zu bytes, given %zu%s", fn, attr, sizeof(T), size, buf ? "" : " (buf null)");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  memcpy(&field, buf, size);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t not_implemented(const char* fn, int attr) {
  emu::cover("cublas not_implemented");
  emu::report("%s: attribute %d is not implemented by the emulated cuBLASLt", fn, attr);
  return CUBLAS_STATUS_NOT_SUPPORTED;
}
}  // namespace

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t sizeInBytes) {
  emu::cover("cublas cublasLtMatmulDescSetAttribute");
  const char* fn = "cublasLtMatmulDescSetAttribute";
  if (!check_object(fn, "desc", desc)) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return set_field(fn, attr, desc->compute, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return set_field(fn, attr, desc->scale_type, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return set_field(fn, attr, desc->pointer_mode, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_TRANSA: return set_field(fn, attr, desc->transa, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set_field(fn, attr, desc->transb, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set_field(fn, attr, desc->epilogue, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET: return set_field(fn, attr, desc->sm_count, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER: return set_field(fn, attr, desc->scale_a, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER: return set_field(fn, attr, desc->scale_b, buf, sizeInBytes);
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM: return set_field(fn, attr, desc->fast_accum, buf, sizeInBytes);
    default: return not_implemented(fn, attr);
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  emu::cover("cublas cublasLtMatrixLayoutCreate");
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = create_object<cublasLtMatrixLayoutOpaque_t>();
  **layout = {type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  emu::cover("cublas cublasLtMatrixLayoutDestroy");
  if (!check_object("cublasLtMatrixLayoutDestroy", "layout", layout)) return CUBLAS_STATUS_INVALID_VALUE;
  destroy_object(layout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  emu::cover("cublas cublasLtMatmulPreferenceCreate");
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = create_object<cublasLtMatmulPreferenceOpaque_t>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  emu::cover("cublas cublasLtMatmulPreferenceDestroy");
  if (!check_object("cublasLtMatmulPreferenceDestroy", "pref", pref)) return CUBLAS_STATUS_INVALID_VALUE;
  destroy_object(pref);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t sizeInBytes) {
  emu::cover("cublas cublasLtMatmulPreferenceSetAttribute");
  const char* fn = "cublasLtMatmulPreferenceSetAttribute";
  if (!check_object(fn, "pref", pref)) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return set_field(fn, attr, pref->search_mode, buf, sizeInBytes);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set_field(fn, attr, pref->max_workspace, buf, sizeInBytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return set_field(fn, attr, pref->align[0], buf, sizeInBytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return set_field(fn, attr, pref->align[1], buf, sizeInBytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return set_field(fn, attr, pref->align[2], buf, sizeInBytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return set_field(fn, attr, pref->align[3], buf, sizeInBytes);
    default: return not_implemented(fn, attr);
  }
}

namespace {

// The problem four layouts and a descriptor describe, checked for consistency: op(A) m × k,
// op(B) k × n, C and D m × n, every leading dimension at least its matrix's rows. A conflict is
// CUBLAS_STATUS_INVALID_VALUE ("parameters are in conflict or in an impossible configuration").
struct LtProblem {
  const cublasLtMatmulDescOpaque_t* op;
  Mat a, b, c, d;
  int64_t m, n, k;
};
cublasStatus_t lt_problem(const char* fn, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                          cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D, LtProblem* pb) {
  emu::cover("cublas lt_problem");
  if (!check_object(fn, "the matmul descriptor", op) || !check_object(fn, "Adesc", A) ||
      !check_object(fn, "Bdesc", B) || !check_object(fn, "Cdesc", C) || !check_object(fn, "Ddesc", D))
    return CUBLAS_STATUS_INVALID_VALUE;
  pb->op = op;
  const cublasLtMatrixLayoutOpaque_t* l[4] = {A, B, C, D};
  Mat* mats[4] = {&pb->a, &pb->b, &pb->c, &pb->d};
  const char* names[4] = {"A", "B", "C", "D"};
  for (int i = 0; i < 4; ++i) {
    *mats[i] = {nullptr, l[i]->type, int64_t(l[i]->rows), int64_t(l[i]->cols), l[i]->ld};
    if (l[i]->ld < std::max<int64_t>(1, mats[i]->rows)) {
      emu::report("%s: %s's leading dimension %lld < max(1, %lld rows)", fn, names[i], (long long)l[i]->ld,
                  (long long)mats[i]->rows);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  const bool ta = op->transa != CUBLAS_OP_N, tb = op->transb != CUBLAS_OP_N;
  pb->m = pb->d.rows, pb->n = pb->d.cols, pb->k = ta ? pb->a.rows : pb->a.cols;
  const bool a_ok = (ta ? pb->a.cols : pb->a.rows) == pb->m;
  const bool b_ok = (tb ? pb->b.cols : pb->b.rows) == pb->k && (tb ? pb->b.rows : pb->b.cols) == pb->n;
  const bool c_ok = pb->c.rows == pb->m && pb->c.cols == pb->n;
  if (!a_ok || !b_ok || !c_ok) {
    emu::report("%s: the shapes do not compose: op(A) from A %lld x %lld (%s), op(B) from B %lld x %lld (%s), "
                "C %lld x %lld, D %lld x %lld",
                fn, (long long)pb->a.rows, (long long)pb->a.cols, op_name(op->transa), (long long)pb->b.rows,
                (long long)pb->b.cols, op_name(op->transb), (long long)pb->c.rows, (long long)pb->c.cols,
                (long long)pb->d.rows, (long long)pb->d.cols);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// The device's compute capability as 10 · major + minor.
int capability() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return 0;
  return 10 * major + minor;
}

// Which rule of NVIDIA's FP8 requirements (cublasLtMatmul(), "To use FP8 kernels, the following
// set of requirements must be satisfied"; the FP8 rows of its table of supported types; "Tensor
// Core Usage" for alignment) the problem breaks, or null when an FP8 kernel takes it. The emulated
// cuBLASLt has kernels for exactly these problems.
const char* fp8_rule_broken(const LtProblem& pb, const uint32_t align[4]) {
  const cublasLtMatmulDescOpaque_t& op = *pb.op;
  if (!is_fp8(pb.a.type) || !is_fp8(pb.b.type))
    return "A and B must be CUDA_R_8F_E4M3 or CUDA_R_8F_E5M2 (the emulated cuBLASLt implements only FP8 matmuls)";
  if (pb.a.type == CUDA_R_8F_E5M2 && pb.b.type == CUDA_R_8F_E5M2)
    return "A and B cannot both be CUDA_R_8F_E5M2 (no such row in the FP8 type table)";
  if (capability() < 89) return "FP8 matmuls need compute capability 8.9 or later";
  if (op.transa != CUBLAS_OP_T || op.transb != CUBLAS_OP_N)
    return "A must be transposed and B not (the \"TN\" format, the only one on compute capability 8.9 and 9.0)";
  if (op.compute != CUBLAS_COMPUTE_32F) return "the compute type must be CUBLAS_COMPUTE_32F";
  if (op.scale_type != CUDA_R_32F) return "the scale type must be CUDA_R_32F";
  if (pb.c.type != pb.d.type || (pb.d.type != CUDA_R_32F && pb.d.type != CUDA_R_16BF))
    return "C and D must both be CUDA_R_32F or both CUDA_R_16BF (the only FP8 outputs the emulator implements)";
  if (pb.m % 16 || pb.n % 16 || pb.k % 16) return "m, n and k must be multiples of 16";
  // One byte per FP8 element, so A's and B's leading dimensions in bytes are their values.
  if (pb.a.ld % 16 || pb.b.ld % 16 || (pb.c.ld * int64_t(type_bytes(pb.c.type))) % 16 ||
      (pb.d.ld * int64_t(type_bytes(pb.d.type))) % 16)
    return "every leading dimension must be a multiple of 16 bytes";
  for (int i = 0; i < 4; ++i)
    if (align[i] < 16 || align[i] & (align[i] - 1))
      return "the preference's minimum alignments must be powers of two of at least 16 bytes";
  if (op.pointer_mode != CUBLASLT_POINTER_MODE_HOST) return "only the host pointer mode is implemented";
  if (op.epilogue != CUBLASLT_EPILOGUE_DEFAULT) return "only CUBLASLT_EPILOGUE_DEFAULT is implemented";
  return nullptr;
}

// The emulator's algorithm: a tag and the pointer alignments the heuristic was told to expect.
constexpr uint64_t kAlgoTag = 0x656d752d66703821ull;  // "emu-fp8!"
cublasLtMatmulAlgo_t make_algo(const uint32_t align[4]) {
  cublasLtMatmulAlgo_t a{};
  a.data[0] = kAlgoTag;
  for (int i = 0; i < 4; ++i) a.data[1 + i] = align[i];
  return a;
}

}  // namespace

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int* returnAlgoCount) {
  emu::cover("cublas cublasLtMatmulAlgoGetHeuristic");
  const char* fn = "cublasLtMatmulAlgoGetHeuristic";
  if (returnAlgoCount) *returnAlgoCount = 0;
  if (!check_handle(fn, handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (requestedAlgoCount <= 0 || !heuristicResultsArray || !returnAlgoCount) {
    emu::report("%s: requestedAlgoCount = %d (must be > 0), results %p, returnAlgoCount %p", fn, requestedAlgoCount,
                (void*)heuristicResultsArray, (void*)returnAlgoCount);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!check_object(fn, "preference", preference)) return CUBLAS_STATUS_INVALID_VALUE;
  LtProblem pb;
  const cublasStatus_t st = lt_problem(fn, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, &pb);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  // "CUBLAS_STATUS_NOT_SUPPORTED: if no heuristic function available for current configuration";
  // the real library answers so for FP8 problems its kernels cannot take, e.g. e5m2 × e5m2.
  if (const char* why = fp8_rule_broken(pb, preference->align)) {
    emu::report("%s: no algorithm: %s", fn, why);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  heuristicResultsArray[0] = {};
  heuristicResultsArray[0].algo = make_algo(preference->align);
  heuristicResultsArray[0].workspaceSize = 0;  // the emulator needs none
  heuristicResultsArray[0].state = CUBLAS_STATUS_SUCCESS;
  heuristicResultsArray[0].wavesCount = 1.f;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

// The memory of one FP8 matmul: A, B, D (and C when beta != 0) device matrices aligned as the
// algorithm was chosen for; C and D the same matrix with the same layout, or not overlapping;
// D not overlapping A or B; the scale pointers device floats; the workspace device memory,
// 256-byte aligned (cublasLtMatmul(): "workspace ... Must be 256B aligned").
bool lt_memory(const Product& p, const uint32_t align[4], const void* workspace, size_t ws_bytes) {
  const char* fn = p.fn;
  if (!check_matrix(fn, "A", p.a, align[0]) || !check_matrix(fn, "B", p.b, align[1]) ||
      !check_matrix(fn, "D", p.d, align[3]))
    return false;
  const bool in_place = p.c.p == p.d.p;
  if (in_place && (p.c.type != p.d.type || p.c.ld != p.d.ld)) {
    emu::report("%s: C and D are the same matrix (%p) with different layouts", fn, p.d.p);
    return false;
  }
  if (p.beta != 0.f && !in_place && !check_matrix(fn, "C", p.c, align[2])) return false;
  if ((p.beta != 0.f && !in_place && !check_no_overlap(fn, "D", p.d, "C", p.c)) ||
      !check_no_overlap(fn, "D", p.d, "A", p.a) || !check_no_overlap(fn, "D", p.d, "B", p.b))
    return false;
  const float* scales[2] = {p.scale_a, p.scale_b};
  const char* names[2] = {"CUBLASLT_MATMUL_DESC_A_SCALE_POINTER", "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER"};
  for (int i = 0; i < 2; ++i)
    if (scales[i] && (!emu::is_device(scales[i], 4) || uintptr_t(scales[i]) % 4)) {
      emu::report("%s: %s (%p) is not an aligned device float; the kernel reads it on the GPU", fn, names[i],
                  (const void*)scales[i]);
      return false;
    }
  if (ws_bytes && (!emu::is_device(workspace, ws_bytes) || uintptr_t(workspace) % 256)) {
    emu::report("%s: the workspace (%p, %zu bytes) must be device memory, 256-byte aligned", fn, workspace, ws_bytes);
    return false;
  }
  return true;
}

}  // namespace

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream) {
  emu::cover("cublas cublasLtMatmul");
  const char* fn = "cublasLtMatmul";
  if (!check_handle(fn, lightHandle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  LtProblem pb;
  cublasStatus_t st = lt_problem(fn, computeDesc, Adesc, Bdesc, Cdesc, Ddesc, &pb);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  // A null algo: the implicit heuristic with the default preference (256-byte alignment).
  const cublasLtMatmulPreferenceOpaque_t defaults;
  uint32_t align[4] = {defaults.align[0], defaults.align[1], defaults.align[2], defaults.align[3]};
  if (algo) {
    if (algo->data[0] != kAlgoTag) {
      emu::report("%s: algo did not come from cublasLtMatmulAlgoGetHeuristic", fn);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    for (int i = 0; i < 4; ++i) align[i] = uint32_t(algo->data[1 + i]);
  }
  // "CUBLAS_STATUS_ARCH_MISMATCH if configured operation cannot be run using selected device".
  if (is_fp8(pb.a.type) && capability() < 89) {
    emu::report("%s: FP8 inputs need compute capability 8.9 or later", fn);
    return CUBLAS_STATUS_ARCH_MISMATCH;
  }
  if (const char* why = fp8_rule_broken(pb, align)) {
    emu::report("%s: not supported: %s", fn, why);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (!check_host_scalar(fn, "alpha", alpha) || !check_host_scalar(fn, "beta", beta))
    return CUBLAS_STATUS_INVALID_VALUE;
  Product p;
  p.fn = fn;
  p.ta = true, p.tb = false;  // the TN format, checked above
  p.m = pb.m, p.n = pb.n, p.k = pb.k;
  p.a = pb.a, p.b = pb.b, p.c = pb.c, p.d = pb.d;
  p.a.p = A, p.b.p = B, p.c.p = C, p.d.p = D;
  p.alpha = *static_cast<const float*>(alpha);  // the scale type is CUDA_R_32F
  p.beta = *static_cast<const float*>(beta);
  p.scale_a = static_cast<const float*>(computeDesc->scale_a);
  p.scale_b = static_cast<const float*>(computeDesc->scale_b);
  if (!lt_memory(p, align, workspace, workspaceSizeInBytes)) return CUBLAS_STATUS_INVALID_VALUE;
  if (emu::sticky_error() != cudaSuccess) {
    emu::report("%s: the device has a sticky error (%s); nothing is launched", fn,
                cudaGetErrorName(emu::sticky_error()));
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  emu::enqueue(stream, fn, [p] { run_product(p); });
  return CUBLAS_STATUS_SUCCESS;
}
