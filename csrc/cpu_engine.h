// The CPU path: a small pool of native worker threads that split copies into pieces, and the checksum.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "engine.h"

namespace dppo {

// Completes when all of its tasks have run; keeps the first failure to rethrow it from wait().
class CpuTicket : public Ticket {
 public:
  explicit CpuTicket(size_t tasks);
  void finish_one(std::exception_ptr error);
  bool ready() override;
  void wait() override;
  double seconds() override;

 private:
  using Clock = std::chrono::steady_clock;
  std::mutex mu_;
  std::condition_variable done_;
  size_t remaining_;
  std::exception_ptr error_;
  Clock::time_point start_ = Clock::now();
  Clock::time_point end_ = start_;
};

class WorkerPool {
 public:
  explicit WorkerPool(size_t threads);
  ~WorkerPool();  // runs what is queued, then joins
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues every task; the ticket completes once all of them have run.
  TicketPtr submit(std::vector<std::function<void()>> tasks);
  size_t threads() const { return threads_.size(); }

 private:
  struct Item {
    std::function<void()> task;
    std::shared_ptr<CpuTicket> ticket;
  };
  void loop();

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// memcpy; with `stream`, large copies use non-temporal stores on x86-64 (see cpu_engine.cpp).
void copy_bytes(void* dst, const void* src, size_t bytes, bool stream);
// Jobs of at least this many bytes (half the L3 cache) stream past the caches.
size_t stream_threshold_bytes();

// Worker count for CPU pools: min(4, hardware threads).
size_t default_cpu_threads();

// 64-bit checksum of `bytes` bytes, computed in parallel over fixed 4 MiB pieces (so the value does not
// depend on the number of workers) and folded in order.
uint64_t checksum_bytes(WorkerPool& workers, const uint8_t* data, size_t bytes);

class CpuEngine : public Engine {
 public:
  // copy_delay_s: testing aid, every copy task first sleeps this long (makes async races deterministic).
  // split_bytes: no copy crosses a multiple of this many bytes of arena offset (0: none); CPU arenas are
  // not pinned, so only tests set it, to run the chunk-splitting paths that CUDA arenas need.
  // fail_task: testing aid, the copy task with this 0-based sequence number (tasks are numbered in the order
  // copy() creates them) raises SnapshotError instead of copying; < 0: none.
  CpuEngine(WorkerPool& workers, size_t piece_bytes, double copy_delay_s, size_t split_bytes, int64_t fail_task = -1);

  bool is_cuda() const override { return false; }
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
