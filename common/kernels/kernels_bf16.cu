// kernels_bf16.cu — bf16 × bf16 → fp32 GEMMs on AVX512-BF16 and AMX-BF16 (kernels_bf16.h).
//
// Both paths share one packing. op(A) [M, K] is copied row-major into [Mp, Kp] and op(B) [K, N]
// into panels of 16 columns in the "VNNI" order the instructions read: for each pair of rows
// (k, k+1), the 16 columns' two values side by side, [Np/16][Kp/2][16][2]. Mp, Np and Kp are M,
// N and K rounded up to 32 with zeros, so the kernels have no ragged edges: a padded k adds
// 0 · 0 = 0 exactly (no term of a real element changes) and padded rows and columns of C are
// computed and dropped. The hardware forms each product of two bf16 values exactly (8-bit
// significands: a 16-bit product fits fp32's 24) and adds it in fp32, rounding to nearest even,
// with bf16 subnormal inputs read as zero and fp32 subnormal results flushed to zero (both
// instructions, whatever MXCSR says). So a C element is an fp32 sum of exact products, in the
// order the K loop visits them: the same order at any thread count, since threads share blocks of
// C and never the inner dimension. Against sgemm on the widened operands only the order of the
// fp32 additions differs (tests/test_kernels.cpp bounds it; where every partial sum is exact the
// two agree bit for bit).
#include "kernels/kernels_bf16.h"

#include "kernels/kernels_internal.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ts {
namespace cpu {

namespace {

constexpr int64_t kBlock = 32;  // rows and columns of C per block; Kp's granule (one AMX tile's K)
constexpr int64_t kPanel = 16;  // columns of one packed B panel: 16 fp32 lanes, one AMX tile's width

using detail::round_up;

// ----- what the CPU and the kernel offer ---------------------------------------------------------

bool cpuid(unsigned leaf, unsigned sub, unsigned r[4]) { return __get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]); }

