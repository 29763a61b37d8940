// early_combine_read, in 07_expert_parallel (--overlap-a2a-early-combine, registered here like
// 07b's --overlap-a2a): the combine's output rows are read before its all-to-all has completed, so
// the gate-weighted sum takes whatever the buffer held. What a read racing the transfer sees at
// worst, made deterministic for the test: the rows as they stood before the post (a read after it
// could see some of them already delivered, an eager MPI message matched at the post), put back
// over what arrived once the wait is over. tests/test_overlap_a2a.cpp runs it at ep 2 and 4.
#include "bug.h"
#include "../../07b_overlap_a2a.cu"

#include <cstring>

namespace {

class EarlyCombineRead : public ep::OverlappedMoe {
 public:
  using OverlappedMoe::OverlappedMoe;

 protected:
  void exchange(ts::Comm& c, const ts::Tensor& out, const std::vector<int64_t>& out_rows, const ts::Tensor& in,
                const std::vector<int64_t>& in_rows, const char* what) override {
    if (std::strncmp(what, "combine", 7) != 0) return OverlappedMoe::exchange(c, out, out_rows, in, in_rows, what);
    bug::announce("early_combine_read");
    ts::Tensor early = ts::Tensor::empty(out.shape, out.dtype, out.device(), ts::Tag::Workspace);
    ts::copy(early, out);  // the rows before the all-to-all has written any
    OverlappedMoe::exchange(c, out, out_rows, in, in_rows, what);
    ts::copy(out, early);  // what the read saw
  }
};

const bool kRegistered = ep::add_schedule({
    "--overlap-a2a-early-combine",
    "deliberate bug early_combine_read: --overlap-a2a with each combine's rows read before its all-to-all completes",
    ep::validate_overlap,
    [](ts::Model& m, ts::Comm& group, const std::vector<int>& nodes) -> ep::ExpertParallelMoe& {
      return ep::install_overlapped(m, new EarlyCombineRead(m, group, nodes));
    },
    ep::run_pairs,
    ep::hide_all_to_all,
    2,
});

}  // namespace
