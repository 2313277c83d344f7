// The copy-engine interface the pool drives. Two implementations: CpuEngine (native worker threads) and
// CudaEngine (dedicated save/load streams). The pool knows nothing of threads or streams; an engine knows
// nothing of slots.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "host_arena.h"
#include "ticket.h"

namespace dppo {

// Which of the engine's two copy queues runs a job: saves read the live tensors (device-to-host on CUDA),
// loads write them (host-to-device on CUDA). Each queue runs its jobs in issue order.
enum class Direction { kSave, kLoad };

struct Range {
  void* dst;
  const void* src;
  size_t bytes;
};

struct CopyJob {
  std::vector<Range> ranges;                 // raw byte copies
  std::vector<std::function<void()>> tasks;  // other copies (strided tensors), run in the queue's context
  size_t bytes = 0;                          // payload bytes, for stats
};

class Engine {
 public:
  virtual ~Engine() = default;

  // True when the live tensors' device has memory of its own, apart from host memory (a GPU). Then bytes may be
  // kept there (the pool's device tier), and a slot in host memory must be copied there before the device's
  // kernels can read it (a streamer stages it). False on the CPU, whose device memory is host memory.
  virtual bool separate_device_memory() const = 0;
  // True when ordering makes the host wait: copy() waits on the host for its deps, and order_after() blocks until
  // the tickets are done and rethrows a failure. The pool then waits first for what the engine would wait for
  // anyway, so that a failure is reported with its slot before anything changes. False when copies are ordered on
  // device queues (CUDA streams) and the host never waits.
  virtual bool orders_on_host() const = 0;
  // An exact-size host arena suited to this engine (pinned for CUDA). Throws SnapshotMemoryError.
  virtual std::unique_ptr<HostArena> new_arena(size_t bytes) = 0;
  // Copies must not cross a multiple of this many bytes of arena offset (pinning chunks); 0: no limit.
  virtual size_t arena_split_bytes() const = 0;
  // Preferred size of one copy piece: CPU work is split into pieces of this size across the workers.
  virtual size_t piece_bytes() const = 0;
  // True when a save and a load can run at the same time (separate copy engines on a GPU).
  virtual bool overlaps_directions() const = 0;

  // Issues `job` on the `dir` queue after `deps` and after the caller's already-queued work, and returns
  // without waiting for the copy. Deps only order the job: one that failed does not fail it.
  virtual TicketPtr copy(Direction dir, CopyJob job, const std::vector<TicketPtr>& deps) = 0;
  // Orders the caller's later work after `tickets` (CUDA: the current stream waits; CPU: the host waits and
  // rethrows a failure of one of them).
  virtual void order_after(const std::vector<TicketPtr>& tickets) = 0;
  // A ticket that completes when the caller's already-queued work has (CUDA: an event on the current
  // stream; CPU: already complete).
  virtual TicketPtr mark_caller() = 0;
  // Copies `bytes` of device-tier storage at `src` to host memory at `dst` and returns once they are there
  // (checksums). after_caller: the bytes as the caller's queued work leaves them (CUDA: ordered after the
  // current stream); else as they are now, without waiting for the caller's work.
  virtual void read_back(void* dst, const void* src, size_t bytes, bool after_caller) = 0;
};

}  // namespace dppo
