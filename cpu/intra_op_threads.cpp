// torch.ops.duet_cpu.intra_op_threads: fix the calling thread's intra-op thread count, as this
// library sees it, at torch's current count, and return it.
//
// at::parallel_for reads the count once per thread, through an inline function whose "done"
// flag every library that calls it compiles in for itself: this library's kernels would read
// it on their first call in a thread, whatever libtorch had fixed for that thread before. The
// engine loop calls this first thing (common/engine/loop.py), before the daemon lowers the count
// for every other thread to one (common/serving/placement.py), so the kernels keep the cores.
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

int64_t intra_op_threads() {
  at::internal::lazy_init_num_threads();
  return at::get_num_threads();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duet_cpu, m) { m.def("intra_op_threads() -> int"); }

TORCH_LIBRARY_IMPL(duet_cpu, CompositeExplicitAutograd, m) { m.impl("intra_op_threads", intra_op_threads); }