// XCR0: which register states the OS saves. AVX-512 needs opmask, ZMM_Hi256 and Hi16_ZMM (bits 5–7)
// beside SSE and AVX (1, 2); AMX needs XTILECFG and XTILEDATA (17, 18).
uint64_t xcr0() {
  unsigned r[4];
  if (!cpuid(1, 0, r) || !(r[2] & (1u << 27))) return 0;  // OSXSAVE: XGETBV usable
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

bool has_avx512_bf16() {
  unsigned r0[4], r1[4];
  if (!cpuid(7, 0, r0) || !cpuid(7, 1, r1)) return false;
  const bool avx512f = r0[1] & (1u << 16), bf16 = r1[0] & (1u << 5);
  return avx512f && bf16 && (xcr0() & 0xE6) == 0xE6;
}

// Linux keeps the 8 KiB of tile data out of a process's state until it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16+); the grant covers every thread.
bool has_amx_bf16() {
  unsigned r[4];
  if (!cpuid(7, 0, r)) return false;
  const bool tile = r[3] & (1u << 24), bf16 = r[3] & (1u << 22);
  if (!tile || !bf16 || (xcr0() & 0x60000) != 0x60000) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

// ----- packing -----------------------------------------------------------------------------------

// Packed A's row stride: Kp plus one cache line, so that the 16 rows of an AMX tile (or the 8 of a
// register tile) never sit a multiple of 4 KiB apart, all in one L1 set (at K = 2048 they would).
int64_t a_stride(int64_t Kp) { return Kp + 32; }

// op(A) [M, K] → ap [Mp, a_stride(Kp)], zero-padded. A transposed A (the weight gradient's dYᵀ,
// stored [K, M]) is the one operand that must be transposed for the instructions: row i of ap
// holds the pairs (A[2q, i], A[2q+1, i]), so rows 2q and 2q+1 of A are first interleaved into
// `il` ([K/2][M] 32-bit pairs, for every i at once, contiguous), and what is left is a transpose
// of 32-bit pairs by 32 × 32 squares, which stay in L1 whatever the strides. Called by every
// thread of bf16_gemm's parallel region: the loops are shared out, each ends on a barrier.
void pack_a(bool transA, int64_t M, int64_t K, const bf16* a, int64_t lda, int64_t Mp, int64_t Kp, bf16* ap,
            uint32_t* il) {
  const int64_t ls = a_stride(Kp), pairs = (K + 1) / 2;
  if (transA) {
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs; q++) {
      const uint16_t* r0 = &a[2 * q * lda].bits;
      uint32_t* out = il + q * M;
      if (2 * q + 1 < K) {
        const uint16_t* r1 = &a[(2 * q + 1) * lda].bits;
        for (int64_t i = 0; i < M; i++) out[i] = r0[i] | uint32_t(r1[i]) << 16;
      } else {  // odd K: the last pair's second value is a padded zero
        for (int64_t i = 0; i < M; i++) out[i] = r0[i];
      }
    }
  }
#pragma omp for schedule(static)
  for (int64_t i0 = 0; i0 < Mp; i0 += 32) {
    const int64_t real = std::max<int64_t>(0, std::min<int64_t>(32, M - i0));  // rows of A in this square
    for (int64_t i = i0; i < i0 + 32; i++) {
      bf16* row = ap + i * ls;
      const int64_t filled = i - i0 < real ? 2 * pairs : 0;
      std::memset(static_cast<void*>(row + filled), 0, (ls - filled) * sizeof(bf16));
      if (i - i0 < real && !transA) std::memcpy(row, a + i * lda, K * sizeof(bf16));
      if (i - i0 < real && !transA && K % 2) row[K] = bf16{0};
    }
    for (int64_t q0 = 0; transA && q0 < pairs; q0 += 32)
      for (int64_t i = i0; i < i0 + real; i++) {
        uint32_t* row = reinterpret_cast<uint32_t*>(ap + i * ls);
        for (int64_t q = q0; q < std::min(pairs, q0 + 32); q++) row[q] = il[q * M + i];
      }
  }
}

// op(B) [K, N] → bp [Np/16][Kp/2][16][2]: panel p, row pair q, column j, then k = 2q and 2q+1
// (element k of column n at ((p·Kp/2 + k/2)·16 + n mod 16)·2 + k mod 2). Each source row is read
// contiguously: a row of B is a row of op(B) (!transB), or a column of it (transB, a weight).
// Called by every thread of bf16_gemm's parallel region, as pack_a is.
void pack_b(bool transB, int64_t K, int64_t N, const bf16* b, int64_t ldb, int64_t Np, int64_t Kp, bf16* bp) {
  const int64_t pairs = Kp / 2;
#pragma omp for schedule(static)
  for (int64_t p = 0; p < Np / kPanel; p++) {
    const int64_t n0 = p * kPanel, cols = std::max<int64_t>(0, std::min(kPanel, N - n0));
    uint16_t* panel = &bp[p * pairs * 2 * kPanel].bits;
    std::memset(static_cast<void*>(panel), 0, pairs * 2 * kPanel * sizeof(uint16_t));
    for (int64_t j = 0; transB && j < cols; j++) {  // column n0 + j of op(B) is row n0 + j of B
      const uint16_t* row = &b[(n0 + j) * ldb].bits;
      for (int64_t k = 0; k < K; k++) panel[(k / 2 * kPanel + j) * 2 + k % 2] = row[k];
    }
    for (int64_t q = 0; !transB && q < (K + 1) / 2; q++) {  // rows 2q and 2q+1, side by side
      const uint16_t* r0 = &b[2 * q * ldb + n0].bits;
      const uint16_t* r1 = 2 * q + 1 < K ? r0 + ldb : nullptr;
      uint16_t* out = panel + q * 2 * kPanel;
      for (int64_t j = 0; j < cols; j++) out[2 * j] = r0[j];
      for (int64_t j = 0; r1 && j < cols; j++) out[2 * j + 1] = r1[j];
    }
  }
}

// C's valid part of one 32 × 32 block from the block's fp32 sums (row-major, 32 wide).
void store_block(const float* acc, int64_t i0, int64_t j0, int64_t M, int64_t N, float alpha, float beta, float* c) {
  const int64_t rows = std::min(kBlock, M - i0), cols = std::min(kBlock, N - j0);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < cols; j++) {
      float& out = c[(i0 + r) * N + j0 + j];
      const float v = alpha * acc[r * kBlock + j];
      out = beta == 0.0f ? v : v + beta * out;
    }
}

// ----- AVX512-BF16: 8 rows × 32 columns of C in 16 registers -----------------------------------

constexpr int kRows = 8;  // rows of a register tile: 8 × 2 vectors = 16 accumulators

