// The CPU path: copies split into pieces and run on native worker threads (worker_pool.h); ordering is on the host.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine.h"
#include "worker_pool.h"

namespace dppo {

// memcpy; with `stream`, large copies use non-temporal stores on x86-64 (see cpu_engine.cpp).
void copy_bytes(void* dst, const void* src, size_t bytes, bool stream);
// Jobs of at least this many bytes (half the L3 cache) stream past the caches.
size_t stream_threshold_bytes();

class CpuEngine : public Engine {
 public:
  // copy_delay_s: testing aid, every copy task first sleeps this long (makes async races deterministic).
  // split_bytes: no copy crosses a multiple of this many bytes of arena offset (0: none); CPU arenas are
  // not pinned, so only tests set it, to run the chunk-splitting paths that CUDA arenas need.
  // fail_task: testing aid, the copy task with this 0-based sequence number (tasks are numbered in the order
  // copy() creates them) raises SnapshotError instead of copying; < 0: none.
  CpuEngine(WorkerPool& workers, size_t piece_bytes, double copy_delay_s, size_t split_bytes, int64_t fail_task = -1);

  bool separate_device_memory() const override { return false; }  // the live tensors are in host memory
  bool orders_on_host() const override { return true; }           // copies wait for their deps on the host
  std::unique_ptr<HostArena> new_arena(size_t bytes) override;
  size_t arena_split_bytes() const override { return split_bytes_; }
  size_t piece_bytes() const override { return piece_bytes_; }
  bool overlaps_directions() const override { return false; }
  TicketPtr copy(Direction dir, CopyJob job, const std::vector<TicketPtr>& deps) override;
  void order_after(const std::vector<TicketPtr>& tickets) override;
  TicketPtr mark_caller() override;
  void read_back(void* dst, const void* src, size_t bytes, bool after_caller) override;

 private:
  WorkerPool& workers_;
  size_t piece_bytes_;
  double copy_delay_s_;
  size_t split_bytes_;
  int64_t fail_task_;
  int64_t next_task_ = 0;  // copy() runs under the pool's lock
};

}  // namespace dppo
