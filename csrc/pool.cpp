// SnapshotPool core: save/restore/clear/fence/synchronize, swapped(), view(), and completion bookkeeping
// (checksums, stats). Memory management lives in pool_memory.cpp, the streamer's passes in pool_stream.cpp.
#include "pool.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <optional>

#include "backend.h"
#include "errors.h"

namespace dppo {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string hex64(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The failure of a completed copy, or null if it succeeded.
std::exception_ptr failure_of(const TicketPtr& t) {
  try {
    t->wait();  // returns at once: the copy has completed
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

// What prune() raises for a failed copy of `op` for `slot`; `dropped`: the failed save's slot was emptied.
std::string failure_message(const std::string& op, int64_t slot, bool dropped, const std::string& what) {
  if (op == "save" && dropped) {
    return cat("save(", slot, ") failed: ", what, "; slot ", slot, " is empty now (its bytes were partial)");
  }
  if (op == "save") {
    return cat("save(", slot, ") failed: ", what, "; slot ", slot,
               " had been cleared or saved again since, so no slot holds its bytes");
  }
  if (slot >= 0) return cat("a ", op, " copy of slot ", slot, " failed: ", what);
  return cat("a ", op, " copy failed: ", what);
}

// dst.copy_(src) in a task of a copy queue (a worker thread, or the caller's thread on the engine's stream),
// outside autograd. Inference tensors (made under torch.inference_mode()) may be written in place only inside
// inference mode, which is per thread: the task enters it for them.
void copy_into(at::Tensor& dst, const at::Tensor& src) {
  at::NoGradGuard no_grad;
  std::optional<c10::InferenceMode> inference;
  if (dst.is_inference()) inference.emplace();
  dst.copy_(src, /*non_blocking=*/true);
}

}  // namespace

Pool::Pool(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, PoolOptions options)
    : options_(options), layout_(names, tensors, joinable_for(tensors)), names_(names) {
  if (options_.device_budget_bytes < 0) {
    throw std::invalid_argument(cat("device_budget_bytes must be >= 0, got ", options_.device_budget_bytes));
  }
  if (options_.cpu_threads < 0) {
    throw std::invalid_argument(cat("cpu_threads must be >= 0, got ", options_.cpu_threads));
  }
  if (options_.piece_bytes <= 0 || options_.swap_chunk_bytes <= 0) {
    throw std::invalid_argument(cat("piece_bytes and swap_chunk_bytes must be > 0, got ", options_.piece_bytes, " and ",
                                    options_.swap_chunk_bytes));
  }
  if (options_.pin_chunk_bytes < 0 || options_.pin_chunk_bytes % static_cast<int64_t>(page_bytes()) != 0) {
    throw std::invalid_argument(cat("pin_chunk_bytes must be 0 or a positive multiple of the page size (", page_bytes(),
                                    "), got ", options_.pin_chunk_bytes));
  }
  EngineOptions engine;
  engine.piece_bytes = static_cast<size_t>(options_.piece_bytes);
  engine.pin_chunk_bytes = static_cast<size_t>(options_.pin_chunk_bytes);
  engine.copy_delay_s = options_.copy_delay_s;
  engine.fail_copy_task = options_.fail_copy_task;
  engine_ = make_engine(layout_.device(), engine, [this]() -> WorkerPool& { return workers(); });
  pieces_ = layout_.pieces(engine_->piece_bytes(), engine_->arena_split_bytes());
}

Pool::~Pool() {
  // Pending copies read or write memory this pool owns: let them finish before anything is freed.
  std::lock_guard<std::mutex> lock(mu_);
  try {
    wait_all();
  } catch (...) {  // only an allocation failure can get here; a destructor never throws
  }
}

void Pool::for_each_storage(const std::function<void(const StoragePtr&)>& fn) const {
  auto visit = [&fn](const StoragePtr& s) {
    if (s) fn(s);
  };
  for (auto& [k, s] : slots_) visit(s.storage);
  for (auto& s : free_host_) visit(s);
  for (auto& s : retired_) visit(s);
  visit(scratch_);
  for (auto& s : staging_) visit(s);
}

void Pool::wait_all() {
  for (auto& f : in_flight_) wait_quietly(f.ticket);
  wait_quietly(live_reads_);
  for_each_storage([&](const StoragePtr& s) { wait_quietly(s->pending()); });
}

WorkerPool& Pool::workers() {
  if (!workers_) {
    const size_t n = options_.cpu_threads > 0 ? static_cast<size_t>(options_.cpu_threads) : default_cpu_threads();
    workers_ = std::make_unique<WorkerPool>(n);
  }
  return *workers_;
}

void Pool::check_slot(int64_t slot, const char* op) {
  if (slot < 0) throw std::invalid_argument(cat(op, ": slot must be >= 0, got ", slot));
}

void Pool::throw_empty(int64_t slot, const char* op) {
  std::string filled;
  for (auto& [k, s] : slots_) filled += (filled.empty() ? "" : ", ") + std::to_string(k);
  throw EmptySlotError(cat(op, ": slot ", slot, " is empty (filled slots: [", filled, "])"));
}

Pool::Slot& Pool::get_slot(int64_t slot, const char* op) {
  auto it = slots_.find(slot);
  if (it == slots_.end()) throw_empty(slot, op);
  return it->second;
}

// ---------------------------------------------------------------------------------------------------
// Copies

at::Tensor Pool::alias(const StoragePtr& storage, const Entry& entry, size_t offset, bool keep_alive) const {
  const auto device = storage->on_device() ? layout_.device() : at::Device(at::kCPU);
  const auto opts = at::TensorOptions().dtype(entry.dtype).device(device);
  if (!keep_alive) return at::from_blob(storage->data() + offset, entry.sizes, opts);
  // A view keeps the storage alive: a cleared or overwritten slot never hands its memory to another slot
  // while a view of it exists (the pool copies on write instead).
  return at::from_blob(storage->data() + offset, entry.sizes, [keep = storage](void*) {}, opts);
}

CopyJob Pool::job(Direction dir, const StoragePtr& storage, const std::vector<Run>& pieces, bool with_strided) const {
  CopyJob j;
  uint8_t* base = storage->data();
  j.ranges.reserve(pieces.size());
  for (const Run& p : pieces) {
    if (dir == Direction::kSave) {
      j.ranges.push_back({base + p.offset, p.live, p.bytes});
    } else {
      j.ranges.push_back({const_cast<uint8_t*>(p.live), base + p.offset, p.bytes});
    }
    j.bytes += p.bytes;
  }
  if (!with_strided) return j;
  const size_t split = storage->on_device() ? 0 : engine_->arena_split_bytes();
  for (size_t idx : layout_.strided()) {
    const Entry& e = layout_.entries()[idx];
    j.bytes += e.nbytes;
    if (split > 0 && e.offset / split != (e.offset + e.nbytes - 1) / split) {
      j.tasks.push_back(strided_across_chunks(dir, storage, e, split));
      continue;
    }
    at::Tensor region = alias(storage, e, e.offset, /*keep_alive=*/false);  // tickets guard it
    at::Tensor live = e.live;
    if (dir == Direction::kSave) {
      j.tasks.emplace_back([region, live]() mutable { copy_into(region, live); });
    } else {
      j.tasks.emplace_back([region, live]() mutable { copy_into(live, region); });
    }
  }
  return j;
}

// A strided tensor whose slot bytes cross a pinning chunk boundary of a host arena: one copy of it would span
// two registrations, which the driver may treat as pageable memory (a copy that blocks the host, or that reads
// the host bytes at issue time rather than in stream order). So it goes through a contiguous temporary on the
// live tensor's device, copied chunk by chunk. The temporary is allocated on the queue's stream and used only
// there, so the caching allocator's stream order keeps it alive long enough.
std::function<void()> Pool::strided_across_chunks(Direction dir, const StoragePtr& storage, const Entry& e,
                                                  size_t split) const {
  std::vector<std::pair<int64_t, int64_t>> cuts;  // [begin, end) byte ranges of the entry, one per chunk
  for (size_t at = 0; at < e.nbytes;) {
    const size_t n = std::min(e.nbytes - at, split - (e.offset + at) % split);
    cuts.emplace_back(static_cast<int64_t>(at), static_cast<int64_t>(at + n));
    at += n;
  }
  at::Tensor slot_bytes =  // tickets guard the storage
      at::from_blob(storage->data() + e.offset, {static_cast<int64_t>(e.nbytes)}, at::TensorOptions().dtype(at::kByte));
  at::Tensor live = e.live;
  if (dir == Direction::kSave) {
    return [slot_bytes, live, cuts]() mutable {
      at::NoGradGuard no_grad;
      const at::Tensor flat = live.contiguous().reshape({-1}).view(at::kByte);
      for (const auto& [a, b] : cuts) slot_bytes.slice(0, a, b).copy_(flat.slice(0, a, b), /*non_blocking=*/true);
    };
  }
  return [slot_bytes, live, cuts]() mutable {
    at::NoGradGuard no_grad;
    const at::Tensor flat = at::empty_like(slot_bytes, at::TensorOptions().device(live.device()));
    for (const auto& [a, b] : cuts) flat.slice(0, a, b).copy_(slot_bytes.slice(0, a, b), /*non_blocking=*/true);
    copy_into(live, flat.view(live.scalar_type()).view(live.sizes()));
  };
}

TicketPtr Pool::issue(Direction dir, CopyJob job, const std::vector<TicketPtr>& deps, const char* op, int64_t slot,
                      bool counted) {
  const size_t bytes = job.bytes;
  TicketPtr t = engine_->copy(dir, std::move(job), deps);
  in_flight_.push_back({t, op, slot, bytes, counted, /*report=*/true});
  return t;
}

void Pool::load_from(const StoragePtr& storage, const char* op, int64_t slot) {
  std::vector<TicketPtr> deps = live_reads_;  // pending saves still read what this load overwrites
  if (storage->write) deps.push_back(storage->write);
  layout_.bump_versions();  // before the copy: nothing may fail once the live tensors are being written
  TicketPtr t = issue(Direction::kLoad, job(Direction::kLoad, storage, pieces_, true), deps, op, slot);
  storage->reads.push_back(t);
  order_caller_after(t);
  live_reads_.clear();  // the load waited for them, and the caller now waits for the load
}

void Pool::order_caller_after(const TicketPtr& ticket) {
  try {
    engine_->order_after({ticket});
  } catch (...) {
    mark_reported({ticket});
    throw;
  }
}

void Pool::await_save_before_load(Storage& storage) {
  if (engine_->orders_on_host()) await_save(storage);
}

void Pool::ready_to_read(Storage& storage) {
  if (!storage.on_device()) {
    await_save(storage);
  } else if (storage.write) {
    engine_->order_after({storage.write});  // kernels on the caller's queue see the save
  }
}

// ---------------------------------------------------------------------------------------------------
// save, restore, clear, fence, synchronize

void Pool::save(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "save");
  layout_.check_live("save");
  prune();
  auto it = slots_.find(slot);
  // Overwrite in place unless views still read the old snapshot: then copy on write into another arena.
  const bool in_place = it != slots_.end() && it->second.storage.use_count() == 1;
  StoragePtr target = in_place ? it->second.storage : take_storage(fits_device(layout_.storage_bytes()), "save", slot);
  TicketPtr t;
  try {
    t = issue(Direction::kSave, job(Direction::kSave, target, pieces_, true), target->pending(), "save", slot);
  } catch (...) {
    if (in_place) slots_.erase(it);  // partly overwritten: never serve it
    let_go(std::move(target));
    throw;
  }
  target->write = t;
  target->reads.clear();  // the new write waited for them; later writers wait for the write
  target->checksum.reset();
  target->checksum_due = options_.checksum;
  live_reads_.push_back(t);
  if (in_place) return;
  if (it != slots_.end()) {
    StoragePtr old = std::move(it->second.storage);
    it->second.storage = std::move(target);
    let_go(std::move(old));
  } else {
    slots_.emplace(slot, Slot{std::move(target)});
  }
}

void Pool::restore(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "restore");
  layout_.check_live("restore");
  prune();
  StoragePtr storage = get_slot(slot, "restore").storage;
  await_save_before_load(*storage);
  verify(*storage, slot, "restore");
  load_from(storage, "restore", slot);
}

void Pool::clear(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "clear");
  prune();
  auto it = slots_.find(slot);
  if (it == slots_.end()) throw_empty(slot, "clear");
  StoragePtr storage = std::move(it->second.storage);
  slots_.erase(it);
  let_go(std::move(storage));
}

