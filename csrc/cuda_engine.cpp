#include "cuda_engine.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda.h>

#include <algorithm>
#include <string>

#include "errors.h"

namespace dppo {

namespace {

// Upper bound on the copies of one cudaMemcpyBatchAsync call.
constexpr size_t kMaxBatch = 4096;

// For destructors and fallbacks: a failed call is dropped, and so is the error it left behind for the next
// cudaGetLastError() (which torch checks after its own kernel launches).
void quiet(cudaError_t err) noexcept {
  if (err != cudaSuccess) (void)cudaGetLastError();
}

// Makes `device` current until the end of the scope, without throwing (destructors). Switching first means a
// handle is released in its own device's context and never creates a context on whatever device is current.
class QuietDeviceScope {
 public:
  explicit QuietDeviceScope(int device) noexcept {
    int current = -1;
    const cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess) {
      quiet(err);
      return;
    }
    if (current == device) return;
    const cudaError_t set = cudaSetDevice(device);
    if (set == cudaSuccess) {
      previous_ = current;
    } else {
      quiet(set);
    }
  }
  ~QuietDeviceScope() {
    if (previous_ >= 0) quiet(cudaSetDevice(previous_));
  }
  QuietDeviceScope(const QuietDeviceScope&) = delete;
  QuietDeviceScope& operator=(const QuietDeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// Page-locked host arena: mmap'ed, then registered with cudaHostRegister chunk by chunk. If the driver refuses
// a chunk, what was registered is undone and error() says why (the engine then falls back to cudaHostAlloc).
class RegisteredHostArena : public HostArena {
 public:
  RegisteredHostArena(size_t bytes, size_t chunk_bytes, int device) : HostArena(bytes), device_(device) {
    for (size_t off = 0; off < this->bytes(); off += chunk_bytes) {
      const size_t n = std::min(chunk_bytes, this->bytes() - off);
      const cudaError_t err = cudaHostRegister(data() + off, n, cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        quiet(err);
        error_ = err;
        failed_at_ = off;
        unpin();
        return;
      }
      registered_.push_back(data() + off);
    }
  }
  ~RegisteredHostArena() override {
    QuietDeviceScope on(device_);
    unpin();  // before the base class unmaps the memory
  }
  bool pinned() const override { return error_ == cudaSuccess; }
  cudaError_t error() const { return error_; }
  size_t failed_at() const { return failed_at_; }

 private:
  void unpin() noexcept {
    for (uint8_t* p : registered_) quiet(cudaHostUnregister(p));
    registered_.clear();
  }
  int device_;
  std::vector<uint8_t*> registered_;
  cudaError_t error_ = cudaSuccess;
  size_t failed_at_ = 0;
};

// Page-locked host arena from cudaHostAlloc: the fallback where cudaHostRegister is refused.
class AllocatedHostArena : public HostArena {
 public:
  AllocatedHostArena(uint8_t* data, size_t bytes, int device) : HostArena(data, bytes), device_(device) {}
  ~AllocatedHostArena() override {
    QuietDeviceScope on(device_);
    quiet(cudaFreeHost(data()));
  }
  bool pinned() const override { return true; }

 private:
  int device_;
};

}  // namespace

void cuda_check(cudaError_t err, const char* call) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw SnapshotError(cat(call, " failed: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"));
  }
}

bool same_device_allocation(const void* a, const void* b) {
  using GetRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);
  static const GetRange get_range = []() -> GetRange {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuMemGetAddressRange", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      quiet(err);
      return nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return false;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (get_range(&base, &size, reinterpret_cast<CUdeviceptr>(a)) != CUDA_SUCCESS) return false;  // no runtime error
  const auto p = reinterpret_cast<CUdeviceptr>(b);
  return p >= base && p - base < size;
}

CudaEvent::CudaEvent(int device, bool timing) : device_(device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cuda_check(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming),
             "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() {
  if (event_ == nullptr) return;
  QuietDeviceScope on(device_);
  quiet(cudaEventDestroy(event_));  // the driver releases it once its last record has completed
}

CudaStream::CudaStream(int device) : device_(device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
}

CudaStream::~CudaStream() {
  if (stream_ == nullptr) return;
  QuietDeviceScope on(device_);
  quiet(cudaStreamSynchronize(stream_));
  quiet(cudaStreamDestroy(stream_));
}

CudaTicket::CudaTicket(std::shared_ptr<CudaEvent> start, std::shared_ptr<CudaEvent> end)
    : start_(std::move(start)), end_(std::move(end)) {}

bool CudaTicket::ready() {
  const cudaError_t err = cudaEventQuery(end_->get());
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();  // torch's next check must not see it (a sticky error stays all the same)
  // Failed work has finished too: wait() rethrows the failure, and the pool reports it once, as on the CPU.
  return err != cudaErrorNotReady;
}

