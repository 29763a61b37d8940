// gemm_row_split.cu — does an sgemm sum each element of C the same way however many rows it is
// handed? Async TP (04a_async_tp.cu) computes a GEMM's output a token block at a time; it is bit
// for bit 04's only where the answer is yes. C = A·Bᵀ (a linear's forward, y = x Wᵀ) whole, then
// in row blocks; prints how many elements differ. notes/04_tensor_parallel.md quotes it:
// OpenBLAS's SkylakeX kernels differ nowhere, its Haswell (and Zen) kernels in some elements.
//   OPENBLAS_CORETYPE=Haswell ./build/bench/gemm_row_split
#include <cblas.h>

#include <cstdio>
#include <vector>

int main() {
  openblas_set_num_threads(1);  // one call, one thread: as the project calls sgemm (kernels_cpu.cu)
  const int shapes[][4] = {{128, 64, 64, 64}, {128, 64, 64, 32}, {128, 160, 64, 64}, {512, 512, 512, 128}};
  for (const auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2], rows = s[3];
    std::vector<float> A(size_t(M) * K), B(size_t(N) * K), whole(size_t(M) * N), split(size_t(M) * N);
    uint64_t state = 1;
    for (float& v : A) v = float((state = state * 6364136223846793005ull + 1442695040888963407ull) >> 40) / 16777216.f - .5f;
    for (float& v : B) v = float((state = state * 6364136223846793005ull + 1442695040888963407ull) >> 40) / 16777216.f - .5f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, A.data(), K, B.data(), K, 0, whole.data(), N);
    for (int r = 0; r < M; r += rows)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, N, K, 1, A.data() + size_t(r) * K, K, B.data(), K, 0,
                  split.data() + size_t(r) * N, N);
    int differ = 0;
    for (size_t i = 0; i < whole.size(); i++) differ += whole[i] != split[i];
    printf("%s: C = A·Bᵀ, M %d N %d K %d, in blocks of %d rows: %d of %d elements differ\n", openblas_get_corename(),
           M, N, K, rows, differ, M * N);
  }
  return 0;
}
