// ranks: 1
// The FP8 substrate (fp8.h, fp8.cu) against references written here, independent of its code:
// the 256 codes of each OCP format from the spec's formula; encoding against a brute-force nearest
// search over those values (ties to the even code, satfinite), on a million random floats and on
// every midpoint between adjacent codes; scale_for's edge cases; amax and quantization on ragged
// tiles; the scaled GEMM against a double-precision sum of the dequantized operands within a
// derived fp32 bound, exactly on small integers, and the accumulator emulation (DeepSeek-V3
// §3.3.2: 14-bit accumulation loses accuracy with K, promotion every 128 products recovers it).
// Error paths run with a fatal hook that throws, since fatal() would end the process.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "tensor/device.h"
#include "tensor/hooks.h"
#include "tensor/rng.h"
#include "kernels/fp8.h"
#include "kernels/kernels.h"
#ifdef TS_CUDA_EMU
#include "emu.h"
#endif

using namespace ts;
using Vec = std::vector<float>;

namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();

// A format as the OCP spec describes it (§4): exponent and mantissa widths and the bias.
struct Format {
  DType dt;
  int E, M, bias;
  uint8_t max_code, nan_code;  // the largest finite magnitude code, and the NaN encode produces
  bool e5m2() const { return dt == DType::F8E5M2; }
};
const Format kE4M3{DType::F8E4M3, 4, 3, 7, 0x7e, 0x7f}, kE5M2{DType::F8E5M2, 5, 2, 15, 0x7b, 0x7e};

// The spec's value of a code: (-1)^s · 2^(e - bias) · (1 + f / 2^M), or 2^(1 - bias) · f / 2^M
// for e = 0. e4m3fn has no infinities (S.1111.111 is its only NaN); e5m2 is IEEE-like.
double ref_decode(const Format& f, int code) {
  const int s = code >> 7, e = (code >> f.M) & ((1 << f.E) - 1), m = code & ((1 << f.M) - 1);
  const int emax = (1 << f.E) - 1;
  double v;
  if (!f.e5m2() && e == emax && m == (1 << f.M) - 1) return kNaN;
  if (f.e5m2() && e == emax) v = m ? kNaN : INFINITY;
  else if (e == 0) v = std::ldexp(double(m) / (1 << f.M), 1 - f.bias);
  else v = std::ldexp(1.0 + double(m) / (1 << f.M), e - f.bias);
  return s ? -v : v;
}

float dec(const Format& f, uint8_t c) { return f.e5m2() ? fp8::decode_e5m2(c) : fp8::decode_e4m3(c); }
uint8_t enc(const Format& f, float x) { return f.e5m2() ? fp8::encode_e5m2(x) : fp8::encode_e4m3(x); }

// The non-negative finite values, indexed by code 0 .. max_code (increasing).
std::vector<double> finite_values(const Format& f) {
  std::vector<double> v;
  for (int c = 0; c <= f.max_code; c++) v.push_back(ref_decode(f, c));
  return v;
}

// The expected code by brute force: the nearest finite value, a tie to the even code (the even
// mantissa LSB), anything at or past the largest value (and ±inf) saturated to ±max, NaN to NaN.
uint8_t ref_encode(const Format& f, const std::vector<double>& vals, float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | f.nan_code;
  const double a = std::fabs(double(x));
  if (a >= vals.back()) return sign | f.max_code;
  const int hi = int(std::lower_bound(vals.begin(), vals.end(), a) - vals.begin());  // vals[hi] >= a
  if (vals[hi] == a || hi == 0) return sign | uint8_t(hi);
  const double dlo = a - vals[hi - 1], dhi = vals[hi] - a;
  const int c = dlo < dhi ? hi - 1 : dhi < dlo ? hi : (hi % 2 == 0 ? hi : hi - 1);
  return sign | uint8_t(c);
}

float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

Tensor make(std::vector<int64_t> shape, const Vec& vals, DType dt = DType::F32) {
  Tensor t = Tensor::empty(std::move(shape), dt, Device::CPU, Tag::Activations);
  REQUIRE(size_t(t.numel()) == vals.size());
  from_host_f32(t, vals.data());
  return t;
}

Vec randn(int64_t n, uint64_t seed, float stdev = 1.f) {
  Vec v(n);
  for (int64_t i = 0; i < n; i++) v[i] = stdev * rng_normal(seed, uint64_t(i));
  return v;
}

// Values whose magnitudes vary by row and column over several binades, so tiles differ.
Vec varied(int64_t R, int64_t C, uint64_t seed) {
  Vec v = randn(R * C, seed);
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) v[r * C + c] *= std::ldexp(1.f, int((r * 7 + c / 13) % 9) - 4);
  return v;
}

const uint8_t* codes(const fp8::Quantized& q) { return q.q.data<uint8_t>(); }

}  // namespace

// ===== the codes ==================================================================================

