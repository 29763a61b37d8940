// attention_v2.cu — rung 2 of the attention ladder: FlashAttention-2 on tensor cores.
//
// Rung 1 (kernels_cuda.cu, "causal GQA attention") computes every score and every output element
// with fp32 fused multiply-adds on the CUDA cores, one shared-memory load per FMA. This rung keeps
// its contract (kernels.h: out and lse in the same layouts, lse = m + log l, -inf for a query that
// sees no key, masks by positions, GQA without expanding K/V) and moves the arithmetic onto the
// tensor cores: bf16 operands, fp32 accumulators, on mma.sync.m16n8k16 fed by ldmatrix
// (tensor_core.h). What FlashAttention-2 (Dao 2023) changes over the first FlashAttention, and
// what this file takes from it:
//   * the forward is parallel over query blocks; each warp owns 16 query rows for the whole key
//     loop, so the online softmax's running max and sum stay in its registers;
//   * the backward is parallel over key/value blocks (each warp owns 16 keys' dK and dV).
//     FlashAttention-2 adds dQ with float atomics from every key block; here dQ has a kernel of its
//     own, parallel over query blocks, that recomputes S and dP (three tile products instead of
//     one), so that every output element has one owner and runs stay bitwise reproducible;
//   * key tiles that lie wholly after a query block (and query tiles wholly before a key block)
//     are skipped: about half the work of a causal S × S attention.
//
// Layout of one warp's tile products (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane l with
// g = l / 4 and t = l % 4 holds, of a 16 × 8 fp32 accumulator tile, rows g and g + 8 at columns
// 2t and 2t + 1. The accumulators of two neighbouring 8-column tiles are exactly the A fragment
// of a 16 × 16 bf16 operand once rounded and packed in pairs (pack_a), so P = softmax(S) feeds the
// next product without a trip through shared memory. Operands that are used as B come from
// row-major tiles in shared memory: K for S = Q Kᵀ by plain ldmatrix (a K row is a column of Kᵀ),
// V for O = P V by ldmatrix.trans.
//
// Shared-memory tiles hold bf16 rows padded by 8 elements (16 bytes): the eight rows one ldmatrix
// phase reads then start in eight different groups of four banks, so they never conflict, and
// every row stays 16-byte aligned as ldmatrix requires. Tiles are filled 16 bytes per thread per
// step, rows past the end of the sequence with zeros (0 · garbage could be NaN).
//
// Compiled by g++ in a CPU-only build, this file is empty.
#ifdef TS_CUDA
#include <climits>
#include <cmath>

#include "kernels/kernels_cuda_internal.h"
#include "kernels/tensor_core.h"
#include "tensor/device.h"

namespace ts {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kOwn = 16 * kWarps;  // rows a block owns: 16 per warp (mma's M)
constexpr int kTile = 32;          // rows of the streamed side per step: one per lane
constexpr int kPad = 8;            // bf16 elements of padding per shared-memory row

struct alignas(16) Chunk {  // 16 bytes: one vectorised load or store
  uint32_t w[4];
};

// rows [first, first + ROWS) of a [count, stride] bf16 matrix into a padded tile; zeros past count.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, int64_t stride, int first, int count) {
  constexpr int kChunks = HD / 8;  // per row; a power of two, so / and % are shifts
  for (int e = threadIdx.x; e < ROWS * kChunks; e += kThreads) {
    const int r = e / kChunks, c = e % kChunks;
    Chunk v{};
    if (first + r < count) v = *reinterpret_cast<const Chunk*>(src + (first + r) * stride + 8 * c);
    *reinterpret_cast<Chunk*>(tile + r * (HD + kPad) + 8 * c) = v;
  }
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  return uint32_t(float_to_bf16(lo).bits) | uint32_t(float_to_bf16(hi).bits) << 16;
}
// The A fragment of columns [16c, 16c + 16) from the accumulators of 8-column tiles 2c and 2c + 1.
__device__ __forceinline__ void pack_a(uint32_t a[4], const float lo[4], const float hi[4]) {
  a[0] = pack(lo[0], lo[1]);
  a[1] = pack(lo[2], lo[3]);
  a[2] = pack(hi[0], hi[1]);
  a[3] = pack(hi[2], hi[3]);
}

