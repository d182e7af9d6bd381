// Embedding tables on transparent huge pages (huge_pages.h).
#include "huge_pages.h"

#include <sys/mman.h>

#include <fstream>
#include <iterator>
#include <string>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's value; older kernels reject it with EINVAL
#endif

namespace picasso {
namespace {

// The size of a huge page (2 MiB on x86-64), 0 where Linux offers none or the machine's
// administrator turned them off ("never"): then nothing is advised, although
// MADV_COLLAPSE alone would ignore that setting.
size_t HugePageSize() {
  static const size_t size = [] {
    std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string modes((std::istreambuf_iterator<char>(enabled)), std::istreambuf_iterator<char>());
    if (modes.empty() || modes.find("[never]") != std::string::npos) return size_t{0};
    size_t bytes = 0;
    std::ifstream("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") >> bytes;
    return bytes;
  }();
  return size;
}

}  // namespace

void HugePageAdvisor::Advise(const tensorflow::Tensor& t) {
  const auto data = t.tensor_data();
  const uintptr_t page_size = HugePageSize();
  if (page_size == 0 || static_cast<int64_t>(data.size()) < kMinHugePageBuffer) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!advised_.emplace(data.data(), data.size()).second) return;
  }
  // Every huge page the buffer touches, its ends included: tables of a few megabytes
  // hold few whole ones, and their neighbours are often other tables. One huge page per
  // call: over a range whose ends lie outside the buffer's mapping, MADV_COLLAPSE gives
  // up (EINVAL), and a huge page must lie in one mapping anyway; a page that cannot be
  // huge is refused alone, and costs only speed.
  const auto begin = reinterpret_cast<uintptr_t>(data.data());
  const uintptr_t end = begin + data.size();
  for (uintptr_t page = begin & ~(page_size - 1); page < end; page += page_size) {
    void* start = reinterpret_cast<void*>(page);
    if (madvise(start, page_size, MADV_HUGEPAGE) == 0) {
      madvise(start, page_size, MADV_COLLAPSE);  // a page already huge is left as it is
    }
  }
}

}  // namespace picasso
