#include "cuda_engine.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "errors.h"

namespace dppo {

namespace {

// Large arenas are pinned in chunks of this size; copies never cross a chunk boundary, so every copy
// stays inside one registered range.
constexpr size_t kPinChunkBytes = size_t{1} << 30;
// Upper bound on the copies of one cudaMemcpyBatchAsync call.
constexpr size_t kMaxBatch = 4096;

// Page-locked host arena: mmap'ed, then registered with cudaHostRegister chunk by chunk.
class PinnedHostArena : public HostArena {
 public:
  explicit PinnedHostArena(size_t bytes) : HostArena(bytes) {
    for (size_t off = 0; off < this->bytes(); off += kPinChunkBytes) {
      const size_t n = std::min(kPinChunkBytes, this->bytes() - off);
      const cudaError_t err = cudaHostRegister(data() + off, n, cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // do not leave the error for the next, unrelated CUDA call
        unpin();
        throw SnapshotMemoryError(cat("pinning a host arena of ", this->bytes(), " bytes failed at offset ", off,
                                      ": cudaHostRegister: ", cudaGetErrorString(err)));
      }
      registered_.push_back(data() + off);
    }
  }
  ~PinnedHostArena() override { unpin(); }
  bool pinned() const override { return true; }

 private:
  void unpin() noexcept {
    for (uint8_t* p : registered_) (void)cudaHostUnregister(p);
    registered_.clear();
  }
  std::vector<uint8_t*> registered_;
};

}  // namespace

void cuda_check(cudaError_t err, const char* call) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw SnapshotError(cat(call, " failed: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"));
  }
}

CudaEvent::CudaEvent(bool timing) {
  cuda_check(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming),
             "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);  // released by the driver once it has completed
}

CudaStream::CudaStream() { cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }

CudaStream::~CudaStream() {
  if (stream_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
}

CudaTicket::CudaTicket(std::shared_ptr<CudaEvent> start, std::shared_ptr<CudaEvent> end)
    : start_(std::move(start)), end_(std::move(end)) {}

bool CudaTicket::ready() {
  const cudaError_t err = cudaEventQuery(end_->get());
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  cuda_check(err, "cudaEventQuery");
  return true;
}

void CudaTicket::wait() { cuda_check(cudaEventSynchronize(end_->get()), "cudaEventSynchronize"); }

double CudaTicket::seconds() {
  if (!start_) return 0.0;
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, start_->get(), end_->get()), "cudaEventElapsedTime");
  return ms / 1e3;
}

CudaEngine::CudaEngine(int device_index) : device_(device_index) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  save_ = std::make_unique<CudaStream>();
  load_ = std::make_unique<CudaStream>();
}

CudaEngine::~CudaEngine() {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    save_.reset();  // each stream synchronizes before it is destroyed
    load_.reset();
  } catch (...) {
  }
}

std::unique_ptr<HostArena> CudaEngine::new_arena(size_t bytes) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  return std::make_unique<PinnedHostArena>(bytes);
}

size_t CudaEngine::arena_split_bytes() const { return kPinChunkBytes; }

cudaStream_t CudaEngine::caller_stream() const {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
}

void CudaEngine::wait_on(cudaStream_t stream, const TicketPtr& ticket) {
  if (!ticket) return;
  auto* cuda_ticket = dynamic_cast<CudaTicket*>(ticket.get());
  if (cuda_ticket == nullptr) {
    ticket->wait();  // not stream work: the host waits
    return;
  }
  cuda_check(cudaStreamWaitEvent(stream, cuda_ticket->event(), 0), "cudaStreamWaitEvent");
}

void CudaEngine::issue_ranges(cudaStream_t stream, const std::vector<Range>& ranges) {
  size_t first = 0;
#if CUDART_VERSION >= 12080
  if (ranges.size() > 1 && batch_ok_) {
    for (; first < ranges.size(); first += kMaxBatch) {
      const size_t n = std::min(kMaxBatch, ranges.size() - first);
      std::vector<void*> dsts(n), srcs(n);
      std::vector<size_t> sizes(n);
      for (size_t i = 0; i < n; ++i) {
        dsts[i] = ranges[first + i].dst;
        srcs[i] = const_cast<void*>(ranges[first + i].src);
        sizes[i] = ranges[first + i].bytes;
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources are read in stream order
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;    // saves run beside the forward pass
      size_t attr_index = 0;
#if CUDART_VERSION >= 13000
      const cudaError_t err =
          cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_index, 1, stream);
#else
      size_t fail_index = 0;
      const cudaError_t err =
          cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_index, 1, &fail_index, stream);
#endif
      if (err == cudaErrorNotSupported || err == cudaErrorInvalidValue || err == cudaErrorCallRequiresNewerDriver) {
        (void)cudaGetLastError();
        batch_ok_ = false;  // this driver refuses batches: copy one range at a time from here on
        break;
      }
      cuda_check(err, "cudaMemcpyBatchAsync");
    }
  }
#endif
  for (; first < ranges.size(); ++first) {
    const Range& r = ranges[first];
    cuda_check(cudaMemcpyAsync(r.dst, r.src, r.bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }
}

TicketPtr CudaEngine::copy(Direction dir, CopyJob job, const std::vector<TicketPtr>& deps) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t stream = dir == Direction::kSave ? save_->get() : load_->get();
  CudaEvent caller_done(/*timing=*/false);
  cuda_check(cudaEventRecord(caller_done.get(), caller_stream()), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(stream, caller_done.get(), 0), "cudaStreamWaitEvent");
  for (const auto& dep : deps) wait_on(stream, dep);
  auto start = std::make_shared<CudaEvent>(/*timing=*/true);
  auto end = std::make_shared<CudaEvent>(/*timing=*/true);
  cuda_check(cudaEventRecord(start->get(), stream), "cudaEventRecord");
  issue_ranges(stream, job.ranges);
  if (!job.tasks.empty()) {
    c10::cuda::CUDAStreamGuard on_stream(c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device_)));
    for (auto& task : job.tasks) task();  // strided tensor copies, queued by ATen on `stream`
  }
  cuda_check(cudaEventRecord(end->get(), stream), "cudaEventRecord");
  return std::make_shared<CudaTicket>(std::move(start), std::move(end));
}

void CudaEngine::order_after(const std::vector<TicketPtr>& tickets) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t caller = caller_stream();
  for (const auto& t : tickets) wait_on(caller, t);
}

TicketPtr CudaEngine::mark_caller() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  auto marker = std::make_shared<CudaEvent>(/*timing=*/false);
  cuda_check(cudaEventRecord(marker->get(), caller_stream()), "cudaEventRecord");
  return std::make_shared<CudaTicket>(nullptr, std::move(marker));
}

}  // namespace dppo
