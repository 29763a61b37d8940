// kernels_cuda.cu — the CUDA twins of the CPU reference kernels in kernels.cu.
//
// Same names, same contracts (kernels.h). Every kernel runs on ts::compute_stream(); matmuls go
// to cuBLAS. No float atomics anywhere: each output element is produced by one thread, or by a
// reduction whose order is fixed by the launch shape alone, so results are bitwise reproducible
// run to run. They are not bitwise equal to the CPU's (summation order, fused multiply-adds, the
// device's expf and sin/cos): the equivalence tests compare with tolerances. Where it is cheap
// the statistics are summed in double, as on the CPU, so that they round to the same float.
//
// Compiled by g++ in a CPU-only build, this file is empty.
#ifdef TS_CUDA
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/kernels_cuda.h"
#include "tensor/allocator.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda_internal.h"
#include "tensor/rng.h"
#include "tensor/device.h"

namespace ts {
namespace cuda {

// ----- launch helpers --------------------------------------------------------------------------

constexpr int kBlock = 256;  // threads per block for element-wise and row kernels

// Blocks for a grid-stride loop over n items: enough to fill the GPU, capped so that huge n
// loops instead of overflowing the grid; at least one block so that n = 0 is a valid launch.
static unsigned grid_for(int64_t n) {
  int64_t blocks = (n + kBlock - 1) / kBlock;
  return unsigned(blocks < 1 ? 1 : blocks > 16384 ? 16384 : blocks);
}

// Calls f(T{}) with T = float or bf16 for dt: one templated kernel serves both storage types.
template <class F> static void with_dtype(DType dt, const char* op, F&& f) {
  if (dt == DType::F32) {
    f(float{});
  } else if (dt == DType::BF16) {
    f(bf16{});
  } else {
    fatal("%s: unsupported dtype %s", op, dtype_name(dt));
  }
}

// Rows and columns of a tensor seen as a matrix [rows, last dimension].
static int64_t last_dim(const Tensor& t) { return t.shape.empty() ? 1 : t.shape.back(); }
static int64_t lead_dims(const Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.dim(); i++) n *= t.shape[i];
  return n;
}

// One grow-only device buffer for reduction partials and attention's D = rowsum(dO * O). Its
// users are kernels queued in order on the one compute stream, so a single buffer serves them all.
static void* scratch(size_t bytes) {
  static void* ptr = nullptr;
  static size_t cap = 0;
  if (bytes > cap) {
    if (ptr) {
      // Kernels already queued may still read the old buffer: drain the stream before freeing.
      sync_compute_stream();
      mem_free(ptr, cap, Device::CUDA, Tag::Workspace);
    }
    cap = bytes;
    ptr = mem_alloc(cap, Device::CUDA, Tag::Workspace);
  }
  return ptr;
}

// Block-wide sum / max (blockDim.x a multiple of 32, at most 1024): warps reduce, then warp 0
// reduces the per-warp results. Every thread gets the result; sh (32 slots) is reusable after.
template <class R> __device__ R block_sum(R v, R* sh) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_sum(lane < nwarps ? sh[lane] : R(0));
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  R r = sh[0];
  __syncthreads();
  return r;
}
__device__ float block_max(float v, float* sh) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_max(lane < nwarps ? sh[lane] : -INFINITY);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  float r = sh[0];
  __syncthreads();
  return r;
}

// ----- elementwise -----------------------------------------------------------------------------

template <class T> __global__ void add_kernel(T* y, const T* a, const T* b, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = st<T>(ld(a[i]) + ld(b[i]));
}

template <class T> __global__ void scale_kernel(T* y, float s, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = st<T>(ld(y[i]) * s);
}

template <class Td, class Ts> __global__ void convert_kernel(Td* dst, const Ts* src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = st<Td>(ld(src[i]));
}

template <class T> __global__ void fill_kernel(T* t, float value, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t[i] = st<T>(value);
}

void add(const Tensor& y, const Tensor& a, const Tensor& b) {
  int64_t n = y.numel();
  with_dtype(y.dtype, "add", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), add_kernel)(y.data<T>(), a.data<T>(), b.data<T>(), n);
    KERNEL_CHECK();
  });
}

void add_inplace(const Tensor& y, const Tensor& x) { cuda::add(y, y, x); }

void scale_inplace(const Tensor& y, float s) {
  int64_t n = y.numel();
  with_dtype(y.dtype, "scale_inplace", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), scale_kernel)(y.data<T>(), s, n);
    KERNEL_CHECK();
  });
}

void convert(const Tensor& dst, const Tensor& src) {
  int64_t n = dst.numel();
  with_dtype(dst.dtype, "convert", [&](auto td) {
    with_dtype(src.dtype, "convert", [&](auto ts_) {
      using Td = decltype(td);
      using Ts = decltype(ts_);
      TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), convert_kernel)(dst.data<Td>(), src.data<Ts>(), n);
      KERNEL_CHECK();
    });
  });
}

void fill(const Tensor& t, float value) {
  int64_t n = t.numel();
  with_dtype(t.dtype, "fill", [&](auto tag) {
    using T = decltype(tag);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), fill_kernel)(t.data<T>(), value, n);
    KERNEL_CHECK();
  });
}

// ----- embedding -------------------------------------------------------------------------------

template <class T>
__global__ void embedding_forward_kernel(T* out, const T* table, const int32_t* tokens, int64_t N, int64_t V,
                                         int64_t D, int64_t vocab_start) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * D; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i / D, d = i % D;
    int64_t row = int64_t(tokens[n]) - vocab_start;
    out[i] = row >= 0 && row < V ? table[row * D + d] : st<T>(0.f);
  }
}

// Thread (d, slice) owns column d of the table rows [r0, r1) of its slice and walks the tokens in
// order, so every dtable element accumulates in token order, as on the CPU, without atomics. The
// slices (grid.y) only add parallelism: a thread's tokens are a subsequence of the token order.
template <class T>
__global__ void embedding_backward_kernel(float* dtable, const T* dout, const int32_t* tokens, int64_t N,
                                          int64_t V, int64_t D, int64_t vocab_start, int64_t rows_per_slice) {
  int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_slice, r1 = min(V, r0 + rows_per_slice);
  for (int64_t n = 0; n < N; n++) {
    int64_t row = int64_t(tokens[n]) - vocab_start;
    if (row < r0 || row >= r1) continue;  // another slice's row, or another vocab shard's token
    dtable[row * D + d] += ld(dout[n * D + d]);
  }
}

void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t vocab_start) {
  int64_t N = tokens.numel(), V = table.size(0), D = table.size(1);
  with_dtype(table.dtype, "embedding_forward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(N * D), kBlock, 0, compute_stream(), embedding_forward_kernel)(out.data<T>(), table.data<T>(),
                                                                               tokens.i32(), N, V, D, vocab_start);
    KERNEL_CHECK();
  });
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start) {
  int64_t N = tokens.numel(), V = dtable.size(0), D = dtable.size(1);
  if (N == 0 || V == 0 || D == 0) return;
  int64_t slices = V < 128 ? V : 128, rows_per_slice = (V + slices - 1) / slices;
  dim3 grid(unsigned((D + kBlock - 1) / kBlock), unsigned(slices));
  with_dtype(dout.dtype, "embedding_backward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid, kBlock, 0, compute_stream(), embedding_backward_kernel)(dtable.f32(), dout.data<T>(), tokens.i32(), N, V,
                                                                     D, vocab_start, rows_per_slice);
    KERNEL_CHECK();
  });
}

