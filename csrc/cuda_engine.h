// The CUDA path: saves on a dedicated device-to-host stream, loads on a dedicated host-to-device stream,
// ordered against the caller's current stream with events (no host blocking), copies batched with
// cudaMemcpyBatchAsync where the runtime has it. Compiled only in the CUDA build (DPPO_WITH_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "engine.h"

namespace dppo {

// Throws SnapshotError("<call> failed: <cudaGetErrorString>") unless err is cudaSuccess.
void cuda_check(cudaError_t err, const char* call);

// Whether device bytes at `a` and `b` lie in one allocation (cuMemGetAddressRange). Tensors from torch's
// caching allocator that are adjacent in memory may come from two cudaMallocs, and one copy must not span
// two allocations. False when the driver cannot say, so that the copies are split.
bool same_device_allocation(const void* a, const void* b);

// RAII wrappers. Each remembers its device: destroying it (or querying it) makes that device current first,
// so that no CUDA context is ever created on another device as a side effect, and never throws.
class CudaEvent {
 public:
  CudaEvent(int device, bool timing);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

class CudaStream {
 public:
  explicit CudaStream(int device);  // a non-blocking stream on `device`
  ~CudaStream();                    // waits for the stream's work, then destroys it
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

class CudaTicket : public Ticket {
 public:
  // `start` may be null (a marker on a stream: seconds() is 0).
  CudaTicket(std::shared_ptr<CudaEvent> start, std::shared_ptr<CudaEvent> end);
  bool ready() override;
  void wait() override;
  double seconds() override;
  cudaEvent_t event() const { return end_->get(); }

 private:
  std::shared_ptr<CudaEvent> start_;
  std::shared_ptr<CudaEvent> end_;
};

class CudaEngine : public Engine {
 public:
  // pin_chunk_bytes: host arenas are registered (pinned) in chunks of this many bytes, a multiple of the
  // page size; no copy crosses a chunk boundary.
  CudaEngine(int device_index, size_t pin_chunk_bytes);
  ~CudaEngine() override;

  bool separate_device_memory() const override { return true; }
  bool orders_on_host() const override { return false; }  // streams wait on events; the host does not
  std::unique_ptr<HostArena> new_arena(size_t bytes) override;
  size_t arena_split_bytes() const override { return pin_chunk_bytes_; }
  size_t piece_bytes() const override { return 0; }
  bool overlaps_directions() const override { return true; }
  TicketPtr copy(Direction dir, CopyJob job, const std::vector<TicketPtr>& deps) override;
  void order_after(const std::vector<TicketPtr>& tickets) override;
  TicketPtr mark_caller() override;
  void read_back(void* dst, const void* src, size_t bytes, bool after_caller) override;

 private:
  cudaStream_t caller_stream() const;
  void wait_on(cudaStream_t stream, const TicketPtr& ticket);
  void issue_ranges(cudaStream_t stream, const std::vector<Range>& ranges);

  int device_;
  size_t pin_chunk_bytes_;
  std::unique_ptr<CudaStream> save_;
  std::unique_ptr<CudaStream> load_;
  std::unique_ptr<CudaStream> aux_;  // read_back(): waits for neither copy queue
  bool batch_ok_ = true;             // cleared if the driver refuses cudaMemcpyBatchAsync
  bool register_ok_ = true;          // cleared if cudaHostRegister is refused where cudaHostAlloc works
};

}  // namespace dppo
