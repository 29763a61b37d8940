// Says whether this build can use a GPU here, the way the binaries decide it (cudaGetDeviceCount
// through cuda_available): exit 0 and "N GPU(s) visible" when it can, exit 1 otherwise. The test
// driver and the GPU check ask it, so "GPU present" has one meaning everywhere.
#include <cstdio>

#include "tensor/core.h"
#include "tensor/device.h"

int main() {
  if (!ts::cuda_available()) {
#ifdef TS_CUDA
    printf("no GPU visible to this CUDA build\n");
#else
    printf("CPU-only build: no GPU can be used\n");
#endif
    return 1;
  }
  int n = 0;
#ifdef TS_CUDA
  cudaGetDeviceCount(&n);
#endif
  printf("%d GPU(s) visible\n", n);
  return 0;
}