// ----- RMSNorm ---------------------------------------------------------------------------------
// One warp per row (kBlock / 32 rows per block). The row statistics are summed in double, as on
// the CPU, so rstd rounds to the same float whatever the summation order.

template <class T>
__global__ void rmsnorm_forward_kernel(T* y, float* rstd, const T* x, const float* w, int64_t N, int64_t D, float eps) {
  int lane = threadIdx.x % 32;
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const T* xr = x + row * D;
  double ss = 0.0;
  for (int64_t d = lane; d < D; d += 32) {
    double v = ld(xr[d]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  float r = float(1.0 / sqrt(ss / double(D) + double(eps)));
  if (lane == 0) rstd[row] = r;
  T* yr = y + row * D;
  for (int64_t d = lane; d < D; d += 32) yr[d] = st<T>(ld(xr[d]) * r * w[d]);
}

// With xhat = x * r: dx = r * (w*dy - xhat * mean(w*dy*xhat)), the gradient through y = xhat * w.
template <class T>
__global__ void rmsnorm_backward_dx_kernel(T* dx, const T* dy, const T* x, const float* w, const float* rstd,
                                           int64_t N, int64_t D) {
  int lane = threadIdx.x % 32;
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const T* dyr = dy + row * D;
  const T* xr = x + row * D;
  const float r = rstd[row];
  double dot = 0.0;
  for (int64_t d = lane; d < D; d += 32) dot += double(w[d] * ld(dyr[d])) * (ld(xr[d]) * r);
  dot = warp_sum(dot);
  const float c = float(dot / double(D));
  T* dxr = dx + row * D;
  for (int64_t d = lane; d < D; d += 32) dxr[d] = st<T>(r * (w[d] * ld(dyr[d]) - ld(xr[d]) * r * c));
}

// dw[d] = sum_n dy[n,d] * x[n,d] * rstd[n], in two fixed-order stages: partial sums over chunks
// of kRmsRowsPerChunk consecutive rows (rows in order), then the chunks in order.
constexpr int kRmsRowsPerChunk = 32;

template <class T>
__global__ void rmsnorm_backward_dw_partial_kernel(float* partial, const T* dy, const T* x, const float* rstd,
                                                   int64_t N, int64_t D) {
  int64_t d = int64_t(blockIdx.y) * blockDim.x + threadIdx.x, chunk = blockIdx.x;
  if (d >= D) return;
  int64_t n0 = chunk * kRmsRowsPerChunk, n1 = min(n0 + kRmsRowsPerChunk, N);
  float acc = 0.f;
  for (int64_t n = n0; n < n1; n++) acc += ld(dy[n * D + d]) * (ld(x[n * D + d]) * rstd[n]);
  partial[chunk * D + d] = acc;
}

__global__ void rmsnorm_backward_dw_combine_kernel(float* dw, const float* partial, int64_t chunks, int64_t D) {
  int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float acc = 0.f;
  for (int64_t c = 0; c < chunks; c++) acc += partial[c * D + d];
  dw[d] += acc;
}

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  int64_t D = last_dim(x), N = lead_dims(x);
  if (N == 0) return;
  unsigned blocks = unsigned((N + kBlock / 32 - 1) / (kBlock / 32));
  with_dtype(x.dtype, "rmsnorm_forward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(blocks, kBlock, 0, compute_stream(), rmsnorm_forward_kernel)(y.data<T>(), rstd.f32(), x.data<T>(), w.f32(), N,
                                                                     D, eps);
    KERNEL_CHECK();
  });
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  int64_t D = last_dim(x), N = lead_dims(x);
  if (N == 0 || D == 0) return;
  int64_t chunks = (N + kRmsRowsPerChunk - 1) / kRmsRowsPerChunk;
  float* partial = static_cast<float*>(scratch(size_t(chunks * D) * sizeof(float)));
  unsigned col_blocks = unsigned((D + kBlock - 1) / kBlock);  // grid.y: chunks (grid.x) may exceed 65535
  unsigned row_blocks = unsigned((N + kBlock / 32 - 1) / (kBlock / 32));
  with_dtype(x.dtype, "rmsnorm_backward", [&](auto t) {
    using T = decltype(t);
    // dw first: it reads dy, which the caller may let dx overwrite.
    TS_LAUNCH(dim3(unsigned(chunks), col_blocks), kBlock, 0, compute_stream(), rmsnorm_backward_dw_partial_kernel)(
        partial, dy.data<T>(), x.data<T>(), rstd.f32(), N, D);
    KERNEL_CHECK();
    TS_LAUNCH(col_blocks, kBlock, 0, compute_stream(), rmsnorm_backward_dw_combine_kernel)(dw.f32(), partial, chunks, D);
    KERNEL_CHECK();
    TS_LAUNCH(row_blocks, kBlock, 0, compute_stream(), rmsnorm_backward_dx_kernel)(dx.data<T>(), dy.data<T>(), x.data<T>(),
                                                                             w.f32(), rstd.f32(), N, D);
    KERNEL_CHECK();
  });
}

// ----- RoPE ------------------------------------------------------------------------------------

// inv_freq_j = theta^(-2j/hd) for j < hd/2, computed on the host in double exactly as the CPU twin
// does, and passed by value (hd <= 128).
struct InvFreq {
  double v[64];
};

// cos and sin of the angle pos · inv_freq_j, rounded to float. The angle is formed in double as on
// the CPU: at positions of thousands an fp32 angle is already off by ~1e-4 rad. Device and host
// sin/cos (double) may still differ in the last ulp, which can rarely flip the float rounding.
// The table and the rotation both call this, so a value read from the table has the bits the
// rotation would compute in its place.
__device__ __forceinline__ void rope_cos_sin(int64_t pos, double inv_freq, float* c, float* s) {
  double sd, cd;
  sincos(double(pos) * inv_freq, &sd, &cd);
  *c = float(cd);
  *s = float(sd);
}

// table [positions, hd/2] of (cos, sin) pairs for positions 0 .. positions - 1.
__global__ void rope_table_kernel(float* table, InvFreq inv, int64_t positions, int half) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < positions * half;
       i += int64_t(gridDim.x) * blockDim.x)
    rope_cos_sin(i / half, inv.v[i % half], &table[2 * i], &table[2 * i + 1]);
}

// Rotates the pairs (j, j + hd/2) of every head row by angle pos * inv_freq_j; sign = -1 applies
// the inverse rotation (backward). cos and sin come from the table for positions it holds (every
// position 0 .. S-1 of the run's sequences); a position past it, such as a context-parallel rank's
// global positions, is computed in place, with the same bits.
template <class T>
__global__ void rope_kernel(T* x, const int32_t* pos, const float* table, int64_t positions, InvFreq inv,
                            int64_t rows, int64_t S, int64_t H, int hd, float sign) {
  int half = hd / 2;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * half;
       i += int64_t(gridDim.x) * blockDim.x) {
    int j = int(i % half);
    int64_t row = i / half;  // (b * S + s) * H + h
    int64_t s = (row / H) % S;
    const int64_t p = pos[s];
    float cs, sn;
    if (p >= 0 && p < positions) {
      cs = table[2 * (p * half + j)];
      sn = table[2 * (p * half + j) + 1];
    } else {
      rope_cos_sin(p, inv.v[j], &cs, &sn);
    }
    sn = sign * sn;
    T* q = x + row * hd;
    float a = ld(q[j]), b = ld(q[j + half]);
    q[j] = st<T>(a * cs - b * sn);
    q[j + half] = st<T>(b * cs + a * sn);
  }
}

