// The memory of one slot (or of the swap scratch, or of a streaming buffer): a host arena or a device
// buffer, plus the hazards on it: the copy writing it and the copies reading it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "host_arena.h"
#include "ticket.h"

namespace dppo {

struct Storage {
  std::unique_ptr<HostArena> host;  // host tier
  at::Tensor device;                // device tier: a uint8 buffer from torch's allocator
  size_t bytes = 0;

  TicketPtr write;                   // the last copy into it; readers wait for it
  std::vector<TicketPtr> reads;      // copies reading it; the next writer waits for them
  std::optional<uint64_t> checksum;  // of the last completed save (checksum=True)
  bool checksum_due = false;         // a save was issued; its checksum is taken once it completes

  bool on_device() const { return host == nullptr; }
  uint8_t* data() const { return host ? host->data() : static_cast<uint8_t*>(device.data_ptr()); }
  size_t held_bytes() const { return host ? host->bytes() : bytes; }

  std::vector<TicketPtr> pending() const {
    std::vector<TicketPtr> out(reads);
    if (write) out.push_back(write);
    return out;
  }
  // Forgets reads that have finished.
  void prune_reads() {
    reads.erase(std::remove_if(reads.begin(), reads.end(), [](const TicketPtr& t) { return t->ready(); }), reads.end());
  }
  bool idle() {
    prune_reads();
    return reads.empty() && (!write || write->ready());
  }
};

using StoragePtr = std::shared_ptr<Storage>;

}  // namespace dppo
