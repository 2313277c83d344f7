// The layout of one snapshot: which live tensors it holds and where each lives in a slot's storage.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dppo {

// Slot offsets of tensors are congruent to their live address modulo this (so runs of tensors that are
// adjacent in live memory stay adjacent in the slot and copy as one range).
constexpr size_t kAlignBytes = 256;

struct Entry {
  std::vector<std::string> names;  // tied names share one entry; names[0] is the first one given
  at::Tensor live;                 // the live tensor itself (same TensorImpl as the parameter)
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype;
  at::Device device;
  const void* data_ptr;  // live address recorded at construction
  size_t nbytes;         // numel * itemsize
  size_t offset;         // byte offset in a slot, tensor stored contiguously (row-major)
  bool contiguous;       // copied as raw bytes (else through a strided tensor copy)
};

// Bytes that are adjacent both in live memory and in a slot: copied as one range.
struct Run {
  const uint8_t* live;
  size_t offset;
  size_t bytes;
};

// Whether the bytes just before `next` and the bytes at `next` belong to one allocation of the live tensors'
// device, so that one copy may span both (CUDA: one cudaMalloc; a copy must not span two).
using JoinableFn = std::function<bool(const uint8_t* last, const uint8_t* next)>;

class Layout {
 public:
  // Throws std::invalid_argument (bad input) or LayoutMismatchError (tensors on two devices). Tensors adjacent
  // in live memory share a run when `joinable` allows it (empty: always, as for host memory).
  Layout(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
         const JoinableFn& joinable = {});

  const std::vector<Entry>& entries() const { return entries_; }
  const std::vector<Run>& runs() const { return runs_; }
  const std::vector<size_t>& strided() const { return strided_; }  // entry indices
  at::Device device() const { return device_; }
  size_t nbytes() const { return nbytes_; }                // the tensors' own bytes
  size_t storage_bytes() const { return storage_bytes_; }  // bytes of one slot, padding included
  // Entry index of a name (tied names give the same index). Throws UnknownNameError.
  size_t find(const std::string& name) const;

  // Throws LayoutMismatchError naming the first live tensor whose shape, strides, dtype, device or
  // address changed since construction.
  void check_live(const char* op) const;
  // Bumps the autograd version counter of every live tensor that has one (a restore writes them in place).
  // Never throws: the pool calls it before the copies that write the live tensors.
  void bump_versions() const;

  // Runs cut so that no piece crosses a multiple of `split` bytes of slot offset (0: none) or exceeds
  // `piece` bytes (0: no limit).
  std::vector<Run> pieces(size_t piece, size_t split) const;

 private:
  std::vector<Entry> entries_;
  std::vector<Run> runs_;
  std::vector<size_t> strided_;
  std::unordered_map<std::string, size_t> index_;
  at::Device device_{at::kCPU};
  size_t nbytes_ = 0;
  size_t storage_bytes_ = 0;
};

// Round `x` up to the next value congruent to `residue` modulo kAlignBytes.
size_t align_congruent(size_t x, size_t residue);

}  // namespace dppo