// The cos/sin table, built once per (theta, head dim) and grown to the largest sequence length
// seen (a power of two, at least 64 positions), instead of 2 · rows · hd/2 double sin/cos per call.
// It lives on the device, in one grow-only buffer allocated outside the tagging allocator, as
// cuBLAS keeps its own workspace: library state (positions × hd/2 × 8 bytes, 4 KiB at the tiny
// preset, 1 MiB at 2,048 positions of head dim 128), so the memory table's categories stay what a
// training step holds. The table kernel runs on the compute
// stream, ahead of every rope kernel that reads it. A rebuild for another theta or head dim
// rewrites the buffer in place, in stream order, after the kernels that read the old values;
// only a larger buffer needs the stream drained first, before the old one is freed (see scratch()).
struct RopeTable {
  float* cs = nullptr;
  size_t cap = 0;          // floats allocated
  int64_t positions = 0;   // positions the table holds
  float theta = 0.f;
  int hd = 0;
};

static const RopeTable& rope_table(float theta, int hd, int64_t S, const InvFreq& inv) {
  static RopeTable t;
  const bool same = t.theta == theta && t.hd == hd;
  if (same && S <= t.positions) return t;
  int64_t positions = 64;
  while (positions < std::max(S, same ? t.positions : int64_t(0))) positions *= 2;
  const size_t floats = size_t(positions) * size_t(hd);  // hd/2 pairs per position
  if (floats > t.cap) {
    if (t.cs) {
      sync_compute_stream();  // rope kernels already queued may still read the old table
      CUDA_CHECK(cudaFree(t.cs));
    }
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, floats * sizeof(float)));
    t.cs = static_cast<float*>(p);
    t.cap = floats;
  }
  t.positions = positions, t.theta = theta, t.hd = hd;
  TS_LAUNCH(grid_for(positions * (hd / 2)), kBlock, 0, compute_stream(), rope_table_kernel)(t.cs, inv, positions,
                                                                                          hd / 2);
  KERNEL_CHECK();
  return t;
}

static void rope(const Tensor& x, const Tensor& pos, float theta, float sign) {
  int64_t S = x.size(1), H = x.size(2);
  int hd = int(x.size(3));
  TS_CHECK(hd % 2 == 0 && hd <= 128, "rope: head dim %d must be even and at most 128", hd);
  InvFreq inv{};
  for (int j = 0; j < hd / 2; j++) inv.v[j] = std::pow(double(theta), -2.0 * double(j) / double(hd));
  const RopeTable& table = rope_table(theta, hd, S, inv);
  int64_t rows = x.numel() / hd;
  with_dtype(x.dtype, "rope", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(rows * (hd / 2)), kBlock, 0, compute_stream(), rope_kernel)(
        x.data<T>(), pos.i32(), table.cs, table.positions, inv, rows, S, H, hd, sign);
    KERNEL_CHECK();
  });
}

void rope_forward(const Tensor& x, const Tensor& pos, float theta) { rope(x, pos, theta, 1.f); }
// The rotation is orthogonal: its gradient is the rotation by the opposite angle.
void rope_backward(const Tensor& dx, const Tensor& pos, float theta) { rope(dx, pos, theta, -1.f); }

// ----- matmul ----------------------------------------------------------------------------------

static cudaDataType_t cublas_dtype(DType t) {
  if (t == DType::F32) return CUDA_R_32F;
  if (t == DType::BF16) return CUDA_R_16BF;
  fatal("matmul: unsupported dtype %s", dtype_name(t));
}