TEST_CASE("decode gives the OCP spec's value for all 256 codes of each format", "[fp8][codes]") {
  for (const Format& f : {kE4M3, kE5M2}) {
    for (int c = 0; c < 256; c++) {
      INFO("format " << dtype_name(f.dt) << " code " << c);
      const double want = ref_decode(f, c);
      const float got = dec(f, uint8_t(c));
      if (std::isnan(want)) {
        CHECK(std::isnan(got));
      } else {
        CHECK(double(got) == want);
        CHECK(std::signbit(got) == bool(c & 0x80));  // 0x80 is -0
      }
    }
  }
  CHECK(fp8::decode_e4m3(0x7e) == 448.f);
  CHECK(fp8::decode_e4m3(0x01) == std::ldexp(1.f, -9));
  CHECK(fp8::decode_e5m2(0x7b) == 57344.f);
  CHECK(fp8::decode_e5m2(0x01) == std::ldexp(1.f, -16));
  CHECK(fp8::decode_e5m2(0x7c) == INFINITY);
  CHECK(fp8::decode_e5m2(0xfc) == -INFINITY);
  CHECK(fp8::max_finite(DType::F8E4M3) == 448.f);
  CHECK(fp8::max_finite(DType::F8E5M2) == 57344.f);
}

TEST_CASE("encode matches a brute-force nearest-even search with saturation", "[fp8][codes]") {
  for (const Format& f : {kE4M3, kE5M2}) {
    const std::vector<double> vals = finite_values(f);
    INFO("format " << dtype_name(f.dt));
    // Every midpoint between adjacent codes (exact in fp32: at most 5 significant bits), the
    // floats either side of it, and the midpoint past the largest value (e4m3: 464).
    std::vector<float> xs;
    for (size_t c = 0; c + 1 < vals.size(); c++) {
      const float mid = float((vals[c] + vals[c + 1]) / 2);
      REQUIRE(double(mid) == (vals[c] + vals[c + 1]) / 2);
      xs.insert(xs.end(), {mid, std::nextafter(mid, INFINITY), std::nextafter(mid, 0.f), float(vals[c])});
    }
    const double step = vals.back() - vals[vals.size() - 2];  // the next step would be as wide
    const float past = float(vals.back() + step / 2);
    xs.insert(xs.end(), {float(vals.back()), past, std::nextafter(past, 0.f), std::nextafter(past, INFINITY),
                         float(vals.back() + step), 1e30f, FLT_MAX, INFINITY, float(vals[1] / 2),
                         std::nextafter(float(vals[1] / 2), INFINITY), std::nextafter(float(vals[1] / 2), 0.f),
                         FLT_TRUE_MIN, 1e-40f, FLT_MIN, 0.f, std::nanf(""), from_bits(0x7f800001u),
                         from_bits(0x7fffffffu)});
    const size_t edges = xs.size();
    for (size_t i = 0; i < edges; i++) xs.push_back(-xs[i]);
    // A million random floats: fp32 exponents around the format's range (and any bit pattern).
    std::mt19937 gen(12345);
    for (int i = 0; i < 1000000; i++) {
      uint32_t u = gen();
      if (i % 8) u = (u & 0x807fffffu) | (uint32_t(127 - f.bias - f.M - 4 + int(gen() % (2 * f.bias + 10))) << 23);
      xs.push_back(from_bits(u));
    }
    size_t bad = 0;
    for (float x : xs) {
      const uint8_t want = ref_encode(f, vals, x), got = enc(f, x);
      if (got != want && bad++ < 10) FAIL_CHECK("x = " << x << ": want " << int(want) << ", got " << int(got));
    }
    CHECK(bad == 0);
  }
  CHECK(fp8::encode_e4m3(464.f) == 0x7e);  // halfway to the would-be 480: saturates to 448
  CHECK(fp8::encode_e4m3(-1e9f) == 0xfe);
  CHECK(fp8::encode_e4m3(-0.f) == 0x80);
  CHECK(fp8::encode_e4m3(std::ldexp(1.f, -10)) == 0x00);  // half the smallest subnormal: tie to 0
  CHECK(fp8::encode_e4m3(std::ldexp(3.f, -10)) == 0x02);  // 1.5 subnormal steps: tie to the even 2
  CHECK(fp8::encode_e5m2(INFINITY) == 0x7b);
  CHECK(fp8::encode_e5m2(-INFINITY) == 0xfb);
  CHECK(fp8::encode_e4m3(-std::nanf("")) == 0xff);
  CHECK(fp8::encode_e5m2(std::nanf("")) == 0x7e);
}

TEST_CASE("scale_for: max / amax / 2^margin, its edge cases", "[fp8][scale]") {
  CHECK(fp8::scale_for(0.f, DType::F8E4M3) == 1.f);
  CHECK(std::isnan(fp8::scale_for(std::nanf(""), DType::F8E4M3)));
  CHECK(std::isnan(fp8::scale_for(INFINITY, DType::F8E5M2)));
  CHECK(fp8::scale_for(1e-38f, DType::F8E4M3) == FLT_MAX);  // 448 / 1e-38 overflows fp32
  CHECK(fp8::scale_for(FLT_TRUE_MIN, DType::F8E5M2) == FLT_MAX);
  CHECK(fp8::scale_for(448.f, DType::F8E4M3) == 1.f);
  CHECK(fp8::scale_for(1.f, DType::F8E4M3) == 448.f);
  CHECK(fp8::scale_for(1.f, DType::F8E5M2) == 57344.f);
  CHECK(fp8::scale_for(2.f, DType::F8E4M3, 1) == 112.f);
  CHECK(fp8::scale_for(448.f, DType::F8E4M3, -1) == 2.f);
  CHECK(fp8::scale_for(3.f, DType::F8E4M3) == 448.f / 3.f);
  // The scale maps amax onto the largest code, never past it.
  std::mt19937 gen(7);
  for (int i = 0; i < 10000; i++) {
    const float amax = std::ldexp(1.f + float(gen() % 1000000) / 1e6f, int(gen() % 60) - 30);
    for (const Format& f : {kE4M3, kE5M2}) {
      const uint8_t c = enc(f, amax * fp8::scale_for(amax, f.dt));
      INFO("amax " << amax);
      CHECK(c == f.max_code);
    }
  }
}

