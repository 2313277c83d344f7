// An exact-size, page-aligned host buffer (anonymous mmap), pre-faulted so that the first copy into it
// does not pay page faults. Owns its mapping; the CUDA engine derives a pinned variant.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dppo {

class HostArena {
 public:
  // Maps `bytes` (rounded up to the page size). Throws SnapshotMemoryError if the mapping fails.
  explicit HostArena(size_t bytes);
  virtual ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uint8_t* data() const { return data_; }
  // Bytes actually mapped (what the pool reports in host_bytes).
  size_t bytes() const { return bytes_; }
  virtual bool pinned() const { return false; }

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page size of this machine; arena sizes are multiples of it.
size_t page_bytes();

}  // namespace dppo