// ldmatrix addresses. A fragments (16 rows × 16 columns at row0, col0 of a tile) and the B
// fragments of two 8-column tiles: lane l names row l % 8 of matrix l / 8.
__device__ __forceinline__ const bf16* a_rows(const bf16* tile, int ld, int row0, int col0) {
  const int l = threadIdx.x % 32;
  return tile + (row0 + l % 16) * ld + col0 + 8 * (l / 16);
}
// Bᵀ stored row-major (rows n, columns k), as K is for Q Kᵀ: matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
// (n 8-15, k 0-7), (n 8-15, k 8-15); registers 0-1 serve columns n0.., 2-3 columns n0 + 8...
__device__ __forceinline__ const bf16* bt_rows(const bf16* tile, int ld, int n0, int k0) {
  const int l = threadIdx.x % 32;
  return tile + (n0 + l % 8 + 8 * (l / 16)) * ld + k0 + 8 * (l / 8 % 2);
}
// B stored row-major (rows k, columns n), as V is for P V, loaded with .trans: matrices (k 0-7,
// n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
__device__ __forceinline__ const bf16* b_rows(const bf16* tile, int ld, int k0, int n0) {
  const int l = threadIdx.x % 32;
  return tile + (k0 + l % 16) * ld + n0 + 8 * (l / 16);
}

// acc[NT][4] += A (16 × HD, as KC = HD/16 fragments) · Bᵀ where B's NT·8 rows of HD sit in tile.
template <int HD, int NT>
__device__ __forceinline__ void mma_abt(float acc[][4], const uint32_t a[][4], const bf16* tile) {
#pragma unroll
  for (int kc = 0; kc < HD / 16; kc++)
#pragma unroll
    for (int np = 0; np < NT / 2; np++) {
      uint32_t b[4];
      TS_LDMATRIX_X4(b, bt_rows(tile, HD + kPad, 16 * np, 16 * kc));
      TS_MMA_M16N8K16_BF16(acc[2 * np], a[kc], b, acc[2 * np]);
      TS_MMA_M16N8K16_BF16(acc[2 * np + 1], a[kc], b + 2, acc[2 * np + 1]);
    }
}
// acc[HD/8][4] += P (16 × KT·8, accumulator layout, rounded to bf16) · tile (KT·8 rows of HD).
template <int HD, int KT>
__device__ __forceinline__ void mma_pb(float acc[][4], const float p[][4], const bf16* tile) {
#pragma unroll
  for (int kc = 0; kc < KT / 2; kc++) {
    uint32_t a[4];
    pack_a(a, p[2 * kc], p[2 * kc + 1]);
#pragma unroll
    for (int np = 0; np < HD / 16; np++) {
      uint32_t b[4];
      TS_LDMATRIX_X4_TRANS(b, b_rows(tile, HD + kPad, 16 * kc, 16 * np));
      TS_MMA_M16N8K16_BF16(acc[2 * np], a, b, acc[2 * np]);
      TS_MMA_M16N8K16_BF16(acc[2 * np + 1], a, b + 2, acc[2 * np + 1]);
    }
  }
}
// A warp's 16 rows of a tile (row0 its first) as A fragments.
template <int HD> __device__ __forceinline__ void load_a(uint32_t a[][4], const bf16* tile, int row0) {
#pragma unroll
  for (int kc = 0; kc < HD / 16; kc++) TS_LDMATRIX_X4(a[kc], a_rows(tile, HD + kPad, row0, 16 * kc));
}

// The block's own kOwn rows of two matrices (Q and dO, or K and V: [count, stride] at src1, src2)
// through shared memory into each warp's registers, its 16 rows as A fragments.
template <int HD>
__device__ __forceinline__ void own_rows(uint32_t a1[][4], uint32_t a2[][4], bf16* smem, const bf16* src1,
                                         const bf16* src2, int64_t stride, int first, int count) {
  bf16* t2 = smem + kOwn * (HD + kPad);
  load_tile<HD, kOwn>(smem, src1, stride, first, count);
  load_tile<HD, kOwn>(t2, src2, stride, first, count);
  __syncthreads();
  load_a<HD>(a1, smem, 16 * (threadIdx.x / 32));
  load_a<HD>(a2, t2, 16 * (threadIdx.x / 32));
}

