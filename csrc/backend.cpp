#include "backend.h"

#include "cpu_engine.h"
#include "errors.h"
#ifdef DPPO_WITH_CUDA
#include "cuda_engine.h"
#endif

namespace dppo {

namespace {

// Default pinning chunk of CUDA host arenas: registering a large arena in pieces keeps each call short.
constexpr size_t kPinChunkBytes = size_t{1} << 30;

}  // namespace

std::unique_ptr<Engine> make_engine(const at::Device& device, const EngineOptions& options,
                                    const std::function<WorkerPool&()>& workers) {
  if (device.is_cuda()) {
#ifdef DPPO_WITH_CUDA
    const size_t pin_chunk = options.pin_chunk_bytes > 0 ? options.pin_chunk_bytes : kPinChunkBytes;
    return std::make_unique<CudaEngine>(device.index(), pin_chunk);
#else
    throw SnapshotError(
        "the tensors are on CUDA but dppo._C was built without CUDA; rebuild it where nvcc is found "
        "(DPPO_FORCE_CUDA=1 makes a missing toolkit an error)");
#endif
  }
  // CPU arenas are not pinned: pin_chunk_bytes only splits copies there (a testing aid), and 0 means no chunks.
  return std::make_unique<CpuEngine>(workers(), options.piece_bytes, options.copy_delay_s, options.pin_chunk_bytes,
                                     options.fail_copy_task);
}

JoinableFn joinable_for(const std::vector<at::Tensor>& tensors) {
#ifdef DPPO_WITH_CUDA
  if (!tensors.empty() && tensors[0].defined() && tensors[0].is_cuda()) {
    return [](const uint8_t* last, const uint8_t* next) { return same_device_allocation(last, next); };
  }
#endif
  (void)tensors;
  return {};
}

bool cuda_compiled() {
#ifdef DPPO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace dppo
