#include "streamer.h"

#include <algorithm>
#include <numeric>

#include "errors.h"

namespace dppo {

namespace {
// Slot ranges closer than this are copied as one (the gap is padding between tensors).
constexpr size_t kMergeGapBytes = 4096;
}  // namespace

Streamer::Streamer(std::shared_ptr<Pool> pool, int64_t slot, const std::vector<std::vector<std::string>>& schedule)
    : pool_(std::move(pool)), slot_(slot) {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  Pool::check_slot(slot, "streamer");
  pool_->get_slot(slot, "streamer");  // EmptySlotError now rather than at begin()
  const Layout& layout = pool_->layout_;
  for (size_t i = 0; i < schedule.size(); ++i) {
    Step step;
    for (const std::string& name : schedule[i]) {
      if (std::find(step.names.begin(), step.names.end(), name) != step.names.end()) continue;
      size_t idx;
      try {
        idx = layout.find(name);
      } catch (const UnknownNameError&) {
        throw UnknownNameError(cat("streamer schedule step ", i, ": no tensor named '", name, "' in this pool"));
      }
      step.names.push_back(name);
      step.entries.push_back(idx);
    }
    // Segments: the step's tensors in slot order, merged across small gaps, each at a staging offset
    // congruent to its slot offset (so tensors keep their alignment).
    std::vector<size_t> order(step.entries.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return layout.entries()[step.entries[a]].offset < layout.entries()[step.entries[b]].offset;
    });
    step.staging_offsets.assign(step.entries.size(), 0);
    size_t cursor = 0;
    for (size_t k : order) {
      const Entry& e = layout.entries()[step.entries[k]];
      if (e.nbytes > 0) {
        Segment* last = step.segments.empty() ? nullptr : &step.segments.back();
        if (last && e.offset <= last->slot_offset + last->bytes + kMergeGapBytes) {
          last->bytes = std::max(last->bytes, e.offset + e.nbytes - last->slot_offset);
        } else {
          const size_t at = align_congruent(cursor, e.offset % kAlignBytes);
          step.segments.push_back({e.offset, at, e.nbytes});
        }
        const Segment& seg = step.segments.back();
        step.staging_offsets[k] = seg.staging_offset + (e.offset - seg.slot_offset);
        cursor = seg.staging_offset + seg.bytes;
      } else {
        step.staging_offsets[k] = 0;
      }
    }
    buffer_bytes_ = std::max(buffer_bytes_, cursor);
    steps_.push_back(std::move(step));
  }
  buffer_bytes_ = (buffer_bytes_ + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
}

Streamer::~Streamer() {
  try {
    end();
  } catch (...) {
  }
}

bool Streamer::staged_now() const {
  if (!pool_->engine_->separate_device_memory()) return false;  // the device reads host memory in place
  auto it = pool_->slots_.find(slot_);
  return it != pool_->slots_.end() && !it->second.storage->on_device();
}

size_t Streamer::staging_bytes() const {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  return (active_ ? staged_ : staged_now()) ? 2 * buffer_bytes_ : 0;
}

std::string Streamer::mode() const {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  if (active_ ? staged_ : staged_now()) return "staged";
  return pool_->engine_->separate_device_memory() ? "device" : "host";
}

void Streamer::begin() {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  Pool& pool = *pool_;
  if (active_) throw SnapshotError("streamer.begin(): already begun; call end() first");
  pool.prune();
  StoragePtr source = pool.get_slot(slot_, "streamer.begin").storage;
  pool.verify(*source, slot_, "stream");
  staged_ = staged_now();
  if (staged_) {
    if (pool.streaming_)
      throw SnapshotError("streamer.begin(): another streamer of this pool is active; end() it first");
    for (auto& buffer : pool.staging_) {
      if (buffer && buffer->bytes >= buffer_bytes_) continue;
      if (buffer) pool.retired_.push_back(std::move(buffer));  // freed once its copies are done
      buffer = pool.new_device_storage(buffer_bytes_);
      pool.counters_["staging_allocs"] += 1;
    }
    pool.streaming_ = true;
  } else if (source->on_device()) {
    if (source->write) pool.engine_->order_after({source->write});
  } else {
    pool.await_save(*source);  // host slot read in place: its save must be complete
  }
  source_ = std::move(source);
  active_ = true;
  next_acquire_ = next_release_ = 0;
  loaded_.assign(steps_.size(), nullptr);
  if (staged_) {
    for (size_t i = 0; i < std::min<size_t>(2, steps_.size()); ++i) load(i);
  }
  pool.ops_["stream"].count += 1;  // one per pass, in every mode; staged copies add their bytes as they complete
}

void Streamer::load(size_t step) {
  Pool& pool = *pool_;
  Storage& buffer = *pool.staging_[step % 2];
  const size_t split = pool.engine_->arena_split_bytes();
  CopyJob job;
  for (const Segment& seg : steps_[step].segments) {
    size_t done = 0;
    while (done < seg.bytes) {  // never cross a pinning chunk of the host arena
      size_t n = seg.bytes - done;
      if (split > 0) n = std::min(n, split - (seg.slot_offset + done) % split);
      job.ranges.push_back({buffer.data() + seg.staging_offset + done, source_->data() + seg.slot_offset + done, n});
      done += n;
    }
    job.bytes += seg.bytes;
  }
  std::vector<TicketPtr> deps = buffer.pending();  // the kernels that read the previous step in it
  if (source_->write) deps.push_back(source_->write);
  TicketPtr t =
      pool.issue(Direction::kLoad, std::move(job), deps, "stream", slot_, /*counted=*/false);  // begin() counts
  buffer.write = t;
  buffer.reads.clear();
  source_->reads.push_back(t);
  loaded_[step] = t;
}

void Streamer::check_step(int64_t step, const char* op) const {
  if (!active_)
    throw SnapshotError(cat("streamer.", op, "(", step, "): not begun; call begin() or use `with streamer:`"));
  if (step < 0 || static_cast<size_t>(step) >= steps_.size()) {
    throw std::invalid_argument(cat("streamer.", op, "(", step, "): step out of range [0, ", steps_.size(), ")"));
  }
}

NamedTensors Streamer::acquire(int64_t step) {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  check_step(step, "acquire");
  const auto i = static_cast<size_t>(step);
  if (i != next_acquire_) {
    throw SnapshotError(
        cat("streamer.acquire(", step, "): steps are acquired in order; the next one is ", next_acquire_));
  }
  if (i >= 2 && next_release_ < i - 1) {
    throw SnapshotError(cat("streamer.acquire(", step, ") before release(", i - 2, "): step ", i,
                            " loads into the buffer that step ", i - 2, " still holds"));
  }
  Pool& pool = *pool_;
  const Step& s = steps_[i];
  NamedTensors out;
  out.reserve(s.names.size());
  if (staged_) {
    pool.engine_->order_after({loaded_[i]});  // kernels queued from now on see step i
    const StoragePtr& buffer = pool.staging_[i % 2];
    for (size_t k = 0; k < s.names.size(); ++k) {
      out.emplace_back(s.names[k],
                       pool.alias(buffer, pool.layout_.entries()[s.entries[k]], s.staging_offsets[k], true));
    }
  } else {
    for (size_t k = 0; k < s.names.size(); ++k) {
      const Entry& e = pool.layout_.entries()[s.entries[k]];
      out.emplace_back(s.names[k], pool.alias(source_, e, e.offset, true));
    }
  }
  ++next_acquire_;
  return out;
}

void Streamer::release(int64_t step) {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  check_step(step, "release");
  const auto i = static_cast<size_t>(step);
  if (i != next_release_ || i >= next_acquire_) {
    throw SnapshotError(cat("streamer.release(", step,
                            "): steps are released in order after their acquire; expected release(", next_release_, ")",
                            next_release_ < next_acquire_ ? "" : cat(" after acquire(", next_release_, ")")));
  }
  if (staged_) {
    Pool& pool = *pool_;
    pool.staging_[i % 2]->reads.push_back(pool.engine_->mark_caller());  // kernels that read step i
    if (i + 2 < steps_.size()) load(i + 2);
  }
  ++next_release_;
}

void Streamer::end() {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  end_locked();
}

void Streamer::end_locked() {
  if (!active_) return;
  if (staged_) {
    Pool& pool = *pool_;
    for (auto& buffer : pool.staging_) {
      if (buffer) buffer->reads.push_back(pool.engine_->mark_caller());  // kernels still reading a step
    }
    pool.streaming_ = false;
  }
  source_.reset();
  loaded_.clear();
  active_ = false;
}

}  // namespace dppo