// The four lanes that share a row (t = 0..3) combine their values, in a fixed order.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// A warp's accumulator rows (g and g + 8 of its 16, the first being row0) times mul[x], rounded to
// bf16 into rows of a [n, stride] matrix at base; rows at or past n are not stored.
template <int HD>
__device__ __forceinline__ void store_rows(bf16* base, int64_t stride, int row0, int n, const float acc[][4],
                                           const float mul[2]) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int x = 0; x < 2; x++) {
    const int i = row0 + g + 8 * x;
    if (i >= n) continue;
    bf16* row = base + i * stride;
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++)
#pragma unroll
      for (int e = 0; e < 2; e++) row[8 * dt + 2 * t + e] = float_to_bf16(acc[dt][2 * x + e] * mul[x]);
  }
}

struct Rows {  // where head h of batch b starts in q-like [B, S, H, HD] and k-like tensors
  int64_t q, k, qs, ks, stat;  // offsets (elements), row strides, lse/Dsum row offset
};
template <int HD> __device__ __forceinline__ Rows rows_of(int b, int h, int kvh, int Sq, int Sk, int H, int KVH) {
  return {(int64_t(b) * Sq * H + h) * HD, (int64_t(b) * Sk * KVH + kvh) * HD, int64_t(H) * HD, int64_t(KVH) * HD,
          (int64_t(b) * H + h) * Sq};
}

// ----- forward ---------------------------------------------------------------------------------

// One key tile into the running softmax of a warp's rows (x = 0: row g, x = 1: row g + 8): s holds
// the tile's raw scores q·k and leaves holding p = exp(scale·s - m_new), 0 where masked; m, l and
// the output accumulators are rescaled by exp(m_old - m_new).
template <int HD>
__device__ __forceinline__ void online_softmax(float s[][4], float m[2], float l[2], float o[][4], const int qp[2],
                                               const int* kpos_tile, int keys_left, float scale) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int x = 0; x < 2; x++) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kTile / 8; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int c = 8 * nt + 2 * t + e;
        float& v = s[nt][2 * x + e];
        v = c < keys_left && kpos_tile[c] <= qp[x] ? v * scale : -INFINITY;
        mx = fmaxf(mx, v);
      }
    const float m_new = fmaxf(m[x], quad_max(mx));
    // m_new is -inf only while every key so far is masked: l and o are still 0 then.
    const float corr = m_new == -INFINITY ? 1.f : expf(m[x] - m_new);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kTile / 8; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        float& v = s[nt][2 * x + e];
        v = v == -INFINITY ? 0.f : expf(v - m_new);
        sum += v;
      }
    l[x] = l[x] * corr + quad_sum(sum);
    m[x] = m_new;
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) o[dt][2 * x] *= corr, o[dt][2 * x + 1] *= corr;
  }
}

// Block = (64 queries, head, batch); warp w owns queries 16w..16w+15 of the block.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_v2_forward_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const int32_t* qpos,
                            const int32_t* kpos, int Sq, int Sk, int H, int KVH, float scale) {
  constexpr int LD = HD + kPad;
  TS_DYNAMIC_SHARED(Chunk, smem);
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [kOwn][LD]
  bf16* Ks = Qs + kOwn * LD;                 // [kTile][LD]
  bf16* Vs = Ks + kTile * LD;                // [kTile][LD]
  __shared__ int Kp[kTile];
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kOwn;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const Rows R = rows_of<HD>(b, h, h / (H / KVH), Sq, Sk, H, KVH);

  load_tile<HD, kOwn>(Qs, q + R.q, R.qs, q0, Sq);
  __syncthreads();
  uint32_t qa[HD / 16][4];
  load_a<HD>(qa, Qs, 16 * warp);
  int qp[2];
#pragma unroll
  for (int x = 0; x < 2; x++) qp[x] = q0 + 16 * warp + g + 8 * x < Sq ? qpos[q0 + 16 * warp + g + 8 * x] : INT_MIN;
  const int qmax = warp_max_int(max(q0 + lane < Sq ? qpos[q0 + lane] : INT_MIN,
                                    q0 + 32 + lane < Sq ? qpos[q0 + 32 + lane] : INT_MIN));
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[HD / 8][4] = {};

  for (int k0 = 0; k0 < Sk; k0 += kTile) {
    const int kp = k0 + lane < Sk ? kpos[k0 + lane] : INT_MAX;
    if (warp_min_int(kp) > qmax) continue;  // the same in every warp: a fully masked tile adds nothing
    load_tile<HD, kTile>(Ks, k + R.k, R.ks, k0, Sk);
    load_tile<HD, kTile>(Vs, v + R.k, R.ks, k0, Sk);
    if (warp == 0) Kp[lane] = kp;
    __syncthreads();
    float s[kTile / 8][4] = {};
    mma_abt<HD, kTile / 8>(s, qa, Ks);  // S = Q Kᵀ
    online_softmax<HD>(s, m, l, o, qp, Kp, Sk - k0, scale);
    mma_pb<HD, kTile / 8>(o, s, Vs);  // O += P V
    __syncthreads();  // the next tile overwrites Ks, Vs, Kp
  }

  // A query that sees no key gets out = 0, lse = -inf: the neutral element of 06's merge.
  const float inv_l[2] = {l[0] > 0.f ? 1.f / l[0] : 0.f, l[1] > 0.f ? 1.f / l[1] : 0.f};
  store_rows<HD>(out + R.q, R.qs, q0 + 16 * warp, Sq, o, inv_l);
#pragma unroll
  for (int x = 0; x < 2; x++)
    if (t == 0 && q0 + 16 * warp + g + 8 * x < Sq)
      lse[R.stat + q0 + 16 * warp + g + 8 * x] = l[x] > 0.f ? m[x] + logf(l[x]) : -INFINITY;
}