// cuBLAS is column-major; a row-major [r, c] matrix is its column-major transpose [c, r]. So the
// row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap the
// operands, keep each one's transpose flag, and every leading dimension is a row length.
void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha, float beta) {
  TS_CHECK(A.dtype == B.dtype && (C.dtype == DType::F32 || C.dtype == A.dtype),
           "matmul: dtypes C %s, A %s, B %s (A and B must match; C fp32 or A's)", C.str().c_str(), A.str().c_str(),
           B.str().c_str());
  int64_t a_rows = lead_dims(A), a_cols = last_dim(A), b_rows = lead_dims(B), b_cols = last_dim(B);
  int64_t M = transA ? a_cols : a_rows, K = transA ? a_rows : a_cols, N = transB ? b_rows : b_cols;
  if (M == 0 || N == 0) return;
  TS_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX, "matmul: dimensions exceed cuBLAS's int range");
  auto ldm = [](int64_t n) { return int(n > 1 ? n : 1); };  // cuBLAS wants ld >= 1
  // CUBLAS_COMPUTE_32F without the TF32 math mode: exact fp32 products, as on the CPU.
  CUBLAS_CHECK(cublasGemmEx(cublas(), transB ? CUBLAS_OP_T : CUBLAS_OP_N, transA ? CUBLAS_OP_T : CUBLAS_OP_N, int(N),
                            int(M), int(K), &alpha, B.raw(), cublas_dtype(B.dtype), ldm(b_cols), A.raw(),
                            cublas_dtype(A.dtype), ldm(a_cols), &beta, C.raw(), cublas_dtype(C.dtype), ldm(N),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// ----- causal GQA attention (flash-style) ------------------------------------------------------
//
// Rung 1 of the attention ladder: fp32 arithmetic on the CUDA cores, for every dtype and head dim.
// Rung 2, FlashAttention-2 on the tensor cores, is attention_v2.cu; attention_forward and
// attention_backward (below) choose between them.
//
// Blocks of kAttnWarps warps. Scores are computed one key (or one query) per lane: lane j takes the
// dot product of a shared-memory query row with the j-th key of a 32-row tile. The output
// accumulators are spread over the lanes by head dimension (d = lane + 32c, c < NCH = ceil(hd/32)),
// so hd need not be a power of two. Each warp owns RPW rows. As on the CPU, Q is multiplied by
// scale = 1/sqrt(hd) as it is loaded, so scores are (scale * q) . k. Tiles in shared memory are stored
// with a row stride of hd + 1 where lane j reads row j, so the 32 lanes hit 32 different banks.
// For hd <= 128 every kernel's dynamic shared memory stays within the default 48 KB.

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kTile = 32;  // keys (forward, dQ) or queries (dK/dV) per tile: one per lane
constexpr int kFwdRowsPerWarp = 4;
constexpr int kBwdRowsPerWarp = 2;

// Forward: block = (query tile of kAttnWarps*RPW rows, head, batch). Online softmax over key tiles:
// running max m, running sum l and the output accumulator, rescaled by exp(m_old - m_new) whenever
// the max grows. Only lse = m + log(l) is saved.
template <class T, int NCH, int RPW>
__global__ void __launch_bounds__(kAttnThreads)
    attention_forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* qpos,
                             const int32_t* kpos, int Sq, int Sk, int H, int KVH, int hd, float scale) {
  constexpr int BR = kAttnWarps * RPW;
  TS_DYNAMIC_SHARED(float, smem);
  float* Qs = smem;                   // [BR][hd]
  float* Ks = Qs + BR * hd;           // [kTile][hd + 1]
  float* Vs = Ks + kTile * (hd + 1);  // [kTile][hd]
  float* Ps = Vs + kTile * hd;        // [BR][kTile] probabilities of the current tile
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BR, kvh = h / (H / KVH);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t qs = int64_t(H) * hd, ks = int64_t(KVH) * hd;  // row strides
  const T* qb = q + (int64_t(b) * Sq * H + h) * hd;
  const T* kb = k + (int64_t(b) * Sk * KVH + kvh) * hd;
  const T* vb = v + (int64_t(b) * Sk * KVH + kvh) * hd;

  for (int e = threadIdx.x; e < BR * hd; e += blockDim.x) {
    int r = e / hd, d = e % hd;
    Qs[e] = q0 + r < Sq ? ld(qb[(q0 + r) * qs + d]) * scale : 0.f;
  }
  // The block's latest query position: key tiles that all lie after it contribute nothing.
  int qmax = warp_max_int(lane < BR && q0 + lane < Sq ? qpos[q0 + lane] : INT_MIN);
  int my_qpos[RPW];
  float m[RPW], l[RPW], acc[RPW][NCH];
  for (int rr = 0; rr < RPW; rr++) {
    int i = q0 + warp * RPW + rr;
    my_qpos[rr] = i < Sq ? qpos[i] : INT_MIN;  // rows past the end see no key and are not stored
    m[rr] = -INFINITY;
    l[rr] = 0.f;
    for (int c = 0; c < NCH; c++) acc[rr][c] = 0.f;
  }

  for (int k0 = 0; k0 < Sk; k0 += kTile) {
    const int kj = k0 + lane;
    const int kp = kj < Sk ? kpos[kj] : INT_MAX;
    // Every warp computes the same kmin, so the whole block skips (or not) together; skipping a
    // fully masked tile is exact: it would add p = 0 with a correction factor of 1.
    if (warp_min_int(kp) > qmax) continue;
    for (int e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
      int j = e / hd, d = e % hd;
      bool in = k0 + j < Sk;  // zero-fill past the end: p = 0 times garbage could be NaN
      Ks[j * (hd + 1) + d] = in ? ld(kb[(k0 + j) * ks + d]) : 0.f;
      Vs[j * hd + d] = in ? ld(vb[(k0 + j) * ks + d]) : 0.f;
    }
    __syncthreads();

    float s[RPW];
    for (int rr = 0; rr < RPW; rr++) s[rr] = 0.f;
    for (int d = 0; d < hd; d++) {
      float kd = Ks[lane * (hd + 1) + d];
      for (int rr = 0; rr < RPW; rr++) s[rr] += Qs[(warp * RPW + rr) * hd + d] * kd;
    }
    for (int rr = 0; rr < RPW; rr++) {
      bool visible = kj < Sk && kp <= my_qpos[rr];
      float sc = visible ? s[rr] : -INFINITY;
      float m_new = fmaxf(m[rr], warp_max(sc));
      // m_new is -inf only while every key so far is masked; then l and acc are still 0.
      float corr = m_new == -INFINITY ? 1.f : expf(m[rr] - m_new);
      float p = visible ? expf(sc - m_new) : 0.f;
      l[rr] = l[rr] * corr + warp_sum(p);
      m[rr] = m_new;
      for (int c = 0; c < NCH; c++) acc[rr][c] *= corr;
      Ps[(warp * RPW + rr) * kTile + lane] = p;
    }
    __syncwarp();
    for (int j = 0; j < kTile; j++) {
      for (int c = 0; c < NCH; c++) {
        int d = lane + 32 * c;
        if (d >= hd) break;
        float vd = Vs[j * hd + d];
        for (int rr = 0; rr < RPW; rr++) acc[rr][c] += Ps[(warp * RPW + rr) * kTile + j] * vd;
      }
    }
    __syncthreads();  // the next tile overwrites Ks, Vs
  }

  for (int rr = 0; rr < RPW; rr++) {
    int i = q0 + warp * RPW + rr;
    if (i >= Sq) break;
    T* o = out + ((int64_t(b) * Sq + i) * H + h) * hd;
    // A query that sees no key (possible for a context-parallel chunk) gets out = 0, lse = -inf:
    // the neutral element of the log-sum-exp merge.
    for (int c = 0; c < NCH; c++) {
      int d = lane + 32 * c;
      if (d < hd) o[d] = st<T>(l[rr] > 0.f ? acc[rr][c] / l[rr] : 0.f);
    }
    if (lane == 0) lse[(int64_t(b) * H + h) * Sq + i] = l[rr] > 0.f ? m[rr] + logf(l[rr]) : -INFINITY;
  }
}

// Backward, step 1: Dsum_i = rowsum(dO_i * O_i) (in double, as on the CPU), one warp per (b, i, h)
// row, laid out like lse.
template <class T>
__global__ void attention_rowdot_kernel(float* Dsum, const T* dout, const T* out, int64_t rows, int Sq, int H,
                                        int hd) {
  int lane = threadIdx.x % 32;
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;  // (b * Sq + i) * H + h
  if (row >= rows) return;
  double acc = 0.0;
  for (int d = lane; d < hd; d += 32) acc += double(ld(dout[row * hd + d])) * ld(out[row * hd + d]);
  acc = warp_sum(acc);
  int64_t h = row % H, i = (row / H) % Sq, b = row / (int64_t(H) * Sq);
  if (lane == 0) Dsum[(b * H + h) * Sq + i] = float(acc);
}

// Backward, step 2: dQ_i = scale * sum_j dS_ij K_j, with P_ij = exp(s_ij - lse_i),
// dS_ij = P_ij (dO_i . V_j - Dsum_i). Parallel over query rows, loops over key tiles.
template <class T, int NCH, int RPW>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dq_kernel(T* dq, const T* dout, const float* lse, const float* Dsum, const T* q, const T* k,
                        const T* v, const int32_t* qpos, const int32_t* kpos, int Sq, int Sk, int H, int KVH, int hd,
                        float scale) {
  constexpr int BR = kAttnWarps * RPW;
  TS_DYNAMIC_SHARED(float, smem);
  float* Qs = smem;                   // [BR][hd]
  float* dOs = Qs + BR * hd;          // [BR][hd]
  float* Ks = dOs + BR * hd;          // [kTile][hd + 1]
  float* Vs = Ks + kTile * (hd + 1);  // [kTile][hd + 1]
  float* dSs = Vs + kTile * (hd + 1);  // [BR][kTile]
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BR, kvh = h / (H / KVH);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t qs = int64_t(H) * hd, ks = int64_t(KVH) * hd;
  const int64_t qoff = (int64_t(b) * Sq * H + h) * hd, koff = (int64_t(b) * Sk * KVH + kvh) * hd;

  for (int e = threadIdx.x; e < BR * hd; e += blockDim.x) {
    int r = e / hd, d = e % hd;
    bool in = q0 + r < Sq;
    Qs[e] = in ? ld(q[qoff + (q0 + r) * qs + d]) * scale : 0.f;
    dOs[e] = in ? ld(dout[qoff + (q0 + r) * qs + d]) : 0.f;
  }
  int qmax = warp_max_int(lane < BR && q0 + lane < Sq ? qpos[q0 + lane] : INT_MIN);
  int my_qpos[RPW];
  float my_lse[RPW], my_D[RPW], acc[RPW][NCH];
  for (int rr = 0; rr < RPW; rr++) {
    int i = q0 + warp * RPW + rr;
    bool in = i < Sq;
    my_qpos[rr] = in ? qpos[i] : INT_MIN;
    my_lse[rr] = in ? lse[(int64_t(b) * H + h) * Sq + i] : 0.f;
    my_D[rr] = in ? Dsum[(int64_t(b) * H + h) * Sq + i] : 0.f;
    for (int c = 0; c < NCH; c++) acc[rr][c] = 0.f;
  }

  for (int k0 = 0; k0 < Sk; k0 += kTile) {
    const int kj = k0 + lane;
    const int kp = kj < Sk ? kpos[kj] : INT_MAX;
    if (warp_min_int(kp) > qmax) continue;  // uniform over the block; a masked tile adds dS = 0
    for (int e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
      int j = e / hd, d = e % hd;
      bool in = k0 + j < Sk;
      Ks[j * (hd + 1) + d] = in ? ld(k[koff + (k0 + j) * ks + d]) : 0.f;
      Vs[j * (hd + 1) + d] = in ? ld(v[koff + (k0 + j) * ks + d]) : 0.f;
    }
    __syncthreads();

    float s[RPW], dp[RPW];
    for (int rr = 0; rr < RPW; rr++) s[rr] = dp[rr] = 0.f;
    for (int d = 0; d < hd; d++) {
      float kd = Ks[lane * (hd + 1) + d], vd = Vs[lane * (hd + 1) + d];
      for (int rr = 0; rr < RPW; rr++) {
        s[rr] += Qs[(warp * RPW + rr) * hd + d] * kd;
        dp[rr] += dOs[(warp * RPW + rr) * hd + d] * vd;
      }
    }
    for (int rr = 0; rr < RPW; rr++) {
      bool visible = kj < Sk && kp <= my_qpos[rr];
      float p = visible ? expf(s[rr] - my_lse[rr]) : 0.f;
      dSs[(warp * RPW + rr) * kTile + lane] = p * (dp[rr] - my_D[rr]);
    }
    __syncwarp();
    for (int j = 0; j < kTile; j++) {
      for (int c = 0; c < NCH; c++) {
        int d = lane + 32 * c;
        if (d >= hd) break;
        float kd = Ks[j * (hd + 1) + d];
        for (int rr = 0; rr < RPW; rr++) acc[rr][c] += dSs[(warp * RPW + rr) * kTile + j] * kd;
      }
    }
    __syncthreads();
  }

  for (int rr = 0; rr < RPW; rr++) {
    int i = q0 + warp * RPW + rr;
    if (i >= Sq) break;
    T* o = dq + qoff + i * qs;
    for (int c = 0; c < NCH; c++) {
      int d = lane + 32 * c;
      if (d < hd) o[d] = st<T>(acc[rr][c] * scale);
    }
  }
}

// Backward, step 3: dV_j = sum_h sum_i P_ij dO_i and dK_j = sum_h sum_i dS_ij (scale * Q_i), for the
// H/KVH query heads h of key j's group in order. Parallel over key rows, loops over query tiles:
// each dK/dV row has one owner, so no atomics are needed.
template <class T, int NCH, int RPW>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dkv_kernel(T* dk, T* dv, const T* dout, const float* lse, const float* Dsum, const T* q, const T* k,
                         const T* v, const int32_t* qpos, const int32_t* kpos, int Sq, int Sk, int H, int KVH, int hd,
                         float scale) {
  constexpr int BK = kAttnWarps * RPW;
  TS_DYNAMIC_SHARED(float, smem);
  float* Ks = smem;                    // [BK][hd]
  float* Vs = Ks + BK * hd;            // [BK][hd]
  float* Qs = Vs + BK * hd;            // [kTile][hd + 1]
  float* dOs = Qs + kTile * (hd + 1);  // [kTile][hd + 1]
  float* Ps = dOs + kTile * (hd + 1);  // [BK][kTile]
  float* dSs = Ps + BK * kTile;        // [BK][kTile]
  const int b = blockIdx.z, kvh = blockIdx.y, k0 = blockIdx.x * BK, group = H / KVH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t qs = int64_t(H) * hd, ks = int64_t(KVH) * hd;
  const int64_t koff = (int64_t(b) * Sk * KVH + kvh) * hd;

  for (int e = threadIdx.x; e < BK * hd; e += blockDim.x) {
    int r = e / hd, d = e % hd;
    bool in = k0 + r < Sk;
    Ks[e] = in ? ld(k[koff + (k0 + r) * ks + d]) : 0.f;
    Vs[e] = in ? ld(v[koff + (k0 + r) * ks + d]) : 0.f;
  }
  // The block's earliest key position: query tiles that all lie before it see none of its keys.
  int kmin = warp_min_int(lane < BK && k0 + lane < Sk ? kpos[k0 + lane] : INT_MAX);
  int my_kpos[RPW];
  float dk_acc[RPW][NCH], dv_acc[RPW][NCH];
  for (int rr = 0; rr < RPW; rr++) {
    int j = k0 + warp * RPW + rr;
    my_kpos[rr] = j < Sk ? kpos[j] : INT_MAX;  // keys past the end are visible to no query
    for (int c = 0; c < NCH; c++) dk_acc[rr][c] = dv_acc[rr][c] = 0.f;
  }

  for (int g = 0; g < group; g++) {
    const int h = kvh * group + g;
    const int64_t qoff = (int64_t(b) * Sq * H + h) * hd;
    const int64_t stat = (int64_t(b) * H + h) * Sq;  // lse and Dsum row offset
    for (int q0 = 0; q0 < Sq; q0 += kTile) {
      const int i = q0 + lane;
      const int qp = i < Sq ? qpos[i] : INT_MIN;
      if (warp_max_int(qp) < kmin) continue;  // uniform over the block; adds exactly 0
      for (int e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
        int r = e / hd, d = e % hd;
        bool in = q0 + r < Sq;
        Qs[r * (hd + 1) + d] = in ? ld(q[qoff + (q0 + r) * qs + d]) * scale : 0.f;
        dOs[r * (hd + 1) + d] = in ? ld(dout[qoff + (q0 + r) * qs + d]) : 0.f;
      }
      const float my_lse = i < Sq ? lse[stat + i] : 0.f, my_D = i < Sq ? Dsum[stat + i] : 0.f;
      __syncthreads();

      float s[RPW], dp[RPW];
      for (int rr = 0; rr < RPW; rr++) s[rr] = dp[rr] = 0.f;
      for (int d = 0; d < hd; d++) {
        float qd = Qs[lane * (hd + 1) + d], od = dOs[lane * (hd + 1) + d];
        for (int rr = 0; rr < RPW; rr++) {
          s[rr] += Ks[(warp * RPW + rr) * hd + d] * qd;
          dp[rr] += Vs[(warp * RPW + rr) * hd + d] * od;
        }
      }
      for (int rr = 0; rr < RPW; rr++) {
        bool visible = i < Sq && my_kpos[rr] <= qp;
        float p = visible ? expf(s[rr] - my_lse) : 0.f;
        Ps[(warp * RPW + rr) * kTile + lane] = p;
        dSs[(warp * RPW + rr) * kTile + lane] = p * (dp[rr] - my_D);
      }
      __syncwarp();
      for (int ii = 0; ii < kTile; ii++) {
        for (int c = 0; c < NCH; c++) {
          int d = lane + 32 * c;
          if (d >= hd) break;
          float qd = Qs[ii * (hd + 1) + d], od = dOs[ii * (hd + 1) + d];
          for (int rr = 0; rr < RPW; rr++) {
            dv_acc[rr][c] += Ps[(warp * RPW + rr) * kTile + ii] * od;
            dk_acc[rr][c] += dSs[(warp * RPW + rr) * kTile + ii] * qd;
          }
        }
      }
      __syncthreads();
    }
  }

  for (int rr = 0; rr < RPW; rr++) {
    int j = k0 + warp * RPW + rr;
    if (j >= Sk) break;
    T* ok = dk + koff + j * ks;
    T* ov = dv + koff + j * ks;
    for (int c = 0; c < NCH; c++) {
      int d = lane + 32 * c;
      if (d < hd) {
        ok[d] = st<T>(dk_acc[rr][c]);
        ov[d] = st<T>(dv_acc[rr][c]);
      }
    }
  }
}

// Calls f(std::integral_constant<int, NCH>) for NCH = ceil(hd / 32): the per-lane accumulator count
// must be a compile-time constant to stay in registers.
template <class F> static void with_nch(int hd, F&& f) {
  switch ((hd + 31) / 32) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: fatal("attention: head dim %d must be in [1, 128]", hd);
  }
}

