// SnapshotPool memory: host arenas (free list, max_host_bytes), device buffers (budget), reserve/release.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>

#include "errors.h"
#include "pool.h"

namespace dppo {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

// ---------------------------------------------------------------------------------------------------
// Storage management

size_t Pool::count_bytes(bool device, bool with_staging) const {
  size_t total = 0;
  for_each_storage([&](const StoragePtr& s) {
    if (!with_staging && (s == staging_[0] || s == staging_[1])) return;
    if (s->on_device() == device) total += s->held_bytes();
  });
  return total;
}

bool Pool::fits_device(size_t extra_bytes) const {
  if (!engine_->separate_device_memory()) return false;  // no device tier: the device's memory is host memory
  return count_bytes(true, false) + extra_bytes <= static_cast<size_t>(options_.device_budget_bytes);
}

StoragePtr Pool::take_storage(bool device, const char* op, int64_t slot) {
  if (device) return new_device_storage(layout_.storage_bytes());
  reclaim();
  if (!free_host_.empty()) {
    StoragePtr s = std::move(free_host_.back());
    free_host_.pop_back();
    return s;
  }
  return new_host_storage(op, slot);
}

StoragePtr Pool::new_host_storage(const char* op, int64_t slot) {
  const size_t page = page_bytes();
  const size_t need = (layout_.storage_bytes() + page - 1) / page * page;
  if (options_.max_host_bytes >= 0) {
    const size_t held = count_bytes(false, false);
    const size_t limit = static_cast<size_t>(options_.max_host_bytes);
    if (held + need > limit) {
      throw SnapshotMemoryError(cat(op, "(", slot, "): a new host arena needs ", need, " bytes but only ",
                                    limit > held ? limit - held : 0, " are available (max_host_bytes=", limit, ", ",
                                    held, " held); clear() unused slots or raise max_host_bytes"));
    }
  }
  const auto t0 = Clock::now();
  auto s = std::make_shared<Storage>();
  try {
    s->host = engine_->new_arena(layout_.storage_bytes());
  } catch (const SnapshotMemoryError& e) {
    throw SnapshotMemoryError(cat(op, "(", slot, "): ", e.what()));
  }
  s->bytes = layout_.storage_bytes();
  counters_["arena_allocs"] += 1;
  counters_["arena_alloc_bytes"] += static_cast<double>(s->host->bytes());
  counters_["arena_alloc_seconds"] += since(t0);
  return s;
}

StoragePtr Pool::new_device_storage(size_t bytes) {
  auto s = std::make_shared<Storage>();
  const auto opts = at::TensorOptions().dtype(at::kByte).device(layout_.device());
  try {
    s->device = at::empty({static_cast<int64_t>((bytes + 7) / 8 * 8)}, opts);
  } catch (const c10::OutOfMemoryError& e) {
    throw SnapshotMemoryError(
        cat("allocating ", bytes, " bytes of device memory failed: ", e.what_without_backtrace()));
  }
  s->bytes = bytes;
  counters_["device_allocs"] += 1;
  return s;
}

void Pool::let_go(StoragePtr storage) {
  if (!storage) return;
  storage->checksum.reset();
  storage->checksum_due = false;
  if (storage.use_count() == 1 && !storage->on_device()) {
    free_host_.push_back(std::move(storage));  // its pending copies are waited on by its next writer
  } else {
    retired_.push_back(std::move(storage));  // referenced by views/streamers, or a device buffer still busy
  }
}

void Pool::reclaim() {
  std::vector<StoragePtr> keep;
  for (auto& s : retired_) {
    if (s.use_count() > 1) {
      keep.push_back(std::move(s));
    } else if (!s->on_device()) {
      free_host_.push_back(std::move(s));
    } else if (!s->idle()) {
      keep.push_back(std::move(s));  // torch's allocator may hand the memory out again: wait for our streams
    }
  }
  retired_ = std::move(keep);
}

// ---------------------------------------------------------------------------------------------------
// Memory

void Pool::reserve(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n < 0) throw std::invalid_argument(cat("reserve: n must be >= 0, got ", n));
  prune();  // reclaims arenas that views or copies no longer hold
  // n free arenas, whatever the slots hold: the next n new slots, or a swapped() scratch, allocate nothing.
  const size_t before = free_host_.size();
  try {
    while (free_host_.size() < static_cast<size_t>(n)) free_host_.push_back(new_host_storage("reserve", n));
  } catch (...) {
    counters_["arena_frees"] += static_cast<double>(free_host_.size() - before);
    free_host_.resize(before);  // all or nothing
    throw;
  }
}

void Pool::release() {
  std::lock_guard<std::mutex> lock(mu_);
  prune();
  reclaim();
  auto free_now = [&](StoragePtr& s) {
    if (!s) return;
    wait_quietly(s->pending());  // a failure is prune()'s to report
    if (!s->on_device()) counters_["arena_frees"] += 1;
    s.reset();
  };
  for (auto& s : free_host_) free_now(s);
  free_host_.clear();
  if (!swapped_) free_now(scratch_);
  if (!streaming_) {
    free_now(staging_[0]);
    free_now(staging_[1]);
  }
}

size_t Pool::host_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim();
  return count_bytes(false, false);
}

size_t Pool::device_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim();
  return count_bytes(true, true);
}

size_t Pool::staging_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return (staging_[0] ? staging_[0]->bytes : 0) + (staging_[1] ? staging_[1]->bytes : 0);
}

}  // namespace dppo
