// Embedding tables on transparent huge pages.
//
// A training step reads and updates a table's rows (and their optimizer slots' rows)
// at scattered addresses. On 4 KiB pages nearly every such row costs a TLB miss and a
// page walk (a two-level one under a hypervisor); huge pages (2 MiB on x86-64) let the
// TLB cover a table of hundreds of megabytes. So the first time an update op sees a
// variable buffer of at least kMinHugePageBuffer bytes, it asks Linux to back the huge
// pages the buffer lies in with huge pages (MADV_HUGEPAGE, for pages faulted in later)
// and to collapse the pages already there now (MADV_COLLAPSE, Linux 6.1+) rather than
// wait for khugepaged's slow scan. It is advice: no value changes, and where Linux
// declines (an older kernel, no free huge page) the buffer stays on small pages. Where
// transparent huge pages are set to "never", nothing is asked. The pages at a buffer's
// ends hold its neighbours too, which the advice then covers. The update ops'
// `huge_pages` attribute (picasso_tf's `huge_pages` option) asks for it; each kernel
// advises a buffer once.
#ifndef PICASSO_TF_CUSTOM_OPS_HUGE_PAGES_H_
#define PICASSO_TF_CUSTOM_OPS_HUGE_PAGES_H_

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include "tensorflow/core/framework/tensor.h"

namespace picasso {

// Smaller buffers hold few whole huge pages and cover little of the TLB's reach.
constexpr int64_t kMinHugePageBuffer = 256 << 10;

// What one update kernel has advised. A kernel lives as long as the training function
// that holds it, so a new model's tables are advised by its own kernels even where
// they reuse the addresses of an older model's.
class HugePageAdvisor {
 public:
  // Advises t's buffer (see above) if it is large enough and not advised before.
  void Advise(const tensorflow::Tensor& t);

 private:
  std::mutex mu_;
  std::set<std::pair<const char*, size_t>> advised_;  // buffers, by (data, bytes)
};

}  // namespace picasso

#endif  // PICASSO_TF_CUSTOM_OPS_HUGE_PAGES_H_
