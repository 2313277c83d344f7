#include "cpu_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include <unistd.h>

#include "errors.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dppo {

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