void CudaTicket::wait() { cuda_check(cudaEventSynchronize(end_->get()), "cudaEventSynchronize"); }

double CudaTicket::seconds() {
  if (!start_) return 0.0;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(end_->device()));
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, start_->get(), end_->get()), "cudaEventElapsedTime");
  return ms / 1e3;
}

CudaEngine::CudaEngine(int device_index, size_t pin_chunk_bytes)
    : device_(device_index), pin_chunk_bytes_(pin_chunk_bytes) {
  save_ = std::make_unique<CudaStream>(device_);
  load_ = std::make_unique<CudaStream>(device_);
  aux_ = std::make_unique<CudaStream>(device_);
}

CudaEngine::~CudaEngine() = default;  // each stream finishes its work before it is destroyed

std::unique_ptr<HostArena> CudaEngine::new_arena(size_t bytes) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  std::string refused;
  if (register_ok_) {
    auto arena = std::make_unique<RegisteredHostArena>(bytes, pin_chunk_bytes_, device_);  // throws if mmap fails
    if (arena->pinned()) return arena;
    refused = cat("cudaHostRegister of ", arena->bytes(), " bytes in chunks of ", pin_chunk_bytes_,
                  " failed at offset ", arena->failed_at(), ": ", cudaGetErrorString(arena->error()));
  }
  const size_t page = page_bytes();
  const size_t rounded = std::max(page, (bytes + page - 1) / page * page);
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, rounded, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    quiet(err);
    throw SnapshotMemoryError(cat("pinning a host arena of ", rounded, " bytes failed (", host_available_note(),
                                  "): ", refused, refused.empty() ? "" : "; then ",
                                  "cudaHostAlloc: ", cudaGetErrorString(err)));
  }
  if (!refused.empty()) {
    // Some platforms (sandboxes, some drivers) refuse registration but allocate pinned memory: use it from now
    // on rather than mapping and faulting in every arena only to be refused again.
    register_ok_ = false;
    TORCH_WARN("dppo.snapshot: ", refused, "; host arenas of this pool are allocated with cudaHostAlloc instead");
  }
  return std::make_unique<AllocatedHostArena>(static_cast<uint8_t*>(p), rounded, device_);
}

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
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;   // saves run beside the forward pass
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
  CudaEvent caller_done(device_, /*timing=*/false);
  cuda_check(cudaEventRecord(caller_done.get(), caller_stream()), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(stream, caller_done.get(), 0), "cudaStreamWaitEvent");
  for (const auto& dep : deps) wait_on(stream, dep);
  auto start = std::make_shared<CudaEvent>(device_, /*timing=*/true);
  auto end = std::make_shared<CudaEvent>(device_, /*timing=*/true);
  try {
    cuda_check(cudaEventRecord(start->get(), stream), "cudaEventRecord");
    issue_ranges(stream, job.ranges);
    if (!job.tasks.empty()) {
      c10::cuda::CUDAStreamGuard on_stream(
          c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device_)));
      for (auto& task : job.tasks) task();  // strided tensor copies, queued by ATen on `stream`
    }
    cuda_check(cudaEventRecord(end->get(), stream), "cudaEventRecord");
  } catch (...) {
    // Part of the job may be queued, and no ticket will track it: let it finish before the caller frees or
    // reuses the memory it touches.
    quiet(cudaStreamSynchronize(stream));
    throw;
  }
  return std::make_shared<CudaTicket>(std::move(start), std::move(end));
}

void CudaEngine::order_after(const std::vector<TicketPtr>& tickets) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t caller = caller_stream();
  for (const auto& t : tickets) wait_on(caller, t);
}

TicketPtr CudaEngine::mark_caller() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  auto marker = std::make_shared<CudaEvent>(device_, /*timing=*/false);
  cuda_check(cudaEventRecord(marker->get(), caller_stream()), "cudaEventRecord");
  return std::make_shared<CudaTicket>(nullptr, std::move(marker));
}

void CudaEngine::read_back(void* dst, const void* src, size_t bytes, bool after_caller) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t aux = aux_->get();  // idle: only the caller's work (if asked) is waited for, not pending copies
  if (after_caller) {
    CudaEvent caller_done(device_, /*timing=*/false);
    cuda_check(cudaEventRecord(caller_done.get(), caller_stream()), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(aux, caller_done.get(), 0), "cudaStreamWaitEvent");
  }
  cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, aux), "cudaMemcpyAsync");
  cuda_check(cudaStreamSynchronize(aux), "cudaStreamSynchronize");
}

}  // namespace dppo