void Pool::fence() {
  std::lock_guard<std::mutex> lock(mu_);
  // An engine that orders on the host would wait for the pending saves in order_after() and rethrow a failure bare:
  // waiting first lets prune() raise it with its slot, and leaves no save pending.
  if (engine_->orders_on_host()) wait_quietly(live_reads_);
  prune();
  engine_->order_after(live_reads_);  // the caller's later work waits for the pending saves
}

void Pool::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_all();
  prune();
}

// ---------------------------------------------------------------------------------------------------
// swapped()

void Pool::swap_in(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "swapped");
  layout_.check_live("swapped");
  prune();
  if (swapped_) {
    throw SnapshotError(cat("swapped(", slot, "): another slot is already swapped in; swapped() does not nest"));
  }
  StoragePtr storage = get_slot(slot, "swapped").storage;
  await_save_before_load(*storage);  // as in restore(): a failed save is raised before any change
  verify(*storage, slot, "swapped");
  prepare_scratch(storage->on_device(), slot);
  SwapAttempt attempt{slot, swap_chunks(), /*outs=*/{}, /*ins=*/{}};
  layout_.bump_versions();  // before the copies: nothing may fail once the live tensors are being written
  try {
    issue_swap(attempt, storage);
    order_caller_after(attempt.ins.back());  // the caller's later work sees the slot
  } catch (...) {
    undo_swap_in(attempt, std::current_exception());
  }
  scratch_->write = attempt.outs.back();  // each queue runs in order: the last copies imply the earlier ones
  scratch_->reads.clear();
  storage->reads.push_back(attempt.ins.back());
  live_reads_.clear();
  swapped_ = storage;
}