// ===== amax and quantization =====================================================================

namespace {

// max |x| over each tr x tc tile of x [R, C], NaN if any element of the tile is NaN.
Vec ref_block_amax(const Vec& x, int64_t R, int64_t C, int64_t tr, int64_t tc) {
  const int64_t gr = (R + tr - 1) / tr, gc = (C + tc - 1) / tc;
  Vec a(gr * gc, 0.f);
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) {
      float& m = a[(r / tr) * gc + c / tc];
      const float v = std::fabs(x[r * C + c]);
      if (std::isnan(v) || std::isnan(m)) m = NAN;
      else m = std::max(m, v);
    }
  return a;
}

struct Tiles {
  int tr, tc;
};
const Tiles kTiles[] = {{fp8::kWhole, fp8::kWhole}, {1, 128}, {128, 128}, {5, 7}, {37, 300}, {64, 512}, {128, 1}};

bool same(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

}  // namespace

TEST_CASE("block_amax over ragged tiles, fp32 and bf16, NaN kept", "[fp8][amax]") {
  const int64_t R = 37, C = 300;
  Vec x = varied(R, C, 11);
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor t = make({R, C}, x, dt);
    const Vec xs = to_host_f32(t);  // the values as stored (bf16-rounded)
    for (const Tiles& tl : kTiles) {
      INFO(dtype_name(dt) << " tiles " << tl.tr << " x " << tl.tc);
      const Vec want = ref_block_amax(xs, R, C, std::min<int64_t>(tl.tr, R), std::min<int64_t>(tl.tc, C));
      Tensor a = Tensor::empty({(R + tl.tr - 1) / tl.tr, (C + tl.tc - 1) / tl.tc}, DType::F32, Device::CPU,
                               Tag::Workspace);
      fp8::block_amax(a, t, tl.tr, tl.tc);
      CHECK(to_host_f32(a) == want);
    }
    CHECK(fp8::amax(t) == ref_block_amax(xs, R, C, R, C)[0]);
  }
  // A NaN poisons its tile only; a rank-3 tensor is seen as [numel / last, last].
  x[5 * C + 200] = NAN;
  const Tensor t3 = make({1, R, C}, x);
  Tensor a = Tensor::empty({(R + 4) / 5, (C + 6) / 7}, DType::F32, Device::CPU, Tag::Workspace);
  fp8::block_amax(a, t3, 5, 7);
  const Vec got = to_host_f32(a), want = ref_block_amax(x, R, C, 5, 7);
  int nans = 0;
  for (size_t i = 0; i < got.size(); i++) {
    CHECK(same(got[i], want[i]));
    nans += std::isnan(got[i]);
  }
  CHECK(nans == 1);
  CHECK(std::isnan(fp8::amax(t3)));
}

// The spacing of the format's values around |y|: 2^(e - M) in the binade 2^e, the subnormals that
// of the smallest normal binade. Round to nearest is within half of it (no saturation here: the
// scale maps each tile's amax onto the largest value).
double half_spacing(const Format& f, double y) {
  const int e = y == 0 ? 1 - f.bias : std::max(int(std::floor(std::log2(std::fabs(y)))), 1 - f.bias);
  return std::ldexp(0.5, e - f.M);
}

TEST_CASE("quantize_current round-trips within half a step of the format", "[fp8][quantize]") {
  const int64_t R = 37, C = 300;
  const Vec x = varied(R, C, 21);
  for (const Format& f : {kE4M3, kE5M2})
    for (const Tiles& tl : kTiles)
      for (int margin : {0, 2}) {
        INFO(dtype_name(f.dt) << " tiles " << tl.tr << " x " << tl.tc << " margin " << margin);
        const Tensor t = make({R, C}, x);
        const fp8::Quantized q = fp8::quantize_current(t, f.dt, tl.tr, tl.tc, margin);
        REQUIRE(q.q.dtype == f.dt);
        REQUIRE(q.q.shape == t.shape);
        const int64_t tr = std::min<int64_t>(tl.tr, R), tc = std::min<int64_t>(tl.tc, C), gc = (C + tc - 1) / tc;
        const Vec amax = ref_block_amax(x, R, C, tr, tc), s = to_host_f32(q.scales);
        REQUIRE(s.size() == amax.size());
        for (size_t i = 0; i < s.size(); i++) CHECK(s[i] == fp8::scale_for(amax[i], f.dt, margin));
        int64_t bad = 0;
        for (int64_t r = 0; r < R; r++)
          for (int64_t c = 0; c < C; c++) {
            const float sc = s[(r / tr) * gc + c / tc], y = x[r * C + c] * sc;  // the scaled value, fp32
            const uint8_t code = codes(q)[r * C + c];
            bad += code != enc(f, y);
            bad += std::fabs(double(dec(f, code)) - double(y)) > half_spacing(f, y);
            // dequantized: the same bound divided by the scale
            bad += std::fabs(double(dec(f, code)) / sc - double(x[r * C + c])) > half_spacing(f, y) / sc * (1 + 1e-6);
          }
        CHECK(bad == 0);
      }
  // bf16 input: the product of the bf16 value and the scale, encoded.
  const Tensor tb = make({R, C}, x, DType::BF16);
  const Vec xb = to_host_f32(tb);
  const fp8::Quantized qb = fp8::quantize_current(tb, DType::F8E4M3, 1, 128);
  const Vec sb = to_host_f32(qb.scales);
  int64_t bad = 0;
  for (int64_t i = 0; i < R * C; i++) bad += codes(qb)[i] != fp8::encode_e4m3(xb[i] * sb[(i / C) * 3 + (i % C) / 128]);
  CHECK(bad == 0);
}