// ----- backward --------------------------------------------------------------------------------
// With P_ij = exp(scale·q_i·k_j - lse_i) and Dsum_i = rowsum(dO_i ∘ O_i) (kernels_cuda.cu):
// dV_j = Σ_i P_ij dO_i, dS_ij = P_ij (dO_i·V_j - Dsum_i), dK_j = scale Σ_i dS_ij Q_i and
// dQ_i = scale Σ_j dS_ij K_j. The softmax is recomputed from lse: nothing of size S × S is stored.

// dQ: block = (64 queries, head, batch), loops over key tiles. Q and dO stay in registers as A
// fragments; their shared memory is then reused for the key tiles.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_v2_dq_kernel(bf16* dq, const bf16* dout, const float* lse, const float* Dsum, const bf16* q, const bf16* k,
                       const bf16* v, const int32_t* qpos, const int32_t* kpos, int Sq, int Sk, int H, int KVH,
                       float scale) {
  constexpr int LD = HD + kPad;
  TS_DYNAMIC_SHARED(Chunk, smem);
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [kOwn][LD], then Ks [kTile][LD]
  bf16* dOs = Qs + kOwn * LD;                // [kOwn][LD], then Vs [kTile][LD]
  __shared__ int Kp[kTile];
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kOwn;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const Rows R = rows_of<HD>(b, h, h / (H / KVH), Sq, Sk, H, KVH);

  uint32_t qa[HD / 16][4], da[HD / 16][4];
  own_rows<HD>(qa, da, Qs, q + R.q, dout + R.q, R.qs, q0, Sq);
  int qp[2];
  float L[2], D[2];
#pragma unroll
  for (int x = 0; x < 2; x++) {
    const int i = q0 + 16 * warp + g + 8 * x;
    qp[x] = i < Sq ? qpos[i] : INT_MIN;
    L[x] = i < Sq ? lse[R.stat + i] : 0.f;
    D[x] = i < Sq ? Dsum[R.stat + i] : 0.f;
  }
  const int qmax = warp_max_int(max(q0 + lane < Sq ? qpos[q0 + lane] : INT_MIN,
                                    q0 + 32 + lane < Sq ? qpos[q0 + 32 + lane] : INT_MIN));
  bf16 *Ks = Qs, *Vs = dOs;
  float acc[HD / 8][4] = {};
  __syncthreads();  // every warp holds its fragments before the tiles are overwritten

  for (int k0 = 0; k0 < Sk; k0 += kTile) {
    const int kp = k0 + lane < Sk ? kpos[k0 + lane] : INT_MAX;
    if (warp_min_int(kp) > qmax) continue;
    load_tile<HD, kTile>(Ks, k + R.k, R.ks, k0, Sk);
    load_tile<HD, kTile>(Vs, v + R.k, R.ks, k0, Sk);
    if (warp == 0) Kp[lane] = kp;
    __syncthreads();
    float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
    mma_abt<HD, kTile / 8>(s, qa, Ks);   // S = Q Kᵀ
    mma_abt<HD, kTile / 8>(dp, da, Vs);  // dP = dO Vᵀ
#pragma unroll
    for (int nt = 0; nt < kTile / 8; nt++)
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const int c = 8 * nt + 2 * t + r % 2, x = r / 2;
        const float p = c < Sk - k0 && Kp[c] <= qp[x] ? expf(s[nt][r] * scale - L[x]) : 0.f;
        s[nt][r] = p * (dp[nt][r] - D[x]);  // dS
      }
    mma_pb<HD, kTile / 8>(acc, s, Ks);  // dQ += dS K
    __syncthreads();
  }

  const float mul[2] = {scale, scale};
  store_rows<HD>(dq + R.q, R.qs, q0 + 16 * warp, Sq, acc, mul);
}