void Pool::prepare_scratch(bool device_slot, int64_t slot) {
  const bool device = device_slot && ((scratch_ && scratch_->on_device()) || fits_device(layout_.storage_bytes()));
  if (scratch_ && scratch_->on_device() != device) let_go(std::move(scratch_));
  if (!scratch_) scratch_ = take_storage(device, "swapped", slot);
}

// One exchange of everything where the engine cannot overlap a save and a load (a load would only wait for its
// save). Otherwise strided tensors first, then the runs in chunks of swap_chunk_bytes, so that chunk i comes in on
// the load queue while chunk i+1 leaves on the save queue. Never empty, so that entering always counts one swap.
std::vector<Pool::SwapChunk> Pool::swap_chunks() const {
  if (!engine_->overlaps_directions()) return {SwapChunk{pieces_, true}};
  const auto chunk_bytes = static_cast<size_t>(options_.swap_chunk_bytes);
  std::vector<SwapChunk> chunks;
  if (!layout_.strided().empty()) chunks.push_back(SwapChunk{{}, true});
  SwapChunk chunk;
  size_t bytes = 0;
  for (const Run& piece : layout_.pieces(chunk_bytes, engine_->arena_split_bytes())) {
    chunk.pieces.push_back(piece);
    bytes += piece.bytes;
    if (bytes >= chunk_bytes) {
      chunks.push_back(std::move(chunk));
      chunk = SwapChunk{};
      bytes = 0;
    }
  }
  if (!chunk.pieces.empty() || chunks.empty()) chunks.push_back(std::move(chunk));
  return chunks;
}