// ===== the scaled GEMM ============================================================================

namespace {

const double kU = std::ldexp(1.0, -24);  // fp32's unit roundoff

// Each stored element's dequantized value decode(q) / scale, in double.
std::vector<double> dequantized(const fp8::Quantized& q) {
  const int64_t C = q.q.size(-1), R = q.q.numel() / C;
  const int64_t tr = std::min<int64_t>(q.tr, R), tc = std::min<int64_t>(q.tc, C), gc = (C + tc - 1) / tc;
  const Vec s = to_host_f32(q.scales);
  const Format& f = q.q.dtype == DType::F8E5M2 ? kE5M2 : kE4M3;
  std::vector<double> v(R * C);
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) v[r * C + c] = double(dec(f, codes(q)[r * C + c])) / double(s[(r / tr) * gc + c / tc]);
  return v;
}

// C = op(A) op(B) in double, and S = Σ_k |op(A)[m, k]| |op(B)[k, n]|, the scale of fp32's error.
struct Ref {
  std::vector<double> c, abs;
};
Ref ref_gemm(const fp8::Quantized& A, bool ta, const fp8::Quantized& B, bool tb, int64_t M, int64_t N, int64_t K) {
  const std::vector<double> a = dequantized(A), b = dequantized(B);
  Ref r{std::vector<double>(M * N), std::vector<double>(M * N)};
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t k = 0; k < K; k++) {
        const double p = (ta ? a[k * M + m] : a[m * K + k]) * (tb ? b[n * K + k] : b[k * N + n]);
        r.c[m * N + n] += p;
        r.abs[m * N + n] += std::fabs(p);
      }
  return r;
}

// The scale tiling of an operand: per tensor, or DeepSeek-V3's 1 x 128 along K (activations) or
// 128 x 128 (weights), oriented by where K lies in the stored matrix.
enum class Scaling { Tensor, Row128, Block128 };
fp8::Quantized quantize_operand(const Vec& x, int64_t R, int64_t C, DType fmt, Scaling s, bool k_is_cols) {
  const Tensor t = make({R, C}, x);
  if (s == Scaling::Tensor) return fp8::quantize_current(t, fmt, fp8::kWhole, fp8::kWhole);
  if (s == Scaling::Block128) return fp8::quantize_current(t, fmt, 128, 128);
  return k_is_cols ? fp8::quantize_current(t, fmt, 1, 128) : fp8::quantize_current(t, fmt, 128, 1);
}

Tensor f32(int64_t M, int64_t N, float v = 0.f) { return make({M, N}, Vec(M * N, v)); }

// The largest |C - ref| / (u · S) over the elements: fp32 accumulation of K products is within
// about (K + chunks + 4) u S (each chunk's fp32 sum, the fp32 dequantization factor, one fma per chunk).
double err_units(const Vec& c, const Ref& r) {
  double worst = 0;
  for (size_t i = 0; i < c.size(); i++) worst = std::max(worst, std::fabs(double(c[i]) - r.c[i]) / (kU * r.abs[i] + 1e-300));
  return worst;
}

}  // namespace

TEST_CASE("gemm matches the double-precision product of the dequantized operands", "[fp8][gemm]") {
  const int64_t M = 70, N = 50, K = 300;  // K = 2 x 128 + 44: a ragged last chunk
  const Vec xa = varied(M, K, 31), xb = varied(K, N, 32);
  const std::pair<Scaling, Scaling> recipes[] = {{Scaling::Tensor, Scaling::Tensor},
                                                 {Scaling::Row128, Scaling::Block128},
                                                 {Scaling::Tensor, Scaling::Block128},
                                                 {Scaling::Row128, Scaling::Tensor}};
  for (DType fa : {DType::F8E4M3, DType::F8E5M2})
    for (const auto& rec : recipes)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          INFO("A " << dtype_name(fa) << " scaling " << int(rec.first) << " B scaling " << int(rec.second)
                    << " transA " << ta << " transB " << tb);
          // The same logical operands stored either way.
          Vec sa(M * K), sb(K * N);
          for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) sa[ta ? k * M + m : m * K + k] = xa[m * K + k];
          for (int64_t k = 0; k < K; k++)
            for (int64_t n = 0; n < N; n++) sb[tb ? n * K + k : k * N + n] = xb[k * N + n];
          const fp8::Quantized A = quantize_operand(sa, ta ? K : M, ta ? M : K, fa, rec.first, !ta);
          const fp8::Quantized B = quantize_operand(sb, tb ? N : K, tb ? K : N, DType::F8E4M3, rec.second, tb);
          const Ref r = ref_gemm(A, ta, B, tb, M, N, K);
          Tensor C = f32(M, N, NAN);  // beta 0 ignores the old contents, NaN included
          fp8::gemm(C, A, ta, B, tb);
          const Vec c = to_host_f32(C);
          CHECK(err_units(c, r) <= double(K + 8));
          // A bf16 C is the fp32 result rounded once.
          Tensor Cb = Tensor::empty({M, N}, DType::BF16, Device::CPU, Tag::Activations);
          fp8::gemm(Cb, A, ta, B, tb);
          const std::vector<bf16> cb(Cb.b16(), Cb.b16() + M * N);
          int64_t bad = 0;
          for (int64_t i = 0; i < M * N; i++) bad += cb[i].bits != float_to_bf16(c[i]).bits;
          CHECK(bad == 0);
        }
}

