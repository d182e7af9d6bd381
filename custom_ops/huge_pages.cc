// Embedding tables on transparent huge pages (huge_pages.h).
#include "huge_pages.h"

#include <sys/mman.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's value; older kernels reject it with EINVAL
#endif

namespace picasso {
namespace {

constexpr uintptr_t kHugePage = 2 << 20;

}  // namespace

void HugePageAdvisor::Advise(const tensorflow::Tensor& t) {
  const auto data = t.tensor_data();
  if (static_cast<int64_t>(data.size()) < kMinHugePageBuffer) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!advised_.emplace(data.data(), data.size()).second) return;
  }
  // Every huge page the buffer touches, its ends included: tables of a few megabytes
  // hold few whole ones, and their neighbours are often other tables. One page per
  // call: Linux refuses a range that is not all mapped, and a huge page must lie in one
  // mapping; the pages that cannot be huge (a buffer's end in a mapping of its own) are
  // refused alone, and a page left small costs only speed.
  const auto begin = reinterpret_cast<uintptr_t>(data.data());
  const uintptr_t end = begin + data.size();
  for (uintptr_t page = begin & ~(kHugePage - 1); page < end; page += kHugePage) {
    void* start = reinterpret_cast<void*>(page);
    if (madvise(start, kHugePage, MADV_HUGEPAGE) == 0) {
      madvise(start, kHugePage, MADV_COLLAPSE);  // a page already huge is left as it is
    }
  }
}

}  // namespace picasso