void Pool::issue_swap(SwapAttempt& attempt, const StoragePtr& storage) {
  std::vector<TicketPtr> out_deps = scratch_->pending();
  std::vector<TicketPtr> in_deps = live_reads_;  // pending saves still read what the loads overwrite
  if (storage->write) in_deps.push_back(storage->write);
  const std::vector<SwapChunk>& chunks = attempt.chunks;
  for (size_t i = 0; i < chunks.size(); ++i) {
    CopyJob out_job = job(Direction::kSave, scratch_, chunks[i].pieces, chunks[i].with_strided);
    CopyJob in_job = job(Direction::kLoad, storage, chunks[i].pieces, chunks[i].with_strided);
    attempt.outs.push_back(issue(Direction::kSave, std::move(out_job), out_deps, "swap", attempt.slot, false));
    out_deps.clear();
    in_deps.push_back(attempt.outs.back());  // chunk i comes in only once it has left
    // Deps only order copies, so a load would run after a failed save all the same. An engine that orders on the
    // host waits for the save there anyway: check here that the chunk reached the scratch. (On device queues a copy
    // fails when it is issued, or on the stream with an error of the context that the load meets too.)
    if (engine_->orders_on_host()) attempt.outs.back()->wait();
    attempt.loading = i + 1;
    const bool last = i + 1 == chunks.size();  // entering counts one swap
    attempt.ins.push_back(issue(Direction::kLoad, std::move(in_job), in_deps, "swap", attempt.slot, last));
    in_deps.clear();
  }
}