namespace {

// A quantized operand from its codes and scales, as a caller that has them would build it.
fp8::Quantized quantized(int64_t R, int64_t C, const std::vector<uint8_t>& q, int tr, int tc, const Vec& scales) {
  fp8::Quantized out;
  out.q = Tensor::empty({R, C}, DType::F8E4M3, Device::CPU, Tag::Workspace);
  std::copy(q.begin(), q.end(), out.q.data<uint8_t>());
  out.scales = make({(R + tr - 1) / tr, (C + tc - 1) / tc}, scales);
  out.tr = tr;
  out.tc = tc;
  return out;
}

// Small integers (exact codes) under power-of-two scales 2^-2 .. 2^2: every product and partial
// sum is exact in fp32, so the GEMM must equal the exact sum.
fp8::Quantized small_ints(int64_t R, int64_t C, int tr, int tc, uint64_t seed) {
  std::vector<uint8_t> q(R * C);
  for (int64_t i = 0; i < R * C; i++) q[i] = fp8::encode_e4m3(float(int(rng_uniform(seed, i) * 9) - 4));
  Vec s(((R + tr - 1) / tr) * ((C + tc - 1) / tc));
  for (size_t i = 0; i < s.size(); i++) s[i] = std::ldexp(1.f, int(i % 5) - 2);
  return quantized(R, C, q, tr, tc, s);
}

}  // namespace

TEST_CASE("gemm is exact on small integers with power-of-two scales", "[fp8][gemm]") {
  const int64_t M = 33, N = 17, K = 300;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("transA " << ta << " transB " << tb);
      const fp8::Quantized A = ta ? small_ints(K, M, 128, 1, 41) : small_ints(M, K, 1, 128, 41);
      const fp8::Quantized B = small_ints(tb ? N : K, tb ? K : N, 128, 128, 42);
      const Ref r = ref_gemm(A, ta, B, tb, M, N, K);
      Tensor C = f32(M, N);
      fp8::gemm(C, A, ta, B, tb);
      const Vec c = to_host_f32(C);
      int64_t bad = 0;
      for (int64_t i = 0; i < M * N; i++) bad += double(c[i]) != r.c[i];
      CHECK(bad == 0);
      // The emulated accumulator at 23 bits is exact here too.
      Tensor E = f32(M, N);
      fp8::gemm(E, A, ta, B, tb, 0.f, fp8::Accum{23, 64});
      CHECK(to_host_f32(E) == c);
    }
}

TEST_CASE("gemm with beta adds beta * C, for fp32 and bf16 C", "[fp8][gemm]") {
  const int64_t M = 40, N = 24, K = 256;
  const fp8::Quantized A = quantize_operand(varied(M, K, 51), M, K, DType::F8E4M3, Scaling::Row128, true);
  const fp8::Quantized B = quantize_operand(varied(K, N, 52), K, N, DType::F8E4M3, Scaling::Block128, false);
  const Ref r = ref_gemm(A, false, B, false, M, N, K);
  const Vec c0 = randn(M * N, 53, 10.f);
  for (float beta : {1.f, 0.5f, -2.f}) {
    INFO("beta " << beta);
    Tensor C = make({M, N}, c0);
    fp8::gemm(C, A, false, B, false, beta);
    const Vec c = to_host_f32(C);
    int64_t bad = 0;
    for (int64_t i = 0; i < M * N; i++) {
      const double want = r.c[i] + double(beta * c0[i]);
      bad += std::fabs(c[i] - want) > (K + 8) * kU * (r.abs[i] + std::fabs(beta * c0[i]));
    }
    CHECK(bad == 0);
    // bf16 C: its old value widened, the fp32 result rounded once at the end.
    Tensor Cb = make({M, N}, c0, DType::BF16), Cf = make({M, N}, to_host_f32(Cb));
    fp8::gemm(Cb, A, false, B, false, beta);
    fp8::gemm(Cf, A, false, B, false, beta);
    const Vec cf = to_host_f32(Cf);
    bad = 0;
    for (int64_t i = 0; i < M * N; i++) bad += Cb.b16()[i].bits != float_to_bf16(cf[i]).bits;
    CHECK(bad == 0);
  }
}

// ===== the accumulator emulation ==================================================================

