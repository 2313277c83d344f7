// A handle on copy work issued by an engine: CPU worker tasks or CUDA work bracketed by events.
#pragma once

#include <memory>
#include <vector>

namespace dppo {

class Ticket {
 public:
  virtual ~Ticket() = default;
  // True once the work has finished (or failed). Never blocks, never throws.
  virtual bool ready() = 0;
  // Blocks the host until the work has finished; rethrows a failure of the work.
  virtual void wait() = 0;
  // Duration of the work itself (not of the waits before it), valid once ready().
  virtual double seconds() = 0;
};

using TicketPtr = std::shared_ptr<Ticket>;

// Blocks until the work has finished, failed or not: a failure is someone else's to report. Null: nothing to wait for.
inline void wait_quietly(const TicketPtr& ticket) noexcept {
  try {
    if (ticket) ticket->wait();
  } catch (...) {
  }
}

inline void wait_quietly(const std::vector<TicketPtr>& tickets) noexcept {
  for (const TicketPtr& t : tickets) wait_quietly(t);
}

}  // namespace dppo
