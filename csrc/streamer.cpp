#include "streamer.h"

#include <algorithm>
#include <numeric>

#include "errors.h"

namespace dppo {

namespace {

// Slot ranges closer than this are copied as one (the gap is padding between tensors).
constexpr size_t kMergeGapBytes = 4096;

// Step `index` of a schedule: its tensors (each name once), and their slot bytes in slot order as segments, merged
// across small gaps, each at a staging offset congruent to its slot offset (so tensors keep their alignment).
StreamStep plan_step(const Layout& layout, size_t index, const std::vector<std::string>& names) {
  StreamStep step;
  for (const std::string& name : names) {
    if (std::find(step.names.begin(), step.names.end(), name) != step.names.end()) continue;
    size_t idx;
    try {
      idx = layout.find(name);
    } catch (const UnknownNameError&) {
      throw UnknownNameError(cat("streamer schedule step ", index, ": no tensor named '", name, "' in this pool"));
    }
    step.names.push_back(name);
    step.entries.push_back(idx);
  }
  std::vector<size_t> order(step.entries.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return layout.entries()[step.entries[a]].offset < layout.entries()[step.entries[b]].offset;
  });
  step.staging_offsets.assign(step.entries.size(), 0);
  size_t cursor = 0;
  for (size_t k : order) {
    const Entry& e = layout.entries()[step.entries[k]];
    if (e.nbytes == 0) continue;  // staging offset 0
    StreamStep::Segment* last = step.segments.empty() ? nullptr : &step.segments.back();
    if (last && e.offset <= last->slot_offset + last->bytes + kMergeGapBytes) {
      last->bytes = std::max(last->bytes, e.offset + e.nbytes - last->slot_offset);
    } else {
      const size_t at = align_congruent(cursor, e.offset % kAlignBytes);
      step.segments.push_back({e.offset, at, e.nbytes});
    }
    const StreamStep::Segment& seg = step.segments.back();
    step.staging_offsets[k] = seg.staging_offset + (e.offset - seg.slot_offset);
    cursor = seg.staging_offset + seg.bytes;
  }
  return step;
}

}  // namespace

Streamer::Streamer(std::shared_ptr<Pool> pool, int64_t slot, const std::vector<std::vector<std::string>>& schedule)
    : pool_(std::move(pool)), slot_(slot) {
  pool_->check_filled(slot, "streamer");  // EmptySlotError now rather than at begin()
  for (size_t i = 0; i < schedule.size(); ++i) {
    steps_.push_back(plan_step(pool_->layout(), i, schedule[i]));
    const std::vector<StreamStep::Segment>& segments = steps_.back().segments;  // in staging order
    if (!segments.empty())
      buffer_bytes_ = std::max(buffer_bytes_, segments.back().staging_offset + segments.back().bytes);
  }
  buffer_bytes_ = (buffer_bytes_ + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
}

Streamer::~Streamer() {
  try {
    end();
  } catch (...) {
  }
}

std::string Streamer::mode_locked() const {
  if (!active_) return pool_->stream_mode(slot_);
  if (pass_.staged) return "staged";
  return pass_.source->on_device() ? "device" : "host";
}

size_t Streamer::staging_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mode_locked() == "staged" ? 2 * buffer_bytes_ : 0;
}

std::string Streamer::mode() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mode_locked();
}

void Streamer::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (active_) throw SnapshotError("streamer.begin(): already begun; call end() first");
  pass_ = pool_->begin_stream(slot_, buffer_bytes_);
  active_ = true;
  next_acquire_ = next_release_ = 0;
  loaded_.assign(steps_.size(), nullptr);
  if (pass_.staged) {
    for (size_t i = 0; i < std::min<size_t>(2, steps_.size()); ++i) load(i);
  }
}

void Streamer::load(size_t step) { loaded_[step] = pool_->stage(pass_, step % 2, steps_[step]); }

void Streamer::check_step(int64_t step, const char* op) const {
  if (!active_) {
    throw SnapshotError(cat("streamer.", op, "(", step, "): not begun; call begin() or use `with streamer:`"));
  }
  if (step < 0 || static_cast<size_t>(step) >= steps_.size()) {
    throw std::invalid_argument(cat("streamer.", op, "(", step, "): step out of range [0, ", steps_.size(), ")"));
  }
}

NamedTensors Streamer::acquire(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
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
  NamedTensors out = pool_->step_views(pass_, i % 2, loaded_[i], steps_[i]);
  ++next_acquire_;
  return out;
}

void Streamer::release(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  check_step(step, "release");
  const auto i = static_cast<size_t>(step);
  if (i != next_release_ || i >= next_acquire_) {
    throw SnapshotError(cat("streamer.release(", step,
                            "): steps are released in order after their acquire; expected release(", next_release_, ")",
                            next_release_ < next_acquire_ ? "" : cat(" after acquire(", next_release_, ")")));
  }
  if (pass_.staged) {
    pool_->release_staged(i % 2);
    if (i + 2 < steps_.size()) load(i + 2);
  }
  ++next_release_;
}

void Streamer::end() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_) return;
  pool_->end_stream(pass_);
  pass_ = StreamPass{};
  loaded_.clear();
  active_ = false;
}

}  // namespace dppo
