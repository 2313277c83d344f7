#include "host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "errors.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14; older kernels answer EINVAL and we touch pages instead
#endif

namespace dppo {

size_t page_bytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

std::string host_available_note() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) {
      return cat(kib * 1024, " bytes of host memory available");
    }
  }
  return "host memory available: unknown";
}

HostArena::HostArena(size_t bytes) {
  const size_t page = page_bytes();
  bytes_ = (bytes + page - 1) / page * page;
  if (bytes_ == 0) bytes_ = page;
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int error = errno;
    throw SnapshotMemoryError(cat("allocating a host arena of ", bytes_, " bytes failed: mmap: ", std::strerror(error),
                                  " (", host_available_note(), ")"));
  }
  data_ = static_cast<uint8_t*>(p);
  // Huge pages cut TLB misses during large copies; a refusal only costs speed.
  constexpr size_t kHugePage = size_t{2} << 20;
  if (bytes_ >= kHugePage) madvise(data_, bytes_, MADV_HUGEPAGE);
  // Fault every page in now (allocation is off the hot path) rather than during the first save.
  if (madvise(data_, bytes_, MADV_POPULATE_WRITE) != 0) {
    for (size_t off = 0; off < bytes_; off += page) data_[off] = 0;
  }
}

HostArena::~HostArena() {
  if (data_ != nullptr && mapped_) munmap(data_, bytes_);
}

}  // namespace dppo
