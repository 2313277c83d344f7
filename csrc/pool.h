// SnapshotPool core: slots of weight snapshots, a free list of host arenas, the device tier, hazard
// tracking between pending copies, checksums and stats. Copies themselves go through an Engine; a Streamer
// runs its passes through the streaming part of the interface.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"
#include "layout.h"
#include "storage.h"
#include "worker_pool.h"

namespace dppo {

struct PoolOptions {
  int64_t max_host_bytes = -1;          // < 0: no limit
  int64_t device_budget_bytes = 0;      // device memory that slots may use (CUDA pools)
  bool checksum = false;                // checksum every save, verify on restore/view/swapped/stream
  int64_t cpu_threads = 0;              // 0: min(4, hardware threads)
  int64_t piece_bytes = 4 << 20;        // CPU copies are split into pieces of this size
  int64_t swap_chunk_bytes = 64 << 20;  // CUDA swapped(): granularity of the interleaved copies
  // Host arenas are pinned in chunks of this many bytes (a multiple of the page size) and no copy crosses a
  // chunk boundary. 0: the engine's default (CUDA: 1 GiB; CPU: no chunks, arenas are not pinned).
  int64_t pin_chunk_bytes = 0;
  double copy_delay_s = 0;      // testing aid: every CPU copy task first sleeps this long
  int64_t fail_copy_task = -1;  // testing aid: the CPU copy task with this sequence number raises (< 0: none)
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct OpStats {
  int64_t count = 0;
  double bytes = 0;
  double seconds = 0;
};

// One step of a streamer's schedule (planned in streamer.cpp): the tensors it hands out, and the slot ranges a
// staged pass copies into a staging buffer for it.
struct StreamStep {
  struct Segment {
    size_t slot_offset;
    size_t staging_offset;
    size_t bytes;
  };
  std::vector<std::string> names;
  std::vector<size_t> entries;          // per name: its layout entry
  std::vector<size_t> staging_offsets;  // per name: where its entry lies in a staging buffer
  std::vector<Segment> segments;        // slot ranges copied for this step
};

// A streamer's pass over one slot. Staged: the slot is in host memory and the device has memory of its own, so each
// step is copied into one of the pool's two device staging buffers (one pass at a time holds them). Otherwise the
// pass hands out views of the slot itself.
struct StreamPass {
  int64_t slot = -1;
  StoragePtr source;  // the slot's storage, held for the whole pass
  bool staged = false;
};

class Pool {
 public:
  Pool(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, PoolOptions options);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  void save(int64_t slot);
  void restore(int64_t slot);
  void clear(int64_t slot);
  void fence();
  void synchronize();
  void swap_in(int64_t slot);
  void swap_out();
  NamedTensors view(int64_t slot);

  bool contains(int64_t slot);
  std::vector<int64_t> slots();
  std::string tier(int64_t slot);
  void reserve(int64_t n);
  void release();

  size_t nbytes() const { return layout_.nbytes(); }
  size_t storage_bytes() const { return layout_.storage_bytes(); }
  size_t runs() const { return layout_.runs().size(); }  // contiguous copy ranges, before chunking
  size_t host_bytes();
  size_t device_bytes();
  size_t staging_bytes();
  std::vector<std::string> names() const;
  std::map<std::string, std::map<std::string, double>> op_stats();
  std::map<std::string, double> counters();

