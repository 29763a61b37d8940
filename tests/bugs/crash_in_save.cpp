// crash_in_save, a fault tests/test_single.cpp injects into 01_single_gpu (01_single_gpu+crash_in_save):
// the process dies partway through writing the weights of its first checkpoint save, the way a
// node failure would, to prove that the previous checkpoint survives and resumes. The first
// tensor's values reach the unpublished model.safetensors, then the second write ends the process.
// The crash lives here, not in checkpoint.cu: tests inject their own faults
// (notes/00_architecture.md, "Seeded bugs").
#include <unistd.h>

#include <cstdio>
#include <string>

#include "formats/safetensors.h"

void real_write(ts::SafetensorsWriter* self, const std::string& name, int64_t elem_offset, const float* src, int64_t count)
    __asm__("__real__ZN2ts17SafetensorsWriter5writeERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEElPKfl");
void crash_write(ts::SafetensorsWriter* self, const std::string& name, int64_t elem_offset, const float* src, int64_t count)
    __asm__("__wrap__ZN2ts17SafetensorsWriter5writeERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEElPKfl");

void crash_write(ts::SafetensorsWriter* self, const std::string& name, int64_t elem_offset, const float* src, int64_t count) {
  static int writes = 0;
  if (++writes == 2) {
    fprintf(stderr, "crash_in_save: simulated crash during checkpoint save (tests/bugs/crash_in_save.cpp)\n");
    _exit(3);
  }
  real_write(self, name, elem_offset, src, count);
}
