#include "worker_pool.h"

#include <algorithm>
#include <cstring>

namespace dppo {

CpuTicket::CpuTicket(size_t tasks) : remaining_(tasks) {}

void CpuTicket::finish_one(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error && !error_) error_ = error;
  if (--remaining_ == 0) {
    end_ = Clock::now();
    done_.notify_all();
  }
}

bool CpuTicket::ready() {
  std::lock_guard<std::mutex> lock(mu_);
  return remaining_ == 0;
}

void CpuTicket::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return remaining_ == 0; });
  if (error_) std::rethrow_exception(error_);
}

double CpuTicket::seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::chrono::duration<double>(end_ - start_).count();
}

WorkerPool::WorkerPool(size_t threads) {
  threads = std::max<size_t>(threads, 1);
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

TicketPtr WorkerPool::submit(std::vector<std::function<void()>> tasks) {
  auto ticket = std::make_shared<CpuTicket>(tasks.size());
  if (tasks.empty()) return ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& task : tasks) queue_.push_back({std::move(task), ticket});
  }
  wake_.notify_all();
  return ticket;
}

void WorkerPool::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      item.task();
    } catch (...) {
      error = std::current_exception();
    }
    item.ticket->finish_one(error);
  }
}

size_t default_cpu_threads() {
  const size_t hw = std::max<unsigned>(std::thread::hardware_concurrency(), 1u);
  return std::min<size_t>(4, hw);
}

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr size_t kChecksumPiece = size_t{4} << 20;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t round64(uint64_t acc, uint64_t word) { return rotl(acc + word * kP2, 31) * kP1; }
inline uint64_t mix(uint64_t h) {
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

// An xxh64-style hash: four independent lanes keep the multipliers busy (several GB/s per core).
uint64_t hash_piece(const uint8_t* p, size_t n, uint64_t seed) {
  uint64_t lane[4] = {seed + kP1 + kP2, seed + kP2, seed, seed - kP1};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int k = 0; k < 4; ++k) lane[k] = round64(lane[k], w[k]);
  }
  uint64_t h = rotl(lane[0], 1) + rotl(lane[1], 7) + rotl(lane[2], 12) + rotl(lane[3], 18) + n;
  for (; i < n; ++i) h = rotl(h ^ (p[i] * kP3), 11) * kP1;
  return mix(h);
}

}  // namespace

uint64_t checksum_bytes(WorkerPool& workers, const uint8_t* data, size_t bytes) {
  const size_t pieces = (bytes + kChecksumPiece - 1) / kChecksumPiece;
  std::vector<uint64_t> hashes(pieces);
  std::vector<std::function<void()>> tasks;
  tasks.reserve(pieces);
  for (size_t i = 0; i < pieces; ++i) {
    tasks.emplace_back([&, i] {
      const size_t off = i * kChecksumPiece;
      hashes[i] = hash_piece(data + off, std::min(kChecksumPiece, bytes - off), i);
    });
  }
  workers.submit(std::move(tasks))->wait();
  uint64_t h = mix(bytes ^ kP3);
  for (uint64_t piece : hashes) h = mix(h ^ piece) * kP1;
  return h;
}

}  // namespace dppo