AttnDims attn_dims(const Tensor& q, const Tensor& k) {
  AttnDims a{int(q.size(0)), int(q.size(1)), int(k.size(1)), int(q.size(2)), int(k.size(2)), int(q.size(3)), 0.f};
  TS_CHECK(a.hd >= 1 && a.hd <= 128, "attention: head dim %d must be in [1, 128]", a.hd);
  TS_CHECK(a.KVH > 0 && a.H % a.KVH == 0, "attention: %d heads not divisible by %d kv heads", a.H, a.KVH);
  a.scale = 1.0f / sqrtf(float(a.hd));
  return a;
}

const float* attention_row_dots(const Tensor& dout, const Tensor& out, const AttnDims& a) {
  float* Dsum = static_cast<float*>(scratch(sizeof(float) * size_t(a.B) * a.H * a.Sq));
  const int64_t rows = int64_t(a.B) * a.Sq * a.H;
  if (rows == 0) return Dsum;
  with_dtype(out.dtype, "attention_backward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(unsigned((rows + kBlock / 32 - 1) / (kBlock / 32)), kBlock, 0, compute_stream(), attention_rowdot_kernel)(
        Dsum, dout.data<T>(), out.data<T>(), rows, a.Sq, a.H, a.hd);
    KERNEL_CHECK();
  });
  return Dsum;
}

