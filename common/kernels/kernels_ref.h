// kernels_ref.h — the reference implementation of the ops of kernels.h: plain loops over CPU
// tensors, written to be read beside the formulas (kernels_ref.cu).
//
// Same names, same contracts as kernels.h; the arguments are checked by the caller (kernels.cu,
// or a test). Where an op has no faster CPU kernel (elementwise, embedding forward, SwiGLU, AdamW,
// init), its reference is the CPU op that kernels.cu dispatches to. Elsewhere the tuned kernel of
// kernels_cpu.cu is what runs and the reference is its test oracle: every sum of products here is
// taken in double and the exponentials with std::exp, so what a test measures against it is the
// fast kernel's own rounding.
#pragma once
#include "kernels/kernels.h"

namespace ts {
namespace ref {

// Each is declared with the type of its op in kernels.h: the same signature, checked by the compiler.
// The CPU ops that kernels.cu runs:
decltype(ts::add) add;  // add_inplace(y, x) is add(y, y, x)
decltype(ts::scale_inplace) scale_inplace;
decltype(ts::convert) convert;
decltype(ts::fill) fill;
decltype(ts::embedding_forward) embedding_forward;
decltype(ts::swiglu_forward) swiglu_forward;
decltype(ts::swiglu_backward) swiglu_backward;
decltype(ts::adamw_step) adamw_step;
decltype(ts::init_normal) init_normal;
// The oracles of the tuned kernels of kernels_cpu.h:
decltype(ts::embedding_backward) embedding_backward;
decltype(ts::rmsnorm_forward) rmsnorm_forward;
decltype(ts::rmsnorm_backward) rmsnorm_backward;
decltype(ts::rope_forward) rope_forward;
decltype(ts::rope_backward) rope_backward;
decltype(ts::matmul) matmul;
decltype(ts::attention_forward) attention_forward;
decltype(ts::attention_backward) attention_backward;
decltype(ts::cross_entropy_forward_backward) cross_entropy_forward_backward;
decltype(ts::sum_squares) sum_squares;

}  // namespace ref
}  // namespace ts
