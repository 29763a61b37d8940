// emu_util.h — moving test data to and from the emulated GPU (tests/test_emu*.cpp): a device copy
// of a host vector, and a host copy of device memory. Neither synchronises a stream: a test that
// reads kernel results calls cudaDeviceSynchronize first (the NCCL tests must not, while a seeded
// defect holds a stream).
#pragma once
#include <catch2/catch.hpp>
#include "tensor/device.h"

#include <cuda_runtime.h>

#include <vector>

namespace tst {

template <class T> T* to_device(const std::vector<T>& h) {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, h.size() * sizeof(T)) == cudaSuccess);
  REQUIRE(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  // A pageable copy returns once its source is staged; work on non-blocking streams is not ordered
  // after it, so the copy is finished here (the legacy stream only: other streams keep running).
  REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
  return static_cast<T*>(p);
}
template <class T> std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

}  // namespace tst