void attention_forward_v1(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& qpos, const Tensor& kpos) {
  AttnDims a = attn_dims(q, k);
  if (a.B == 0 || a.Sq == 0 || a.H == 0) return;
  constexpr int BR = kAttnWarps * kFwdRowsPerWarp;
  size_t smem = sizeof(float) * (BR * a.hd + kTile * (a.hd + 1) + kTile * a.hd + BR * kTile);
  dim3 grid(unsigned((a.Sq + BR - 1) / BR), unsigned(a.H), unsigned(a.B));
  with_dtype(q.dtype, "attention_forward", [&](auto t) {
    using T = decltype(t);
    with_nch(a.hd, [&](auto nch) {
      TS_LAUNCH(grid, kAttnThreads, smem, compute_stream(), attention_forward_kernel<T, decltype(nch)::value, kFwdRowsPerWarp>)(
          out.data<T>(), lse.f32(), q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(), kpos.i32(), a.Sq, a.Sk, a.H,
          a.KVH, a.hd, a.scale);
      KERNEL_CHECK();
    });
  });
}

void attention_backward_v1(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                           const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                           const Tensor& kpos) {
  AttnDims a = attn_dims(q, k);
  if (a.B == 0 || a.H == 0) return;
  const float* Dsum = attention_row_dots(dout, out, a);
  constexpr int BR = kAttnWarps * kBwdRowsPerWarp;
  size_t smem_dq = sizeof(float) * (2 * BR * a.hd + 2 * kTile * (a.hd + 1) + BR * kTile);
  size_t smem_dkv = sizeof(float) * (2 * BR * a.hd + 2 * kTile * (a.hd + 1) + 2 * BR * kTile);
  with_dtype(q.dtype, "attention_backward", [&](auto t) {
    using T = decltype(t);
    with_nch(a.hd, [&](auto nch) {
      [[maybe_unused]] constexpr int NCH = decltype(nch)::value;  // read only inside TS_LAUNCH
      if (a.Sq > 0) {
        dim3 grid(unsigned((a.Sq + BR - 1) / BR), unsigned(a.H), unsigned(a.B));
        TS_LAUNCH(grid, kAttnThreads, smem_dq, compute_stream(), attention_dq_kernel<T, NCH, kBwdRowsPerWarp>)(
            dq.data<T>(), dout.data<T>(), lse.f32(), Dsum, q.data<T>(), k.data<T>(), v.data<T>(), qpos.i32(),
            kpos.i32(), a.Sq, a.Sk, a.H, a.KVH, a.hd, a.scale);
        KERNEL_CHECK();
      }
      if (a.Sk > 0) {
        dim3 grid(unsigned((a.Sk + BR - 1) / BR), unsigned(a.KVH), unsigned(a.B));
        TS_LAUNCH(grid, kAttnThreads, smem_dkv, compute_stream(), attention_dkv_kernel<T, NCH, kBwdRowsPerWarp>)(
            dk.data<T>(), dv.data<T>(), dout.data<T>(), lse.f32(), Dsum, q.data<T>(), k.data<T>(), v.data<T>(),
            qpos.i32(), kpos.i32(), a.Sq, a.Sk, a.H, a.KVH, a.hd, a.scale);
        KERNEL_CHECK();
      }
    });
  });
}

// The ladder's rungs: v2 (attention_v2.cu, tensor cores) where it applies — bf16 activations, head
// dim 64 or 128 — and v1 everywhere else (fp32 runs keep their exact fp32 arithmetic). TS_ATTENTION=v1
// keeps every call on v1, to compare the two on one GPU.
static bool take_v2(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  static const bool v1_only = [] {
    const char* e = getenv("TS_ATTENTION");
    if (e && strcmp(e, "v1") && strcmp(e, "v2")) fatal("TS_ATTENTION=%s: expected v1 or v2", e);
    return e && !strcmp(e, "v1");
  }();
  return !v1_only && attention_v2_supports(q, k, v, out);
}

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& qpos, const Tensor& kpos) {
  if (take_v2(q, k, v, out)) return attention_forward_v2(out, lse, q, k, v, qpos, kpos);
  attention_forward_v1(out, lse, q, k, v, qpos, kpos);
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                        const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                        const Tensor& kpos) {
  if (take_v2(q, k, v, out) && attention_v2_supports(dq, dk, dv, dout))
    return attention_backward_v2(dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos);
  attention_backward_v1(dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos);
}

// ----- context parallelism: the merge of partial attention, the Ulysses packing ------------------