  // Streaming passes (the Streamer's interface; pool_stream.cpp).
  const Layout& layout() const { return layout_; }  // fixed at construction
  // Throws std::invalid_argument for a negative slot, EmptySlotError (naming `op`) for an empty one.
  void check_filled(int64_t slot, const char* op);
  // What a pass over `slot` begun now would do: "staged", or read the slot in place on the "device" or the "host".
  std::string stream_mode(int64_t slot);
  // Begins a pass over `slot` and counts it. Verifies the slot's checksum. A staged pass takes the staging buffers
  // (grown to buffer_bytes each) or throws SnapshotError while another pass holds them; a pass in place makes the
  // slot's save visible to the caller, as view() does.
  StreamPass begin_stream(int64_t slot, size_t buffer_bytes);
  // Issues the copy of `step`'s segments into staging buffer `buffer` (0 or 1) after the caller's work that read its
  // previous step; the ticket completes when the step is there.
  TicketPtr stage(const StreamPass& pass, size_t buffer, const StreamStep& step);
  // Views of `step`'s tensors: in staging buffer `buffer`, the caller's later work ordered after `loaded` (a staged
  // pass), or in the slot itself.
  NamedTensors step_views(const StreamPass& pass, size_t buffer, const TicketPtr& loaded, const StreamStep& step);
  // The caller's work queued so far reads staging buffer `buffer`: the next stage() into it waits for that work.
  void release_staged(size_t buffer);
  // Ends a pass: a staged one leaves both buffers to the caller's queued work, then to the next staged pass.
  void end_stream(const StreamPass& pass);

 private:
  struct Slot {
    StoragePtr storage;
  };
  struct InFlight {
    TicketPtr ticket;
    const char* op;
    int64_t slot;  // the slot the copy is for (< 0: none, e.g. the copy back of swapped())
    size_t bytes;
    bool counted;
    bool report;  // a failure is raised by prune(), unless the call that issued the copy rethrew it
  };

  static void check_slot(int64_t slot, const char* op);
  Slot& get_slot(int64_t slot, const char* op);
  [[noreturn]] void throw_empty(int64_t slot, const char* op);

  // Storage management (pool_memory.cpp).
  // Calls `fn` on every storage the pool owns: slots, free list, retired, swap scratch, staging buffers. Every
  // walk over all of them (draining, byte counts) goes through here, so none can forget a kind of storage.
  void for_each_storage(const std::function<void(const StoragePtr&)>& fn) const;
  // Blocks until every copy of this pool has finished: tracked copies, pending saves, every storage's hazards.
  // Failures are not rethrown here: prune() reports them.
  void wait_all();
  size_t count_bytes(bool device, bool with_staging) const;
  bool fits_device(size_t extra_bytes) const;
  StoragePtr take_storage(bool device, const char* op, int64_t slot);
  StoragePtr new_host_storage(const char* op, int64_t slot);
  StoragePtr new_device_storage(size_t bytes);
  void let_go(StoragePtr storage);
  void reclaim();

  // Copies between the live tensors and a storage.
  CopyJob job(Direction dir, const StoragePtr& storage, const std::vector<Run>& pieces, bool with_strided) const;
  std::function<void()> strided_across_chunks(Direction dir, const StoragePtr& storage, const Entry& e,
                                              size_t split) const;
  // Issues a copy of `op` for `slot` and tracks it for stats and failures; `counted` says whether it counts as
  // one call of `op`. The deps only order the copy: a failed dep does not fail it.
  TicketPtr issue(Direction dir, CopyJob job, const std::vector<TicketPtr>& deps, const char* op, int64_t slot,
                  bool counted = true);
  // Copies `storage` into the live tensors; a failure of that copy rethrown here (an engine that orders on the host)
  // is not raised again by prune().
  void load_from(const StoragePtr& storage, const char* op, int64_t slot);
  // Orders the caller's later work after `ticket`. A failure rethrown here (an engine that orders on the host) is
  // the calling operation's to report: prune() only counts it.
  void order_caller_after(const TicketPtr& ticket);
  // Before a load from `storage`: an engine that orders on the host would wait for the storage's save anyway, so
  // waiting here raises a failed save before the live tensors are touched. (On device queues the load waits there.)
  void await_save_before_load(Storage& storage);
  // The caller reads `storage` next: its save is made visible to the caller's work on the device (device tier) or
  // awaited on the host (host tier; a failed save is raised).
  void ready_to_read(Storage& storage);

