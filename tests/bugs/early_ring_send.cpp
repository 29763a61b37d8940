// early_ring_send, in 04_tensor_parallel (--async-tp-early-send, registered here like 04a's
// --async-tp): async TP's reduce-scatter ring sends each step's block before the accumulator
// arriving from the left has been added to it, so a block's sum travels on without the ranks
// before. The block a rank sends is copied as it stands before the add and that copy is sent: what
// an Isend posted ahead of the add would carry (an eager MPI message is copied at the post), made
// deterministic for the test. At tp 2 the one send carries no accumulator yet, so the bug shows
// from tp 3 on (tests/test_async_tp.cpp runs it at tp 4).
#include "bug.h"
#include "../../04a_async_tp.cu"

namespace {

class EarlyRingSend : public tp::AsyncTensorParallel {
 public:
  using AsyncTensorParallel::AsyncTensorParallel;

 protected:
  void accumulate_and_pass(const ts::Tensor& part, const ts::Tensor& in, tp::RingTransfer& ring, int s, int T) override {
    if (s == 0 || s + 1 == T) return AsyncTensorParallel::accumulate_and_pass(part, in, ring, s, T);
    bug::announce("early_ring_send");
    ts::Tensor early = ts::Tensor::empty(part.shape, part.dtype, part.device(), ts::Tag::Workspace);
    ts::copy(early, part);  // the block before the arriving sum is in it
    AsyncTensorParallel::accumulate_and_pass(part, in, ring, s, s + 1);  // wait and add; as the last step, no send
    post(ring, "reduce_scatter ring (g)", early, in);
  }
};

const bool kRegistered = tp::add_variant({
    "--async-tp-early-send",
    "deliberate bug early_ring_send: --async-tp with each ring step sent before its block is summed",
    tp::validate_async,
    [](ts::Model& m, ts::Comm& group) {
      if (group.size() > 1) tp::install_async(m, std::make_unique<EarlyRingSend>(group, m.table));
    },
    tp::async_step_time_model,
    tp::async_comm,
});

}  // namespace
