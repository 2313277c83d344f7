#include "cpu_engine.h"

#include <algorithm>
#include <cstring>

#include <unistd.h>

#include "errors.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

size_t stream_threshold_bytes() {
  static const size_t threshold = [] {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? static_cast<size_t>(l3) / 2 : size_t{32} << 20;
  }();
  return threshold;
}

void copy_bytes(void* dst, const void* src, size_t bytes, bool stream) {
#if defined(__SSE2__)
  // Copies of jobs larger than the cache bypass it with non-temporal stores: no read-for-ownership of
  // the destination and no eviction of the working set, which is what lets one huge memcpy beat the
  // same bytes copied in pieces with plain stores (libc streams only above a far larger size).
  constexpr size_t kStreamMinBytes = size_t{256} << 10;
  if (stream && bytes >= kStreamMinBytes) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    const size_t head = (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16;
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();  // streamed stores become visible before the task reports completion
    std::memcpy(d + i, s + i, bytes - i);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
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

CpuEngine::CpuEngine(WorkerPool& workers, size_t piece_bytes, double copy_delay_s, size_t split_bytes,
                     int64_t fail_task)
    : workers_(workers),
      piece_bytes_(std::max<size_t>(piece_bytes, 4096)),
      copy_delay_s_(copy_delay_s),
      split_bytes_(split_bytes),
      fail_task_(fail_task) {}

std::unique_ptr<HostArena> CpuEngine::new_arena(size_t bytes) { return std::make_unique<HostArena>(bytes); }

TicketPtr CpuEngine::copy(Direction /*dir*/, CopyJob job, const std::vector<TicketPtr>& deps) {
  // Host-side ordering: a job never starts while a job it depends on still runs on the workers. Deps only order
  // jobs, as on a CUDA stream: a failed one does not fail this job (the pool reports it).
  for (const auto& dep : deps) {
    try {
      if (dep) dep->wait();
    } catch (...) {
    }
  }
  // One task per piece_bytes of copies: large ranges arrive cut to that size, small ones are grouped, so
  // thousands of small tensors cost a few tasks rather than one each.
  std::vector<std::function<void()>> tasks;
  std::vector<Range> group;
  size_t group_bytes = 0;
  const bool stream = job.bytes >= stream_threshold_bytes();
  auto flush = [&] {
    if (group.empty()) return;
    tasks.emplace_back([ranges = std::move(group), stream] {
      for (const Range& r : ranges) copy_bytes(r.dst, r.src, r.bytes, stream);
    });
    group = {};
    group_bytes = 0;
  };
  for (const Range& r : job.ranges) {
    group.push_back(r);
    group_bytes += r.bytes;
    if (group_bytes >= piece_bytes_) flush();
  }
  flush();
  for (auto& task : job.tasks) tasks.push_back(std::move(task));
  for (auto& task : tasks) {
    const int64_t seq = next_task_++;
    if (seq != fail_task_) continue;
    task = [seq] { throw SnapshotError(cat("injected failure of CPU copy task ", seq, " (testing aid)")); };
  }
  if (copy_delay_s_ > 0) {
    const auto delay = std::chrono::duration<double>(copy_delay_s_);
    for (auto& task : tasks) {
      task = [delay, inner = std::move(task)] {
        std::this_thread::sleep_for(delay);
        inner();
      };
    }
  }
  return workers_.submit(std::move(tasks));
}

void CpuEngine::order_after(const std::vector<TicketPtr>& tickets) {
  for (const auto& t : tickets) {
    if (t) t->wait();
  }
}

TicketPtr CpuEngine::mark_caller() { return std::make_shared<CpuTicket>(0); }

void CpuEngine::read_back(void* dst, const void* src, size_t bytes, bool /*after_caller*/) {
  std::memcpy(dst, src, bytes);
}

}  // namespace dppo