void Pool::undo_swap_in(const SwapAttempt& attempt, std::exception_ptr error) {
  const int64_t slot = attempt.slot;
  // The error thrown below tells of these copies' failures.
  mark_reported(attempt.outs);
  mark_reported(attempt.ins);
  // Nothing of this attempt may still run when the live tensors are put back (an engine whose copy() fails part
  // way has already drained that queue), nor may a pending save still read them.
  wait_quietly(attempt.outs);
  wait_quietly(attempt.ins);
  wait_quietly(live_reads_);
  // The scratch holds a chunk's live bytes iff the chunk's save completed. A load waits for its chunk's save, so a
  // chunk whose save failed had nothing loaded unless its load was issued all the same (then it cannot be undone).
  std::vector<Run> back;
  bool with_strided = false;
  std::string lost;
  for (size_t i = 0; i < attempt.loading; ++i) {
    if (const std::exception_ptr failed = failure_of(attempt.outs[i])) {
      if (i < attempt.ins.size()) lost = message_of(failed);
      continue;
    }
    const SwapChunk& chunk = attempt.chunks[i];
    back.insert(back.end(), chunk.pieces.begin(), chunk.pieces.end());
    with_strided = with_strided || chunk.with_strided;
  }
  auto cannot_undo = [&](const std::string& why) {
    return SnapshotError(cat("swapped(", slot, "): entering failed (", message_of(error),
                             ") and the live weights could not be copied back from the swap scratch (", why,
                             "); the live tensors may hold part of slot ", slot));
  };
  if (!back.empty() || with_strided) {
    try {
      const TicketPtr t = issue(Direction::kLoad, job(Direction::kLoad, scratch_, back, with_strided), {}, "swap", slot,
                                /*counted=*/false);
      mark_reported({t});
      t->wait();
    } catch (...) {
      throw cannot_undo(message_of(std::current_exception()));
    }
  }
  if (!lost.empty()) throw cannot_undo(cat("a chunk that was loaded never reached the scratch: ", lost));
  if (!attempt.outs.empty()) {  // every copy of the scratch has finished
    scratch_->write.reset();
    scratch_->reads.clear();
  }
  std::rethrow_exception(error);
}