// C[kRows, 16·NV] (row stride ldc) = Σ_q A-pair(r, q) · B-pairs(q, v): row r of A at a + r·lda,
// its values 2q and 2q+1 side by side; B's vector v of pair q (16 columns × their two values) at
// b + q·ldq + v·ldv. Each C element adds its products in the order of q, two per instruction.
template <int NV>
__attribute__((target("avx512f,avx512bf16"))) void pair_tile(int64_t pairs, const bf16* a, int64_t lda, const bf16* b,
                                                              int64_t ldq, int64_t ldv, float* c, int64_t ldc) {
  __m512 s[kRows][NV];
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < NV; v++) s[r][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; q++) {
    __m512bh x[NV];
    for (int v = 0; v < NV; v++) x[v] = (__m512bh)_mm512_loadu_si512(b + q * ldq + v * ldv);
    for (int r = 0; r < kRows; r++) {
      int32_t pair;  // A[r, 2q] and A[r, 2q+1], broadcast to the 16 lanes
      std::memcpy(&pair, a + r * lda + 2 * q, sizeof pair);
      const __m512bh y = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; v++) s[r][v] = _mm512_dpbf16_ps(s[r][v], y, x[v]);
    }
  }
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + r * ldc + v * kPanel, s[r][v]);
}

// One 32 × 32 block of C from packed A rows and two packed B panels.
void avx512_block(const bf16* ap, const bf16* bp, int64_t Kp, int64_t i0, int64_t j0, float* acc) {
  const int64_t pairs = Kp / 2, ls = a_stride(Kp);
  const bf16* b0 = bp + (j0 / kPanel) * pairs * 2 * kPanel;
  for (int64_t r0 = 0; r0 < kBlock; r0 += kRows)
    pair_tile<2>(pairs, ap + (i0 + r0) * ls, ls, b0, 2 * kPanel, pairs * 2 * kPanel, acc + r0 * kBlock, kBlock);
}

// ----- AMX-BF16: 2 × 2 tiles of 16 × 16 fp32 per block ----------------------------------------

// The tile configuration (palette 1): tiles 0–3 hold C's four 16 × 16 fp32 quarters, 4–5 A's two
// 16-row strips of 32 bf16 (64 bytes a row), 6–7 the two B panels' 16 row pairs (64 bytes a row).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

__attribute__((target("amx-tile,amx-bf16"))) void amx_block(const bf16* ap, const bf16* bp, int64_t Kp, int64_t i0,
                                                            int64_t j0, float* acc) {
  const int64_t pairs = Kp / 2, ls = a_stride(Kp), astride = ls * sizeof(bf16);
  const bf16* a0 = ap + i0 * ls;
  const bf16* a1 = a0 + 16 * ls;
  const bf16* b0 = bp + (j0 / kPanel) * pairs * 2 * kPanel;
  const bf16* b1 = b0 + pairs * 2 * kPanel;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += kBlock) {  // 32 values of K: 16 row pairs of each B panel
    _tile_loadd(4, a0 + k, astride);
    _tile_loadd(5, a1 + k, astride);
    _tile_loadd(6, b0 + k * kPanel, 64);
    _tile_loadd(7, b1 + k * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t row = kBlock * sizeof(float);
  _tile_stored(0, acc, row);
  _tile_stored(1, acc + kPanel, row);
  _tile_stored(2, acc + 16 * kBlock, row);
  _tile_stored(3, acc + 16 * kBlock + kPanel, row);
}

}  // namespace

void bf16_pair_products(int64_t M, int64_t N, int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                        float* c, int64_t ldc) {
  for (int64_t m = 0; m < M; m += kRows) {
    int64_t n = 0;
    for (; n + 2 * kPanel <= N; n += 2 * kPanel)
      pair_tile<2>(pairs, a + m * lda, lda, b + 2 * n, ldb, 2 * kPanel, c + m * ldc + n, ldc);
    if (n < N) pair_tile<1>(pairs, a + m * lda, lda, b + 2 * n, ldb, 2 * kPanel, c + m * ldc + n, ldc);
  }
}

const char* bf16_gemm_name(Bf16Gemm p) {
  switch (p) {
    case Bf16Gemm::Amx: return "amx";
    case Bf16Gemm::Avx512Bf16: return "avx512-bf16";
    default: return "widen";
  }
}

bool bf16_gemm_available(Bf16Gemm p) {
  static const bool avx512 = has_avx512_bf16(), amx = has_amx_bf16();
  return p == Bf16Gemm::Widen || (p == Bf16Gemm::Avx512Bf16 && avx512) || (p == Bf16Gemm::Amx && amx);
}