  // swapped(). Entering copies the live tensors to the scratch and the slot into the live tensors in chunks: each
  // chunk leaves for the scratch, then the slot's bytes of the same chunk come in.
  struct SwapChunk {
    std::vector<Run> pieces;
    bool with_strided = false;
  };
  // One attempt at entering, recorded as its copies are issued so that a failure can be undone.
  struct SwapAttempt {
    int64_t slot;
    std::vector<SwapChunk> chunks;
    std::vector<TicketPtr> outs;  // per chunk issued: its save to the scratch
    std::vector<TicketPtr> ins;   // per chunk issued: its load into the live tensors
    size_t loading = 0;           // chunks whose load was issued, the last perhaps only in part
  };
  std::vector<SwapChunk> swap_chunks() const;
  // The scratch for a slot in device memory (`device_slot`) or host memory: on the device when the slot is and the
  // budget allows (device-to-device copies), else a host arena.
  void prepare_scratch(bool device_slot, int64_t slot);
  void issue_swap(SwapAttempt& attempt, const StoragePtr& storage);
  // Entering failed with `error`: copies the chunks already loaded into the live tensors back from the scratch and
  // rethrows `error`; throws SnapshotError if they cannot be put back.
  [[noreturn]] void undo_swap_in(const SwapAttempt& attempt, std::exception_ptr error);

  // Completion bookkeeping. Every call runs prune() first: it takes stock of the copies that have completed
  // (collect()) and raises, once, a SnapshotError for those that failed and that no call has rethrown.
  void prune();
  // prune() without the raise: the failures wait in failures_ for the next prune() (or raise_failures()).
  void collect();
  void raise_failures();
  // A copy that failed leaves no trace in the hazards, so that no later copy waits on it or rethrows it: a failed
  // save's slot is dropped (its bytes are partial) and its arena let go. Returns whether a slot was dropped.
  bool forget_failed(const TicketPtr& ticket);
  // Marks these copies' failures as rethrown by the call that issued them: prune() only counts them.
  void mark_reported(const std::vector<TicketPtr>& tickets);
  // Blocks until `storage`'s pending save has completed, then prune(): a failed save is raised here, once.
  void await_save(Storage& storage);
  // Takes the checksum of a completed save (when due) and forgets the save. Leaves a failed one to collect().
  void settle(Storage& storage);
  void verify(Storage& storage, int64_t slot, const char* op);
  // after_caller: a device-tier storage is read as the caller's queued work leaves it (verify), else as the
  // completed save left it, without waiting for the caller (settle).
  uint64_t checksum_of(const Storage& storage, bool after_caller);
  at::Tensor alias(const StoragePtr& storage, const Entry& entry, size_t offset, bool keep_alive) const;
  // Whether a streamer pass over `storage` is staged: host bytes that the device cannot read where they are.
  bool stages(const Storage& storage) const;
  WorkerPool& workers();

  std::mutex mu_;
  PoolOptions options_;
  Layout layout_;
  std::vector<std::string> names_;  // in the order given
  std::vector<Run> pieces_;         // layout runs cut for this engine
  std::unique_ptr<WorkerPool> workers_;
  std::unique_ptr<Engine> engine_;
  std::map<int64_t, Slot> slots_;
  std::vector<StoragePtr> free_host_;  // idle host arenas, ready for the next new slot
  std::vector<StoragePtr> retired_;    // out of any slot but still referenced (views, streamers) or busy
  StoragePtr scratch_;                 // swapped(): holds the live weights while a slot is swapped in
  StoragePtr swapped_;                 // the slot storage currently swapped in (null when none)
  StoragePtr staging_[2];              // streamers: device buffers of two steps
  bool streaming_ = false;             // a staged pass holds staging_
  std::vector<TicketPtr> live_reads_;  // pending saves (they read the live tensors)
  std::vector<InFlight> in_flight_;
  std::vector<std::string> failures_;  // failed copies found by collect() and not raised yet
  std::map<std::string, OpStats> ops_;
  std::map<std::string, double> counters_;
};

}  // namespace dppo
