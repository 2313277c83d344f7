// SnapshotPool's side of a streamer pass (streamer.h drives it): the slot held for the pass, the two device staging
// buffers, the copies into them and their hazards.
#include <algorithm>

#include "errors.h"
#include "pool.h"

namespace dppo {

bool Pool::stages(const Storage& storage) const { return engine_->separate_device_memory() && !storage.on_device(); }

void Pool::check_filled(int64_t slot, const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, op);
  get_slot(slot, op);
}

std::string Pool::stream_mode(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = slots_.find(slot);
  if (it != slots_.end() && stages(*it->second.storage)) return "staged";
  return engine_->separate_device_memory() ? "device" : "host";
}

StreamPass Pool::begin_stream(int64_t slot, size_t buffer_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  prune();
  StreamPass pass{slot, get_slot(slot, "streamer.begin").storage, false};
  verify(*pass.source, slot, "stream");
  pass.staged = stages(*pass.source);
  if (pass.staged) {
    if (streaming_) throw SnapshotError("streamer.begin(): another streamer of this pool is active; end() it first");
    for (auto& buffer : staging_) {
      if (buffer && buffer->bytes >= buffer_bytes) continue;
      if (buffer) retired_.push_back(std::move(buffer));  // freed once its copies are done
      buffer = new_device_storage(buffer_bytes);
      counters_["staging_allocs"] += 1;
    }
    streaming_ = true;
  } else {
    ready_to_read(*pass.source);  // the pass reads the slot in place
  }
  ops_["stream"].count += 1;  // one per pass, in every mode; staged copies add their bytes as they complete
  return pass;
}

TicketPtr Pool::stage(const StreamPass& pass, size_t buffer, const StreamStep& step) {
  std::lock_guard<std::mutex> lock(mu_);
  Storage& staging = *staging_[buffer];
  const size_t split = engine_->arena_split_bytes();
  CopyJob job;
  for (const StreamStep::Segment& seg : step.segments) {
    for (size_t done = 0; done < seg.bytes;) {  // never cross a pinning chunk of the host arena
      size_t n = seg.bytes - done;
      if (split > 0) n = std::min(n, split - (seg.slot_offset + done) % split);
      job.ranges.push_back(
          {staging.data() + seg.staging_offset + done, pass.source->data() + seg.slot_offset + done, n});
      done += n;
    }
    job.bytes += seg.bytes;
  }
  std::vector<TicketPtr> deps = staging.pending();  // the caller's work that read the buffer's previous step
  if (pass.source->write) deps.push_back(pass.source->write);
  TicketPtr t = issue(Direction::kLoad, std::move(job), deps, "stream", pass.slot, /*counted=*/false);  // a pass counts
  staging.write = t;
  staging.reads.clear();
  pass.source->reads.push_back(t);
  return t;
}

NamedTensors Pool::step_views(const StreamPass& pass, size_t buffer, const TicketPtr& loaded, const StreamStep& step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pass.staged) engine_->order_after({loaded});  // kernels queued from now on see the step
  NamedTensors out;
  out.reserve(step.names.size());
  for (size_t k = 0; k < step.names.size(); ++k) {
    const Entry& e = layout_.entries()[step.entries[k]];
    out.emplace_back(step.names[k], pass.staged ? alias(staging_[buffer], e, step.staging_offsets[k], true)
                                                : alias(pass.source, e, e.offset, true));
  }
  return out;
}

void Pool::release_staged(size_t buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  staging_[buffer]->reads.push_back(engine_->mark_caller());  // the caller's work that reads the step
}

void Pool::end_stream(const StreamPass& pass) {
  if (!pass.staged) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& buffer : staging_) {
    if (buffer) buffer->reads.push_back(engine_->mark_caller());  // the caller's work still reading a step
  }
  streaming_ = false;
}

}  // namespace dppo