// One query tile's contribution to a warp's 16 keys: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, then dV += Pᵀ dO and
// dK += dSᵀ Q. Columns are the tile's queries (per-query lse, Dsum and position in shared memory).
template <int HD>
__device__ __forceinline__ void dkv_tile(float dk[][4], float dv[][4], const uint32_t ka[][4], const uint32_t va[][4],
                                         const bf16* Qs, const bf16* dOs, const int* Qp, const float* L,
                                         const float* D, const int kp[2], int queries_left, float scale) {
  const int t = threadIdx.x % 4;
  float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
  mma_abt<HD, kTile / 8>(s, ka, Qs);   // Sᵀ = K Qᵀ
  mma_abt<HD, kTile / 8>(dp, va, dOs);  // dPᵀ = V dOᵀ
#pragma unroll
  for (int nt = 0; nt < kTile / 8; nt++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int c = 8 * nt + 2 * t + r % 2, x = r / 2;
      const float p = c < queries_left && kp[x] <= Qp[c] ? expf(s[nt][r] * scale - L[c]) : 0.f;
      s[nt][r] = p;                      // Pᵀ
      dp[nt][r] = p * (dp[nt][r] - D[c]);  // dSᵀ
    }
  mma_pb<HD, kTile / 8>(dv, s, dOs);  // dV += Pᵀ dO
  mma_pb<HD, kTile / 8>(dk, dp, Qs);  // dK += dSᵀ Q
}

// dK, dV: block = (64 keys, kv head, batch), loops over the query heads of its GQA group and their
// query tiles; K and V stay in registers as A fragments. Every dK/dV row has one owner.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_v2_dkv_kernel(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* Dsum, const bf16* q,
                        const bf16* k, const bf16* v, const int32_t* qpos, const int32_t* kpos, int Sq, int Sk, int H,
                        int KVH, float scale) {
  constexpr int LD = HD + kPad;
  TS_DYNAMIC_SHARED(Chunk, smem);
  bf16* Ks = reinterpret_cast<bf16*>(smem);  // [kOwn][LD], then Qs [kTile][LD]
  bf16* Vs = Ks + kOwn * LD;                 // [kOwn][LD], then dOs [kTile][LD]
  __shared__ int Qp[kTile];
  __shared__ float L[kTile], D[kTile];
  const int b = blockIdx.z, kvh = blockIdx.y, k0 = blockIdx.x * kOwn, group = H / KVH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const Rows R0 = rows_of<HD>(b, kvh * group, kvh, Sq, Sk, H, KVH);

  uint32_t ka[HD / 16][4], va[HD / 16][4];
  own_rows<HD>(ka, va, Ks, k + R0.k, v + R0.k, R0.ks, k0, Sk);
  int kp[2];  // keys past the end are visible to no query
#pragma unroll
  for (int x = 0; x < 2; x++) kp[x] = k0 + 16 * warp + g + 8 * x < Sk ? kpos[k0 + 16 * warp + g + 8 * x] : INT_MAX;
  const int kmin = warp_min_int(min(k0 + lane < Sk ? kpos[k0 + lane] : INT_MAX,
                                    k0 + 32 + lane < Sk ? kpos[k0 + 32 + lane] : INT_MAX));
  bf16 *Qs = Ks, *dOs = Vs;
  float dka[HD / 8][4] = {}, dva[HD / 8][4] = {};
  __syncthreads();

  for (int gi = 0; gi < group; gi++) {
    const Rows R = rows_of<HD>(b, kvh * group + gi, kvh, Sq, Sk, H, KVH);
    for (int q0 = 0; q0 < Sq; q0 += kTile) {
      const int i = q0 + lane;
      const int qp = i < Sq ? qpos[i] : INT_MIN;
      if (warp_max_int(qp) < kmin) continue;  // the same in every warp; adds exactly 0
      load_tile<HD, kTile>(Qs, q + R.q, R.qs, q0, Sq);
      load_tile<HD, kTile>(dOs, dout + R.q, R.qs, q0, Sq);
      if (warp == 0) {
        Qp[lane] = qp;
        L[lane] = i < Sq ? lse[R.stat + i] : 0.f;
        D[lane] = i < Sq ? Dsum[R.stat + i] : 0.f;
      }
      __syncthreads();
      dkv_tile<HD>(dka, dva, ka, va, Qs, dOs, Qp, L, D, kp, Sq - q0, scale);
      __syncthreads();
    }
  }

  const float mul_k[2] = {scale, scale}, mul_v[2] = {1.f, 1.f};
  store_rows<HD>(dk + R0.k, R0.ks, k0 + 16 * warp, Sk, dka, mul_k);
  store_rows<HD>(dv + R0.k, R0.ks, k0 + 16 * warp, Sk, dva, mul_v);
}