// auto: AMX where it runs; AVX512-BF16 on AMD's cores; widening elsewhere. AMD's cores with
// AVX512-BF16 (Zen 4, Zen 5) issue VDPBF16PS at the rate of a 512-bit FMA, so it does twice sgemm's
// multiply-adds per instruction; the Intel core measured here issued it at a quarter of that
// (notes/01). The choice goes by vendor, never by a timing at start-up: a path picked by a race
// would change a run's bits from one launch to the next.
static Bf16Gemm auto_bf16_gemm() {
  if (bf16_gemm_available(Bf16Gemm::Amx)) return Bf16Gemm::Amx;
  if (bf16_gemm_available(Bf16Gemm::Avx512Bf16) && __builtin_cpu_is("amd")) return Bf16Gemm::Avx512Bf16;
  return Bf16Gemm::Widen;
}

static Bf16Gemm choose_bf16_gemm() {
  const char* env = getenv("TS_BF16_GEMM");
  const std::string want = env ? env : "auto";
  if (want == "auto" || want.empty()) return auto_bf16_gemm();
  for (Bf16Gemm p : {Bf16Gemm::Amx, Bf16Gemm::Avx512Bf16, Bf16Gemm::Widen}) {
    if (want != bf16_gemm_name(p)) continue;
    if (!bf16_gemm_available(p)) config_error("TS_BF16_GEMM=%s: this CPU (or its kernel) does not run it", env);
    return p;
  }
  config_error("TS_BF16_GEMM must be auto, amx, avx512-bf16 or widen (got '%s')", env);
}

Bf16Gemm bf16_gemm_path() {
  static const Bf16Gemm p = choose_bf16_gemm();
  return p;
}

std::string bf16_gemm_note() {
  return std::string("bf16 GEMM ") + bf16_gemm_name(bf16_gemm_path()) + (getenv("TS_BF16_GEMM") ? " (TS_BF16_GEMM)" : "");
}

void bf16_gemm(Bf16Gemm path, bool transA, bool transB, int64_t M, int64_t N, int64_t K, float alpha, const bf16* a,
               int64_t lda, const bf16* b, int64_t ldb, float beta, float* c) {
  if (path == Bf16Gemm::Widen || !bf16_gemm_available(path))
    fatal("bf16_gemm: path %s is not available here", bf16_gemm_name(path));
  const int64_t Mp = round_up(M, kBlock), Np = round_up(N, kBlock), Kp = round_up(std::max<int64_t>(K, 1), kBlock);
  Tensor ta = Tensor::empty({Mp * a_stride(Kp)}, DType::BF16, Device::CPU, Tag::Workspace);
  Tensor tb = Tensor::empty({Np * Kp}, DType::BF16, Device::CPU, Tag::Workspace);
  Tensor til;  // transA: A's row pairs interleaved, (K + 1) / 2 × M 32-bit pairs
  if (transA) til = Tensor::empty({(K + 1) / 2 * M}, DType::F32, Device::CPU, Tag::Workspace);
  uint32_t* il = transA ? reinterpret_cast<uint32_t*>(til.f32()) : nullptr;
  bf16* ap = ta.b16();
  bf16* bp = tb.b16();
  const int64_t rows = Mp / kBlock, cols = Np / kBlock;
  const bool amx = path == Bf16Gemm::Amx;
  // One parallel region for the packing and the product: a thread that has gone to sleep between
  // regions (threads.h) costs a wake-up, as much as a small GEMM's work, and the barriers inside
  // one region are cheaper.
  // Blocks go column panel by column panel, so that consecutive blocks of a thread reuse B's panels.
#pragma omp parallel
  {
    pack_a(transA, M, K, a, lda, Mp, Kp, ap, il);
    pack_b(transB, K, N, b, ldb, Np, Kp, bp);
    alignas(64) float acc[kBlock * kBlock];
    if (amx) amx_configure();
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < rows * cols; blk++) {
      const int64_t i0 = (blk % rows) * kBlock, j0 = (blk / rows) * kBlock;
      if (amx)
        amx_block(ap, bp, Kp, i0, j0, acc);
      else
        avx512_block(ap, bp, Kp, i0, j0, acc);
      store_block(acc, i0, j0, M, N, alpha, beta, c);
    }
    if (amx) amx_release();
  }
}

}  // namespace cpu
}  // namespace ts
