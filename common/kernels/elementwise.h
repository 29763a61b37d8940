// elementwise.h — the elementwise ops (kernels.h holds every op; a chapter that needs only these
// includes this).
#pragma once
#include "tensor/core.h"

namespace ts {

// ----- elementwise -----------------------------------------------------------------------------
void add(const Tensor& y, const Tensor& a, const Tensor& b);  // y = a + b (y may alias a or b)
void add_inplace(const Tensor& y, const Tensor& x);           // y += x
void scale_inplace(const Tensor& y, float s);                 // y *= s
void convert(const Tensor& dst, const Tensor& src);           // fp32 <-> bf16, round to nearest even

}  // namespace ts
