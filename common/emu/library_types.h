// library_types.h — the emulated GPU's stand-in for NVIDIA's header of the same name: the element
// types that cuBLAS, cuBLASLt and the other CUDA libraries name in their calls (cudaDataType),
// with the numeric values of NVIDIA's header, so a value printed or stored by the emulated build
// means what it means in the real one.
#pragma once

enum cudaDataType_t {
  CUDA_R_32F = 0,  // float
  CUDA_R_64F = 1,  // double
  CUDA_R_16F = 2,  // half
  CUDA_R_8I = 3,   // signed 8-bit integer
  CUDA_C_32F = 4,
  CUDA_C_64F = 5,
  CUDA_C_16F = 6,
  CUDA_C_8I = 7,
  CUDA_R_8U = 8,
  CUDA_C_8U = 9,
  CUDA_R_32I = 10,
  CUDA_C_32I = 11,
  CUDA_R_32U = 12,
  CUDA_C_32U = 13,
  CUDA_R_16BF = 14,  // bfloat16: the top half of a float
  CUDA_C_16BF = 15,
  CUDA_R_4I = 16,
  CUDA_C_4I = 17,
  CUDA_R_4U = 18,
  CUDA_C_4U = 19,
  CUDA_R_16I = 20,
  CUDA_C_16I = 21,
  CUDA_R_16U = 22,
  CUDA_C_16U = 23,
  CUDA_R_64I = 24,
  CUDA_C_64I = 25,
  CUDA_R_64U = 26,
  CUDA_C_64U = 27,
  CUDA_R_8F_E4M3 = 28,  // the OCP 8-bit float with 4 exponent bits (no infinities)
  CUDA_R_8F_E5M2 = 29,  // the OCP 8-bit float with 5 exponent bits
};
typedef enum cudaDataType_t cudaDataType;