// Calls f(std::integral_constant<int, HD>) for the head dims this rung is built for.
template <class F> void with_head_dim(int hd, F&& f) {
  if (hd == 64) f(std::integral_constant<int, 64>{});
  else if (hd == 128) f(std::integral_constant<int, 128>{});
  else fatal("attention v2: head dim %d (this rung is built for 64 and 128)", hd);
}

}  // namespace

bool attention_v2_supports(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  const int64_t hd = q.size(3);
  auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0; };
  return q.dtype == DType::BF16 && (hd == 64 || hd == 128) && aligned(q) && aligned(k) && aligned(v) && aligned(out);
}

void attention_forward_v2(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& qpos, const Tensor& kpos) {
  const AttnDims a = attn_dims(q, k);
  TS_CHECK(attention_v2_supports(q, k, v, out), "attention v2: needs bf16, head dim 64 or 128, 16-byte aligned rows");
  if (a.B == 0 || a.Sq == 0 || a.H == 0) return;
  const dim3 grid(unsigned((a.Sq + kOwn - 1) / kOwn), unsigned(a.H), unsigned(a.B));
  // Shared memory: the block's query rows and one key and one value tile, padded bf16 rows.
  const size_t smem = sizeof(bf16) * (a.hd + kPad) * (kOwn + 2 * kTile);
  with_head_dim(a.hd, [&](auto hd) {
    TS_LAUNCH(grid, kThreads, smem, compute_stream(), flash_v2_forward_kernel<decltype(hd)::value>)(
        out.b16(), lse.f32(), q.b16(), k.b16(), v.b16(), qpos.i32(), kpos.i32(), a.Sq, a.Sk, a.H, a.KVH, a.scale);
    KERNEL_CHECK();
  });
}

void attention_backward_v2(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                           const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                           const Tensor& kpos) {
  const AttnDims a = attn_dims(q, k);
  TS_CHECK(attention_v2_supports(q, k, v, dout) && attention_v2_supports(dq, dk, dv, out),
           "attention v2: needs bf16, head dim 64 or 128, 16-byte aligned rows");
  if (a.B == 0 || a.H == 0) return;
  const float* Dsum = attention_row_dots(dout, out, a);
  // Shared memory: the block's own rows of two matrices (then reused for two streamed tiles).
  const size_t smem = sizeof(bf16) * (a.hd + kPad) * (2 * kOwn);
  with_head_dim(a.hd, [&](auto hd) {
    [[maybe_unused]] constexpr int HD = decltype(hd)::value;  // read only inside TS_LAUNCH
    if (a.Sq > 0) {
      const dim3 grid(unsigned((a.Sq + kOwn - 1) / kOwn), unsigned(a.H), unsigned(a.B));
      TS_LAUNCH(grid, kThreads, smem, compute_stream(), flash_v2_dq_kernel<HD>)(
          dq.b16(), dout.b16(), lse.f32(), Dsum, q.b16(), k.b16(), v.b16(), qpos.i32(), kpos.i32(), a.Sq, a.Sk, a.H,
          a.KVH, a.scale);
      KERNEL_CHECK();
    }
    if (a.Sk > 0) {
      const dim3 grid(unsigned((a.Sk + kOwn - 1) / kOwn), unsigned(a.KVH), unsigned(a.B));
      TS_LAUNCH(grid, kThreads, smem, compute_stream(), flash_v2_dkv_kernel<HD>)(
          dk.b16(), dv.b16(), dout.b16(), lse.f32(), Dsum, q.b16(), k.b16(), v.b16(), qpos.i32(), kpos.i32(), a.Sq,
          a.Sk, a.H, a.KVH, a.scale);
      KERNEL_CHECK();
    }
  });
}

}  // namespace cuda
}  // namespace ts
#endif  // TS_CUDA