// One thread per row (b, s, h): it owns the row's lse, so the in-place update has no race.
template <class T>
__global__ void attention_merge_kernel(T* out, float* lse, const T* part, const float* plse, int64_t rows, int64_t S,
                                       int64_t H, int64_t hd) {
  for (int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; row < rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = row / (S * H), s = row / H % S, h = row % H, l = (b * H + h) * S + s;
    const float la = lse[l], lb = plse[l], m = fmaxf(la, lb);
    if (m == -INFINITY) continue;  // no visible key in either part
    const float wa = expf(la - m), wb = expf(lb - m), sum = wa + wb;
    lse[l] = m + logf(sum);
    const float ca = wa / sum, cb = wb / sum;
    for (int64_t d = 0; d < hd; d++) out[row * hd + d] = st<T>(ca * ld(out[row * hd + d]) + cb * ld(part[row * hd + d]));
  }
}

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part, const Tensor& part_lse) {
  const int64_t rows = out.size(0) * out.size(1) * out.size(2);
  if (rows == 0) return;
  with_dtype(out.dtype, "attention_merge", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(rows), kBlock, 0, compute_stream(), attention_merge_kernel)(
        out.data<T>(), lse.f32(), part.data<T>(), part_lse.f32(), rows, out.size(1), out.size(2), out.size(3));
    KERNEL_CHECK();
  });
}

// dst[j, i, :] = src[i, j, :] element by element (E: a word of the element's size).
template <class E>
__global__ void swap_leading_kernel(E* dst, const E* src, int64_t n, int64_t a, int64_t b, int64_t w) {
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n; x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = x / (b * w), j = x / w % b, c = x % w;
    dst[(j * a + i) * w + c] = src[x];
  }
}

void swap_leading(const Tensor& dst, const Tensor& src, int64_t a, int64_t b) {
  const int64_t n = src.numel(), w = n / (a * b);
  if (n == 0) return;
  // One word per element, of the element's own size (FP8 codes are one byte).
  auto run = [&](auto word) {
    using E = decltype(word);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), swap_leading_kernel)(dst.data<E>(), src.data<E>(), n, a, b, w);
  };
  switch (dtype_size(src.dtype)) {
    case 4: run(uint32_t{}); break;
    case 2: run(uint16_t{}); break;
    case 1: run(uint8_t{}); break;
    default: fatal("swap_leading: no CUDA kernel for %s", dtype_name(src.dtype));
  }
  KERNEL_CHECK();
}

// ----- SwiGLU ----------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <class T> __global__ void swiglu_forward_kernel(T* h, const T* g, const T* u, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float gv = ld(g[i]);
    h[i] = st<T>(gv * sigmoid(gv) * ld(u[i]));
  }
}

// d silu(g)/dg = sig(g) * (1 + g * (1 - sig(g))). Inputs are read before the outputs are written,
// so dg and du may alias g and u.
template <class T> __global__ void swiglu_backward_kernel(T* dg, T* du, const T* dh, const T* g, const T* u, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float gv = ld(g[i]), uv = ld(u[i]), dhv = ld(dh[i]);
    float sg = sigmoid(gv);
    dg[i] = st<T>(dhv * uv * sg * (1.0f + gv * (1.0f - sg)));
    du[i] = st<T>(dhv * gv * sg);
  }
}

void swiglu_forward(const Tensor& h, const Tensor& g, const Tensor& u) {
  int64_t n = h.numel();
  with_dtype(h.dtype, "swiglu_forward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), swiglu_forward_kernel)(h.data<T>(), g.data<T>(), u.data<T>(), n);
    KERNEL_CHECK();
  });
}

void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& dh, const Tensor& g, const Tensor& u) {
  int64_t n = dh.numel();
  with_dtype(dh.dtype, "swiglu_backward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), swiglu_backward_kernel)(dg.data<T>(), du.data<T>(), dh.data<T>(),
                                                                         g.data<T>(), u.data<T>(), n);
    KERNEL_CHECK();
  });
}

// ----- fused softmax + cross-entropy -----------------------------------------------------------

constexpr int kCeThreads = 512;

// The passes over one row that the cross-entropy kernels share, one block per row: the row max,
// the sum of exp(x - max) in double, and the gradient row (softmax - onehot(tgt)) * scale, each
// thread writing only the entries it read (tgt outside [0, V): another rank owns the target).
template <class T> __device__ float ce_row_max(const T* row, int64_t V, float* sh) {
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, ld(row[i]));
  return block_max(mx, sh);
}
template <class T> __device__ double ce_exp_sum(const T* row, int64_t V, float mx, double* sh) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) sum += expf(ld(row[i]) - mx);
  return block_sum(sum, sh);
}
template <class T>
__device__ void ce_grad_row(T* drow, const T* row, int64_t V, float mx, float inv, int64_t tgt, float scale) {
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    drow[i] = st<T>((expf(ld(row[i]) - mx) * inv - (i == tgt ? 1.f : 0.f)) * scale);
}
__device__ __forceinline__ float ce_loss(float mx, double sum, float xt) {
  return float(double(mx) + log(sum) - double(xt));
}

// One block per row: max, then sum of exp(x - max) (stable for any logit range), then the loss
// and the gradient (softmax - onehot) * grad_scale. The probabilities are never stored.
// A target outside [0, V) gives a NaN loss, which the run's NaN check reports with its step.
template <class T>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_kernel(float* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t V,
                         float grad_scale) {
  __shared__ float sh[32];
  __shared__ double dsh[32];
  const int64_t n = blockIdx.x;
  const T* row = logits + n * V;
  const float mx = ce_row_max(row, V, sh);
  const double sum = ce_exp_sum(row, V, mx, dsh);
  const int64_t tgt = targets[n];
  const bool valid = tgt >= 0 && tgt < V;
  if (threadIdx.x == 0) losses[n] = valid ? ce_loss(mx, sum, ld(row[tgt])) : NAN;
  if (!dlogits) return;
  __syncthreads();  // row[tgt] is read before dlogits, which may alias logits, is written
  ce_grad_row(dlogits + n * V, row, V, mx, float(1.0 / sum), tgt, grad_scale);
}

// An undefined dlogits computes the losses only (evaluation).
void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, float grad_scale) {
  int64_t V = last_dim(logits), N = lead_dims(logits);
  if (N == 0) return;
  with_dtype(logits.dtype, "cross_entropy_forward_backward", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(unsigned(N), kCeThreads, 0, compute_stream(), cross_entropy_kernel)(
        losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(), targets.i32(), V, grad_scale);
    KERNEL_CHECK();
  });
}

// ----- vocabulary-parallel cross-entropy -------------------------------------------------------
// The three steps of the fused kernel on a local block [N, Vl] whose first column is vocabulary
// row vs, one block per row; the caller reduces max and stats over the tp group in between.

template <class T>
__global__ void __launch_bounds__(kCeThreads) vocab_ce_max_kernel(float* mx, const T* logits, int64_t V) {
  __shared__ float sh[32];
  const float m = ce_row_max(logits + blockIdx.x * V, V, sh);
  if (threadIdx.x == 0) mx[blockIdx.x] = m;
}

// A negative target belongs to no rank: its logit is NaN, so the loss is NaN and the run's NaN
// check reports it with its step.
template <class T>
__global__ void __launch_bounds__(kCeThreads)
    vocab_ce_stats_kernel(float* stats, const T* logits, const float* mx, const int32_t* targets, int64_t vs,
                          int64_t N, int64_t V) {
  __shared__ double dsh[32];
  const int64_t n = blockIdx.x, t = targets[n] - vs;
  const T* row = logits + n * V;
  const double sum = ce_exp_sum(row, V, mx[n], dsh);
  if (threadIdx.x != 0) return;
  stats[n] = float(sum);
  stats[N + n] = targets[n] < 0 ? NAN : t >= 0 && t < V ? ld(row[t]) : 0.f;
}