namespace {

// op(X)[i, k]'s code and the scale of its tile.
struct OpRef {
  const fp8::Quantized& q;
  bool trans;
  int64_t R, C, tr, tc, gc;
  Vec s;
  OpRef(const fp8::Quantized& x, bool t) : q(x), trans(t) {
    C = x.q.size(-1), R = x.q.numel() / C;
    tr = std::min<int64_t>(x.tr, R), tc = std::min<int64_t>(x.tc, C), gc = (C + tc - 1) / tc;
    s = to_host_f32(x.scales);
  }
  float value(int64_t i, int64_t k) const {  // the decoded code, unscaled
    const int64_t r = trans ? k : i, c = trans ? i : k;
    return dec(q.q.dtype == DType::F8E5M2 ? kE5M2 : kE4M3, codes(q)[r * C + c]);
  }
  float scale(int64_t i, int64_t k) const {
    const int64_t r = trans ? k : i, c = trans ? i : k;
    return s[(r / tr) * gc + c / tc];
  }
};

// fp8.h's "plain fp32 accumulation in k order", written out: per chunk of kc an fp32 running sum
// of the products of codes, then out = fma(sum, (1/sA)(1/sB), out).
Vec k_order_fp32(const OpRef& a, const OpRef& b, int64_t M, int64_t N, int64_t K, int64_t kc) {
  Vec out(M * N, 0.f);
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        float s = 0.f;
        for (int64_t k = k0; k < std::min(K, k0 + kc); k++) s += a.value(m, k) * b.value(k, n);
        out[m * N + n] = std::fma(s, (1.f / a.scale(m, k0)) * (1.f / b.scale(k0, n)), out[m * N + n]);
      }
  return out;
}

// The largest relative error of C = A B (positive operands, per-tensor e4m3) at depth K.
double positive_gemm_error(int64_t K, const fp8::Accum& acc) {
  const int64_t M = 8, N = 8;
  Vec xa = randn(M * K, 61), xb = randn(K * N, 62);
  for (float& v : xa) v = std::fabs(v) + 0.05f;
  for (float& v : xb) v = std::fabs(v) + 0.05f;
  const fp8::Quantized A = quantize_operand(xa, M, K, DType::F8E4M3, Scaling::Tensor, true);
  const fp8::Quantized B = quantize_operand(xb, K, N, DType::F8E4M3, Scaling::Tensor, false);
  const Ref r = ref_gemm(A, false, B, false, M, N, K);
  Tensor C = f32(M, N);
  fp8::gemm(C, A, false, B, false, 0.f, acc);
  const Vec c = to_host_f32(C);
  double worst = 0;
  for (int64_t i = 0; i < M * N; i++) worst = std::max(worst, std::fabs(c[i] - r.c[i]) / r.c[i]);
  return worst;
}

}  // namespace

TEST_CASE("Accum at 23 bits is plain fp32 accumulation", "[fp8][gemm][accum]") {
  const int64_t M = 21, N = 19, K = 300;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("transA " << ta << " transB " << tb);
      Vec sa = varied(ta ? K : M, ta ? M : K, 71), sb = varied(tb ? N : K, tb ? K : N, 72);
      const fp8::Quantized A = quantize_operand(sa, ta ? K : M, ta ? M : K, DType::F8E5M2, Scaling::Row128, !ta);
      const fp8::Quantized B = quantize_operand(sb, tb ? N : K, tb ? K : N, DType::F8E4M3, Scaling::Block128, tb);
      Tensor D = f32(M, N), D23 = f32(M, N), E = f32(M, N);
      fp8::gemm(D, A, ta, B, tb);
      fp8::gemm(D23, A, ta, B, tb, 0.f, fp8::Accum{23, 0});
      CHECK(to_host_f32(D23) == to_host_f32(D));  // the default, bit for bit
      // The scalar emulation with promotion only at the chunks' ends is the k-order fp32 loop.
      fp8::gemm(E, A, ta, B, tb, 0.f, fp8::Accum{23, 1 << 30});
      const Vec e = to_host_f32(E);
      CHECK(e == k_order_fp32(OpRef(A, ta), OpRef(B, tb), M, N, K, 128));
      const Ref r = ref_gemm(A, ta, B, tb, M, N, K);
      CHECK(err_units(e, r) <= double(K + 8));
      CHECK(err_units(to_host_f32(D), r) <= double(K + 8));
    }
}

TEST_CASE("14-bit accumulation loses accuracy with K; promotion every 128 recovers it", "[fp8][gemm][accum]") {
  // DeepSeek-V3 §3.3.2: Hopper's FP8 GEMM keeps about 14 bits; promoting every N_C = 128 products
  // to fp32 bounds the error by that of a 128-term sum.
  const double e256 = positive_gemm_error(256, {14, 0}), e4096 = positive_gemm_error(4096, {14, 0});
  const double p4096 = positive_gemm_error(4096, {14, 128}), f4096 = positive_gemm_error(4096, {});
  WARN("max relative error: 14 bits K=256 " << e256 << ", K=4096 " << e4096 << "; promoted every 128 " << p4096
                                             << "; fp32 " << f4096);
  CHECK(e4096 > 4 * e256);
  CHECK(e4096 > 1e-3);
  CHECK(p4096 < e4096 / 8);
  CHECK(f4096 < p4096);
  CHECK(f4096 < 1e-5);
}

// ===== error paths ================================================================================

namespace {

// Runs f with a fatal hook that throws instead of letting fatal() end the job (the hook runs
// after the message is printed and before MPI_Abort); returns whether f died and its message.
// An exception rather than a forked child: a fork of a process with OpenMP and OpenBLAS threads
// can deadlock in the child.
struct Died {
  std::string message;
};

std::pair<bool, std::string> dies(const std::function<void()>& f) {
  set_fatal_hook([](const char* m) { throw Died{m}; });
  try {
    f();
  } catch (const Died& d) {
    return {true, d.message};
  }
  set_fatal_hook(nullptr);
  return {false, ""};
}

}  // namespace

