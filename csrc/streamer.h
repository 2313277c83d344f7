// Streams one slot to the compute device step by step (e.g. layer by layer) for a forward pass over the
// snapshot that leaves the live weights alone. CUDA pool + host slot: two device staging buffers, the
// load of step i+2 issued on the load stream once step i is released. Device-tier slots and CPU pools
// hand out views of the slot itself (zero copies). The streamer plans the steps and holds their order; the pool
// (its streaming interface, pool.h) does the copies.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pool.h"

namespace dppo {

class Streamer {
 public:
  // Throws UnknownNameError for a name the pool does not hold, EmptySlotError for an empty slot.
  Streamer(std::shared_ptr<Pool> pool, int64_t slot, const std::vector<std::vector<std::string>>& schedule);
  ~Streamer();
  Streamer(const Streamer&) = delete;
  Streamer& operator=(const Streamer&) = delete;

  void begin();
  NamedTensors acquire(int64_t step);
  void release(int64_t step);
  void end();

  size_t steps() const { return steps_.size(); }
  // Device bytes of the two staging buffers (0 when the slot is read in place).
  size_t staging_bytes() const;
  // "staged" (host slot streamed into device buffers), "device" or "host" (slot read in place).
  std::string mode() const;

 private:
  std::string mode_locked() const;
  void check_step(int64_t step, const char* op) const;
  void load(size_t step);

  std::shared_ptr<Pool> pool_;
  int64_t slot_;
  std::vector<StreamStep> steps_;
  size_t buffer_bytes_ = 0;  // one staging buffer: the largest step, aligned

  mutable std::mutex mu_;  // guards the pass below; taken before the pool's own lock, never while holding it
  bool active_ = false;
  StreamPass pass_;
  size_t next_acquire_ = 0;
  size_t next_release_ = 0;
  std::vector<TicketPtr> loaded_;  // per step: its load into staging
};

}  // namespace dppo