template <class T>
__global__ void __launch_bounds__(kCeThreads)
    vocab_ce_finish_kernel(float* losses, T* dlogits, const T* logits, const float* mx, const float* stats,
                           const int32_t* targets, int64_t vs, int64_t N, int64_t V, float grad_scale) {
  const int64_t n = blockIdx.x;
  const double sum = stats[n];
  if (threadIdx.x == 0) losses[n] = ce_loss(mx[n], sum, stats[N + n]);
  if (dlogits) ce_grad_row(dlogits + n * V, logits + n * V, V, mx[n], float(1.0 / sum), targets[n] - vs, grad_scale);
}

void vocab_ce_max(const Tensor& max, const Tensor& logits) {
  int64_t V = last_dim(logits), N = lead_dims(logits);
  if (N == 0) return;
  with_dtype(logits.dtype, "vocab_ce_max", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(unsigned(N), kCeThreads, 0, compute_stream(), vocab_ce_max_kernel)(max.f32(), logits.data<T>(), V);
    KERNEL_CHECK();
  });
}

void vocab_ce_stats(const Tensor& stats, const Tensor& logits, const Tensor& max, const Tensor& targets,
                    int64_t vocab_start) {
  int64_t V = last_dim(logits), N = lead_dims(logits);
  if (N == 0) return;
  with_dtype(logits.dtype, "vocab_ce_stats", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(unsigned(N), kCeThreads, 0, compute_stream(), vocab_ce_stats_kernel)(
        stats.f32(), logits.data<T>(), max.f32(), targets.i32(), vocab_start, N, V);
    KERNEL_CHECK();
  });
}

// An undefined dlogits computes the losses only (evaluation).
void vocab_ce_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& max,
                     const Tensor& stats, const Tensor& targets, int64_t vocab_start, float grad_scale) {
  int64_t V = last_dim(logits), N = lead_dims(logits);
  if (N == 0) return;
  with_dtype(logits.dtype, "vocab_ce_finish", [&](auto t) {
    using T = decltype(t);
    TS_LAUNCH(unsigned(N), kCeThreads, 0, compute_stream(), vocab_ce_finish_kernel)(
        losses.f32(), dlogits.defined() ? dlogits.data<T>() : nullptr, logits.data<T>(), max.f32(), stats.f32(),
        targets.i32(), vocab_start, N, V, grad_scale);
    KERNEL_CHECK();
  });
}

// ----- AdamW -----------------------------------------------------------------------------------

template <class Tc>
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, Tc* param_copy, int64_t n,
                             float lr, float beta1, float beta2, float eps, float wd, float bc1, float bc2,
                             float grad_scale) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float g = grad[i] * grad_scale;
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / bc1, vhat = vi / bc2;
    float p = param[i];
    p -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p);
    param[i] = p;
    if (param_copy) param_copy[i] = st<Tc>(p);
  }
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p,
                bool decay, float grad_scale, const Tensor& param_copy) {
  int64_t n = param.numel();
  // Bias corrections 1 - beta^t, computed once on the host (in double, then rounded).
  float bc1 = float(1.0 - std::pow(double(p.beta1), double(p.step)));
  float bc2 = float(1.0 - std::pow(double(p.beta2), double(p.step)));
  float wd = decay ? p.weight_decay : 0.f;
  // The compute copy of the weights (bf16, or fp32) is written by the same pass; none: float*.
  with_dtype(param_copy.defined() ? param_copy.dtype : DType::F32, "adamw_step", [&](auto t) {
    using Tc = decltype(t);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), adamw_kernel)(
        param.f32(), grad.f32(), m.f32(), v.f32(), param_copy.defined() ? param_copy.data<Tc>() : nullptr, n, p.lr,
        p.beta1, p.beta2, p.eps, wd, bc1, bc2, grad_scale);
    KERNEL_CHECK();
  });
}

// ----- sum of squares --------------------------------------------------------------------------
// A fixed grid (independent of n and of the GPU) and a fixed tree: the same bits every run.

constexpr int kSumBlocks = 256;
constexpr int kSumThreads = 256;

__global__ void __launch_bounds__(kSumThreads) sum_squares_partial_kernel(double* partial, const float* x, int64_t n) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    double xi = x[i];
    acc += xi * xi;
  }
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kSumBlocks) sum_squares_final_kernel(double* result, const double* partial) {
  __shared__ double sh[32];
  double acc = block_sum(partial[threadIdx.x], sh);
  if (threadIdx.x == 0) *result = acc;
}

double sum_squares(const Tensor& x) {
  double* partial = static_cast<double*>(scratch(sizeof(double) * (kSumBlocks + 1)));
  double* result = partial + kSumBlocks;
  TS_LAUNCH(kSumBlocks, kSumThreads, 0, compute_stream(), sum_squares_partial_kernel)(partial, x.f32(), x.numel());
  KERNEL_CHECK();
  TS_LAUNCH(1, kSumBlocks, 0, compute_stream(), sum_squares_final_kernel)(result, partial);
  KERNEL_CHECK();
  double host = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(double), cudaMemcpyDeviceToHost, compute_stream()));
  sync_compute_stream();
  return host;
}

// Each tensor's partial and final sums run in stream order into its own result slot (the partial
// buffer is reused safely: the stream serialises the launches); one copy and one sync at the end.
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs) {
  const size_t k = xs.size();
  if (k == 0) return {};
  double* partial = static_cast<double*>(scratch(sizeof(double) * (kSumBlocks + k)));
  double* results = partial + kSumBlocks;
  for (size_t i = 0; i < k; i++) {
    TS_CHECK(xs[i].device() == Device::CUDA, "sum_squares_each: every tensor must be on CUDA");
    TS_LAUNCH(kSumBlocks, kSumThreads, 0, compute_stream(), sum_squares_partial_kernel)(partial, xs[i].f32(), xs[i].numel());
    KERNEL_CHECK();
    TS_LAUNCH(1, kSumBlocks, 0, compute_stream(), sum_squares_final_kernel)(results + i, partial);
    KERNEL_CHECK();
  }
  std::vector<double> host(k);
  CUDA_CHECK(cudaMemcpyAsync(host.data(), results, sizeof(double) * k, cudaMemcpyDeviceToHost, compute_stream()));
  sync_compute_stream();
  return host;
}

// ----- counter-based init ----------------------------------------------------------------------

// Element (r, c) of the slice is element (row0 + r, col0 + c) of the global matrix: the same
// rng_normal counter as on the CPU, so a shard holds exactly its part of the full weight.
template <class T>
__global__ void init_normal_kernel(T* t, int64_t n, int64_t cols, uint64_t key, float std, int64_t row0,
                                   int64_t col0, int64_t global_cols) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = i / cols, c = i % cols;
    t[i] = st<T>(std * rng_normal(key, uint64_t((row0 + r) * global_cols + col0 + c)));
  }
}

void init_normal(const Tensor& t, uint64_t key, float std, int64_t row0, int64_t col0, int64_t global_cols) {
  int64_t n = t.numel();
  if (n == 0) return;
  int64_t cols = t.dim() == 1 ? n : n / t.size(0);
  with_dtype(t.dtype, "init_normal", [&](auto tag) {
    using T = decltype(tag);
    TS_LAUNCH(grid_for(n), kBlock, 0, compute_stream(), init_normal_kernel)(t.data<T>(), n, cols, key, std, row0, col0,
                                                                      global_cols);
    KERNEL_CHECK();
  });
}

}  // namespace cuda
}  // namespace ts
#endif  // TS_CUDA