TEST_CASE("gemm refuses scale tiles along K that differ, and malformed operands", "[fp8][validation]") {
  const int64_t M = 16, N = 8, K = 300;
  const fp8::Quantized A = quantize_operand(varied(M, K, 81), M, K, DType::F8E4M3, Scaling::Row128, true);
  const fp8::Quantized B64 = fp8::quantize_current(make({K, N}, varied(K, N, 82)), DType::F8E4M3, 64, 64);
  const fp8::Quantized Bw = quantize_operand(varied(K, N, 82), K, N, DType::F8E4M3, Scaling::Tensor, false);
  Tensor C = f32(M, N);
  auto r = dies([&] { fp8::gemm(C, A, false, B64, false); });
  CHECK(r.first);
  CHECK_THAT(r.second, Catch::Matchers::Contains("scale tiles of A and B along K"));
  fp8::Quantized bad = Bw;
  bad.scales = f32(2, 1, 1.f);  // one tile claimed, two scales given
  r = dies([&] { fp8::gemm(C, A, false, bad, false); });
  CHECK(r.first);
  CHECK_THAT(r.second, Catch::Matchers::Contains("B.scales must have shape [1,1]"));
  r = dies([&] { fp8::gemm(C, A, true, Bw, false); });  // op(A) is [300, 16]: K = 16 against 300
  CHECK(r.first);
  CHECK_THAT(r.second, Catch::Matchers::Contains("shapes do not compose"));
  r = dies([&] { fp8::gemm(C, A, false, Bw, false, 0.f, fp8::Accum{24, 0}); });
  CHECK(r.first);
  CHECK_THAT(r.second, Catch::Matchers::Contains("mantissa_bits"));
  r = dies([&] { fp8::quantize_current(make({4, 4}, Vec(16, 1.f)), DType::F32, 1, 1); });
  CHECK(r.first);
  // The accepting side: tiles of A covering K go with any tile of B, and an empty K gives beta C.
  Tensor Z = f32(M, N, 2.f);
  const fp8::Quantized A0 = fp8::quantize_current(make({M, 0}, {}), DType::F8E4M3, 1, 128);
  const fp8::Quantized B0 = fp8::quantize_current(make({0, N}, {}), DType::F8E4M3, 128, 128);
  fp8::gemm(Z, A0, false, B0, false, 0.5f);
  CHECK(to_host_f32(Z) == Vec(M * N, 1.f));
}

// ===== the native path's pieces ====================================================================

TEST_CASE("transpose_codes turns the codes of [R, C] into [C, R], and refuses what is not that", "[fp8][native]") {
  for (auto [R, C] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {16, 48}, {130, 7}}) {
    const fp8::Quantized X = fp8::quantize_current(make({R, C}, varied(R, C, 91)), DType::F8E5M2, 1, 1);
    Tensor T = Tensor::empty({C, R}, DType::F8E5M2, Device::CPU, Tag::Workspace);
    fp8::transpose_codes(T, X.q);
    const uint8_t* x = X.q.data<uint8_t>();
    const uint8_t* t = T.data<uint8_t>();
    int64_t wrong = 0;
    for (int64_t r = 0; r < R; r++)
      for (int64_t c = 0; c < C; c++) wrong += t[c * R + r] != x[r * C + c];
    CHECK(wrong == 0);
  }
  const fp8::Quantized X = fp8::quantize_current(make({4, 6}, varied(4, 6, 92)), DType::F8E4M3, 1, 1);
  Tensor same = Tensor::empty({4, 6}, DType::F8E4M3, Device::CPU, Tag::Workspace);
  auto r = dies([&] { fp8::transpose_codes(same, X.q); });
  CHECK(r.first);
  CHECK_THAT(r.second, Catch::Matchers::Contains("dst must be src's fp8 codes transposed"));
  Tensor other = Tensor::empty({6, 4}, DType::F8E5M2, Device::CPU, Tag::Workspace);
  CHECK(dies([&] { fp8::transpose_codes(other, X.q); }).first);
  // On the CPU the native path never applies: the decode path is the reference.
  Tensor C = f32(4, 4);
  CHECK(!fp8::native_gemm(C, X, false, X, true, 4, 4, 6));
}

