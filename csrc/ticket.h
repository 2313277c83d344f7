// A handle on copy work issued by an engine: CPU worker tasks or CUDA work bracketed by events.
#pragma once

#include <memory>

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

}  // namespace dppo
