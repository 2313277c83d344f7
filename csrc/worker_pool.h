// Native worker threads: the CPU engine's copy queue and, on either engine, the pool's checksums.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ticket.h"

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

// Worker count for CPU pools: min(4, hardware threads).
size_t default_cpu_threads();

// 64-bit checksum of `bytes` bytes, computed in parallel over fixed 4 MiB pieces (so the value does not
// depend on the number of workers) and folded in order.
uint64_t checksum_bytes(WorkerPool& workers, const uint8_t* data, size_t bytes);

}  // namespace dppo