void Pool::swap_out() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!swapped_) throw SnapshotError("swapped(): exit without a matching enter");
  StoragePtr storage = std::move(swapped_);
  swapped_.reset();
  layout_.check_live("swapped (exit: the live weights could not be put back)");
  collect();  // a failure found now is raised once the live weights are back
  load_from(scratch_, "swap", -1);
  raise_failures();
}

// ---------------------------------------------------------------------------------------------------
// Reads of a slot

NamedTensors Pool::view(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "view");
  prune();
  const auto t0 = Clock::now();
  StoragePtr storage = get_slot(slot, "view").storage;
  verify(*storage, slot, "view");
  ready_to_read(*storage);
  std::vector<at::Tensor> by_entry(layout_.entries().size());  // tied names share one view
  NamedTensors out;
  out.reserve(names_.size());
  for (const std::string& name : names_) {
    const size_t idx = layout_.find(name);
    const Entry& e = layout_.entries()[idx];
    if (!by_entry[idx].defined()) by_entry[idx] = alias(storage, e, e.offset, true);
    out.emplace_back(name, by_entry[idx]);
  }
  OpStats& st = ops_["view"];
  st.count += 1;  // bytes stay 0: a view copies nothing
  st.seconds += since(t0);
  return out;
}

bool Pool::contains(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.count(slot) > 0;
}

std::vector<int64_t> Pool::slots() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (auto& [k, s] : slots_) out.push_back(k);
  return out;
}

std::string Pool::tier(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "tier");
  return get_slot(slot, "tier").storage->on_device() ? "device" : "host";
}

std::vector<std::string> Pool::names() const { return names_; }

// ---------------------------------------------------------------------------------------------------
// Completion bookkeeping

void Pool::await_save(Storage& storage) {
  if (!storage.write) return;
  wait_quietly(storage.write);
  prune();  // settles the save, or drops the slot and raises its failure
}

void Pool::settle(Storage& storage) {
  if (!storage.write || !storage.write->ready() || failure_of(storage.write)) return;
  if (storage.checksum_due) {
    const auto t0 = Clock::now();
    storage.checksum = checksum_of(storage, /*after_caller=*/false);
    storage.checksum_due = false;
    counters_["checksum_seconds"] += since(t0);
  }
  storage.write.reset();
}

void Pool::verify(Storage& storage, int64_t slot, const char* op) {
  if (!options_.checksum) return;
  await_save(storage);
  if (!storage.checksum) return;  // saved before checksums were due (cannot happen with checksum=True)
  const auto t0 = Clock::now();
  const uint64_t now = checksum_of(storage, /*after_caller=*/true);
  counters_["checksum_seconds"] += since(t0);
  if (now != *storage.checksum) {
    throw SnapshotError(cat(op, "(", slot, "): slot ", slot, " fails its checksum: saved ", hex64(*storage.checksum),
                            ", now ", hex64(now), "; its bytes changed after the save, so nothing was copied"));
  }
}

uint64_t Pool::checksum_of(const Storage& storage, bool after_caller) {
  if (storage.on_device()) {
    // Not .cpu(): that would wait for everything on the caller's stream even when only the save's result is
    // wanted (settle runs inside every pool call), blocking the host behind a queued forward pass.
    at::Tensor host = at::empty({static_cast<int64_t>(storage.bytes)}, at::TensorOptions().dtype(at::kByte));
    engine_->read_back(host.data_ptr(), storage.data(), storage.bytes, after_caller);
    return checksum_bytes(workers(), host.data_ptr<uint8_t>(), storage.bytes);
  }
  return checksum_bytes(workers(), storage.data(), storage.bytes);
}