#ifdef TS_CUDA
// The CUDA result against the CPU's decode path, for every layout the linears use: on an sm_89+
// device the per-tensor case runs on cuBLASLt's FP8 tensor cores (native_gemm, checked to be taken),
// whose accumulation keeps fewer bits than fp32 between its promotions: a K-term sum rounded at
// p bits is within about √K · 2^-p relative normwise, and p = 13 leaves a bit of room below the
// ~14 bits Hopper keeps. The blockwise case takes the decode path there too (fp32, reordered sums).
TEST_CASE("cuda twin: fp8::gemm, native per-tensor and decoded blockwise, against the CPU", "[cuda][fp8]") {
  if (!cuda_available()) {
    WARN("no GPU visible: CUDA twin not run");
    return;
  }
  int dev = 0, major = 0, minor = 0;
  REQUIRE(cudaGetDevice(&dev) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess);
  const bool fp8_cores = 10 * major + minor >= 89;
  auto on = [](const Tensor& t, Device d) {
    Tensor r = Tensor::empty(t.shape, t.dtype, d, Tag::Workspace);
    copy(r, t);
    return r;
  };
  auto to_gpu = [&](const fp8::Quantized& q) { return fp8::Quantized{on(q.q, Device::CUDA), on(q.scales, Device::CUDA), q.tr, q.tc}; };
  const int64_t M = 64, N = 96, K = 256;
  for (Scaling s : {Scaling::Tensor, Scaling::Row128})
    for (auto [ta, tb] : {std::pair{false, true}, {false, false}, {true, false}}) {
      INFO("scaling " << int(s) << " transA " << ta << " transB " << tb);
      const Scaling sb = s == Scaling::Tensor ? s : Scaling::Block128;
      const fp8::Quantized A = quantize_operand(varied(ta ? K : M, ta ? M : K, 93), ta ? K : M, ta ? M : K,
                                                DType::F8E5M2, s, !ta);
      const fp8::Quantized B = quantize_operand(varied(tb ? N : K, tb ? K : N, 94), tb ? N : K, tb ? K : N,
                                                DType::F8E4M3, sb, tb);
      Tensor c_cpu = f32(M, N, 0.5f);
      fp8::gemm(c_cpu, A, ta, B, tb, 1.f);
      const fp8::Quantized Ag = to_gpu(A), Bg = to_gpu(B);
      Tensor c_gpu = on(f32(M, N, 0.5f), Device::CUDA);
      fp8::gemm(c_gpu, Ag, ta, Bg, tb, 1.f);
      device_sync(Device::CUDA);
      const Vec c = to_host_f32(c_cpu), g = to_host_f32(c_gpu);
      double num = 0, den = 0;
      for (size_t i = 0; i < c.size(); i++) num += (g[i] - c[i]) * (g[i] - c[i]), den += c[i] * c[i];
      CHECK(std::sqrt(num / den) <= std::sqrt(double(K)) * std::ldexp(1.0, -13));
      if (s == Scaling::Tensor && fp8_cores) {
        Tensor probe = on(f32(M, N), Device::CUDA);
        CHECK(fp8::native_gemm(probe, Ag, ta, Bg, tb, M, N, K));
      }
    }
}

#ifdef TS_CUDA_EMU
// The native path keeps the scales on the device: a one-thread kernel forms the dequantization
// factor 1/sA · 1/sB (in double, rounded once) into cuBLASLt's A scale pointer, so a GEMM makes no
// device-to-host copy, which would make the host wait for the device. The emulator counts those
// copies. Its cuBLASLt computes D = (alpha · scaleA · scaleB) · Σ_k fma-accumulated products + C,
// k ascending (blas.cu), so the expected bits are written out here with the factor as the host
// formed it when it read the two scales itself: the result is the one that path gave.
TEST_CASE("the native FP8 GEMM reads no scale to the host, and gives the same bits as before", "[cuda][fp8]") {
  const int64_t M = 32, N = 48, K = 64;
  auto on_gpu = [](const Tensor& t) {
    Tensor r = Tensor::empty(t.shape, t.dtype, Device::CUDA, Tag::Workspace);
    copy(r, t);
    return r;
  };
  int telling = 0;  // cases whose factor from two fp32 reciprocals would have other bits
  for (auto [ta, tb] : {std::pair{false, true}, {false, false}, {true, false}}) {
    INFO("transA " << ta << " transB " << tb);
    const fp8::Quantized A = quantize_operand(varied(ta ? K : M, ta ? M : K, 97), ta ? K : M, ta ? M : K,
                                              DType::F8E4M3, Scaling::Tensor, !ta);
    const fp8::Quantized B = quantize_operand(varied(tb ? N : K, tb ? K : N, 98), tb ? N : K, tb ? K : N,
                                              DType::F8E5M2, Scaling::Tensor, tb);
    const fp8::Quantized Ag{on_gpu(A.q), on_gpu(A.scales), A.tr, A.tc}, Bg{on_gpu(B.q), on_gpu(B.scales), B.tr, B.tc};
    const Vec c0 = randn(M * N, 97);
    Tensor c = on_gpu(make({M, N}, c0));
    device_sync(Device::CUDA);
    const uint64_t before = emu::device_to_host_copies();
    for (int rep = 0; rep < 3; rep++) REQUIRE(fp8::native_gemm(c, Ag, ta, Bg, tb, M, N, K));
    device_sync(Device::CUDA);
    CHECK(emu::device_to_host_copies() == before);  // three GEMMs, no copy to the host
    const Vec got = to_host_f32(c);
    CHECK(emu::device_to_host_copies() == before + 1);  // the counter sees a copy: this one
    // Three accumulations into C, each rounded as the emulated cuBLASLt rounds it.
    const float sa = A.scales.f32()[0], sb = B.scales.f32()[0];
    const float factor = float((1.0 / double(sa)) * (1.0 / double(sb)));
    telling += factor != (1.f / sa) * (1.f / sb);
    const uint8_t *qa = codes(A), *qb = codes(B);
    int64_t differ = 0;
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k++)
          acc = std::fma(fp8::decode_e4m3(qa[ta ? k * M + m : m * K + k]),
                         fp8::decode_e5m2(qb[tb ? n * K + k : k * N + n]), acc);
        float want = c0[size_t(m * N + n)];
        for (int rep = 0; rep < 3; rep++) want = std::fma(1.f, want, factor * acc);
        differ += float_bits(want) != float_bits(got[size_t(m * N + n)]);
      }
    CHECK(differ == 0);
  }
  CHECK(telling > 0);  // so the comparison tells how the factor was formed, not only its value
}
#endif

#endif
