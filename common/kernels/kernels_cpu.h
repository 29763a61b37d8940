// kernels_cpu.h — the tuned CPU kernels of the ops of kernels.h whose plain loops are too slow to
// train with (kernels_cpu.cu). Same names, same contracts as kernels.h; the arguments are checked
// by the caller (kernels.cu). Each is held to its reference in kernels_ref.h by
// tests/test_kernels.cpp. Every reduction that crosses rows runs in a fixed order, so results are
// bitwise identical for any OMP_NUM_THREADS.
#pragma once
#include "kernels/kernels.h"

namespace ts {
namespace cpu {

// Each is declared with the type of its op in kernels.h: the same signature, checked by the compiler.
decltype(ts::embedding_backward) embedding_backward;  // threads own ranges of table rows, tokens in order
decltype(ts::rmsnorm_forward) rmsnorm_forward;        // threads over rows; sums of squares in double
decltype(ts::rmsnorm_backward) rmsnorm_backward;      // dw by column blocks, the rows in order
decltype(ts::rope_forward) rope_forward;              // cos/sin tables kept while the positions stay
decltype(ts::rope_backward) rope_backward;
decltype(ts::matmul) matmul;                          // OpenBLAS sgemm on panels fixed by the shape
decltype(ts::attention_forward) attention_forward;    // register tiles of 8 query rows per kv head
decltype(ts::attention_backward) attention_backward;  // tiles of 32 query rows, dK/dV in registers
decltype(ts::cross_entropy_forward_backward) cross_entropy_forward_backward;  // vectorised row passes
decltype(ts::vocab_ce_max) vocab_ce_max;              // the same row passes, split in three steps
decltype(ts::vocab_ce_stats) vocab_ce_stats;
decltype(ts::vocab_ce_finish) vocab_ce_finish;
decltype(ts::sum_squares) sum_squares;                // fixed chunks of 2^16 in double, in order

}  // namespace cpu
}  // namespace ts