void Pool::prune() {
  collect();
  raise_failures();
}

void Pool::raise_failures() {
  if (failures_.empty()) return;
  std::string message = failures_[0];
  for (size_t i = 1; i < failures_.size(); ++i) message += "; and " + failures_[i];
  failures_.clear();
  throw SnapshotError(message);
}

void Pool::collect() {
  std::vector<InFlight> still;
  for (auto& f : in_flight_) {
    if (!f.ticket->ready()) {
      still.push_back(std::move(f));
      continue;
    }
    if (const std::exception_ptr error = failure_of(f.ticket)) {
      counters_["failed_copies"] += 1;  // op stats count completed copies only
      const bool dropped = forget_failed(f.ticket);
      if (f.report) failures_.push_back(failure_message(f.op, f.slot, dropped, message_of(error)));
      continue;
    }
    OpStats& st = ops_[f.op];
    st.count += f.counted ? 1 : 0;
    st.bytes += static_cast<double>(f.bytes);
    try {
      st.seconds += f.ticket->seconds();
    } catch (...) {  // the copy succeeded but its timing is unavailable
    }
  }
  in_flight_ = std::move(still);
  live_reads_.erase(
      std::remove_if(live_reads_.begin(), live_reads_.end(), [](const TicketPtr& t) { return t->ready(); }),
      live_reads_.end());
  for (auto& [k, s] : slots_) {
    settle(*s.storage);
    s.storage->prune_reads();
  }
  reclaim();
}

bool Pool::forget_failed(const TicketPtr& t) {
  bool dropped = false;
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.storage->write != t) {
      ++it;
      continue;
    }
    StoragePtr storage = std::move(it->second.storage);
    it = slots_.erase(it);
    storage->write.reset();
    let_go(std::move(storage));  // back to the free list unless a view still holds it
    dropped = true;
  }
  for_each_storage([&t](const StoragePtr& s) {
    if (s->write == t) s->write.reset();  // a cleared slot's arena, a scratch or staging buffer: no snapshot
    s->reads.erase(std::remove(s->reads.begin(), s->reads.end(), t), s->reads.end());
  });
  live_reads_.erase(std::remove(live_reads_.begin(), live_reads_.end(), t), live_reads_.end());
  return dropped;
}

void Pool::mark_reported(const std::vector<TicketPtr>& tickets) {
  for (auto& f : in_flight_) {
    if (std::find(tickets.begin(), tickets.end(), f.ticket) != tickets.end()) f.report = false;
  }
}

std::map<std::string, std::map<std::string, double>> Pool::op_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  prune();
  std::map<std::string, std::map<std::string, double>> out;
  for (const char* op : {"save", "restore", "swap", "view", "stream"}) {
    const OpStats& st = ops_[op];
    out[op] = {{"count", static_cast<double>(st.count)},
               {"bytes", st.bytes},
               {"seconds", st.seconds},
               {"gbps", st.seconds > 0 ? st.bytes / st.seconds / 1e9 : 0.0}};
  }
  return out;
}

std::map<std::string, double> Pool::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  prune();
  std::map<std::string, double> out;
  for (const char* key : {"arena_allocs", "arena_alloc_bytes", "arena_alloc_seconds", "arena_frees", "device_allocs",
                          "staging_allocs", "checksum_seconds", "failed_copies"}) {
    out[key] = counters_[key];
  }
  out["host_bytes"] = static_cast<double>(count_bytes(false, false));
  out["device_bytes"] = static_cast<double>(count_bytes(true, true));
  out["free_arenas"] = static_cast<double>(free_host_.size());
  out["retired_storages"] = static_cast<double>(retired_.size());
  out["pending_copies"] = static_cast<double>(in_flight_.size());
  out["slots"] = static_cast<double>(slots_.size());
  return out;
}

}  // namespace dppo
