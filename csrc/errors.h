// Exception types of the snapshot engine. bindings.cpp translates each into the Python class of the same
// name in dppo/_errors.py; std::invalid_argument becomes ValueError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dppo {

class SnapshotError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// restore/view/swapped/clear of a slot that holds no snapshot (Python: also a KeyError).
class EmptySlotError : public SnapshotError {
 public:
  using SnapshotError::SnapshotError;
};

// A live tensor changed shape/dtype/device/storage since the pool was built (Python: also a ValueError).
class LayoutMismatchError : public SnapshotError {
 public:
  using SnapshotError::SnapshotError;
};

// max_host_bytes would be exceeded, or allocating/pinning host memory failed (Python: also a MemoryError).
class SnapshotMemoryError : public SnapshotError {
 public:
  using SnapshotError::SnapshotError;
};

// A tensor name that the pool does not hold (Python: also a KeyError).
class UnknownNameError : public SnapshotError {
 public:
  using SnapshotError::SnapshotError;
};

// cat("a", 1, "b") -> "a1b": builds error messages without a format library.
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

}  // namespace dppo
