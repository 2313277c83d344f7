// An exact-size, page-aligned host buffer (anonymous mmap), pre-faulted so that the first copy into it
// does not pay page faults. Owns its mapping; the CUDA engine derives pinned variants (one registers the
// mapping, one adopts memory from cudaHostAlloc and frees it itself).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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

 protected:
  // Adopts `bytes` (a multiple of the page size) at `data`, allocated elsewhere: the subclass frees it.
  HostArena(uint8_t* data, size_t bytes) : data_(data), bytes_(bytes), mapped_(false) {}

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
  bool mapped_ = true;  // ours to munmap
};

// Page size of this machine; arena sizes are multiples of it.
size_t page_bytes();

// For memory errors: "N bytes of host memory available" (MemAvailable of /proc/meminfo), or a note that the
// system does not say.
std::string host_available_note();

}  // namespace dppo
