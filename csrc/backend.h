// The choice of copy engine, made once per pool by the device of its tensors: the one place outside the engines
// that knows both of them, and the only code that differs between the CUDA build and the CPU-only one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine.h"
#include "layout.h"
#include "worker_pool.h"

namespace dppo {

struct EngineOptions {
  size_t piece_bytes = 0;       // CPU copies are split into pieces of this size
  size_t pin_chunk_bytes = 0;   // host arenas are pinned in chunks of this size; 0: the engine's default
  double copy_delay_s = 0;      // testing aid of the CPU engine (cpu_engine.h)
  int64_t fail_copy_task = -1;  // testing aid of the CPU engine (cpu_engine.h)
};

// The engine for tensors on `device`. `workers` gives the CPU engine its threads; it is called for a CPU device
// only. Throws SnapshotError for CUDA tensors when this build has no CUDA engine.
std::unique_ptr<Engine> make_engine(const at::Device& device, const EngineOptions& options,
                                    const std::function<WorkerPool&()>& workers);

// Which adjacent live bytes of `tensors` one copy may span: any on the host; on a GPU only those of one allocation.
JoinableFn joinable_for(const std::vector<at::Tensor>& tensors);

// Whether this build of the extension compiled the CUDA engine.
bool cuda_compiled();

}  // namespace dppo
