#include "layout.h"

#include <ATen/MemoryOverlap.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "errors.h"

namespace dppo {

size_t align_congruent(size_t x, size_t residue) {
  residue %= kAlignBytes;
  const size_t base = x - x % kAlignBytes + residue;
  return base >= x ? base : base + kAlignBytes;
}

namespace {

std::string shape_str(at::IntArrayRef v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

void check_supported(const std::string& name, const at::Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(cat("tensor '", name, "' is undefined"));
  if (t.layout() != at::kStrided) {
    throw std::invalid_argument(
        cat("tensor '", name, "' has layout ", t.layout(), "; only strided tensors can be snapshot"));
  }
  if (!t.device().is_cpu() && !t.device().is_cuda()) {
    throw std::invalid_argument(cat("tensor '", name, "' is on ", t.device(), "; expected cpu or cuda"));
  }
  if (t.is_conj() || t.is_neg()) {
    const bool conj = t.is_conj();
    throw std::invalid_argument(cat("tensor '", name, "' has its ", conj ? "conjugate" : "negative",
                                    " bit set (a lazy ", conj ? "conj()" : "negation",
                                    " view): a slot holds its bytes without the bit, so views of the slot would differ "
                                    "from it; resolve it first with t.",
                                    conj ? "resolve_conj()" : "resolve_neg()"));
  }
  if (t.numel() > 0 && at::has_internal_overlap(t) == at::MemOverlap::Yes) {
    throw std::invalid_argument(cat("tensor '", name, "' has elements that share memory (strides ",
                                    shape_str(t.strides()), "); it cannot be restored in place"));
  }
}

}  // namespace

Layout::Layout(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
               const JoinableFn& joinable) {
  if (names.size() != tensors.size()) {
    throw std::invalid_argument(cat("got ", names.size(), " names for ", tensors.size(), " tensors"));
  }
  if (tensors.empty()) throw std::invalid_argument("nothing to snapshot: no tensors given");
  device_ = tensors[0].device();
  // Tied tensors (same storage, offset, shape, strides and dtype) are stored once under all their names.
  using Key = std::tuple<const void*, int64_t, std::vector<int64_t>, std::vector<int64_t>, int>;
  std::map<Key, size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_supported(names[i], t);
    if (index_.count(names[i])) throw std::invalid_argument(cat("tensor name '", names[i], "' appears twice"));
    if (t.device() != device_) {
      throw LayoutMismatchError(cat("all tensors of a pool must be on one device: '", names[0], "' is on ", device_,
                                    " but '", names[i], "' is on ", t.device()));
    }
    Key key{t.storage().data(), t.storage_offset(), t.sizes().vec(), t.strides().vec(),
            static_cast<int>(t.scalar_type())};
    auto it = seen.find(key);
    if (it != seen.end()) {
      entries_[it->second].names.push_back(names[i]);
      index_[names[i]] = it->second;
      continue;
    }
    Entry e{{names[i]},
            t,
            t.sizes().vec(),
            t.strides().vec(),
            t.scalar_type(),
            t.device(),
            t.data_ptr(),
            static_cast<size_t>(t.numel()) * t.element_size(),
            0,
            t.is_contiguous()};
    seen.emplace(std::move(key), entries_.size());
    index_[names[i]] = entries_.size();
    nbytes_ += e.nbytes;
    entries_.push_back(std::move(e));
  }

  // Offsets in live-address order, so that tensors adjacent in live memory form one run.
  std::vector<size_t> order(entries_.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return std::less<const void*>()(entries_[a].data_ptr, entries_[b].data_ptr); });
  size_t cursor = 0;
  for (size_t idx : order) {
    Entry& e = entries_[idx];
    const auto live = reinterpret_cast<uintptr_t>(e.data_ptr);
    if (e.nbytes == 0) {
      e.offset = align_congruent(cursor, 0);
      continue;
    }
    if (!e.contiguous) {
      e.offset = align_congruent(cursor, 0);
      cursor = e.offset + e.nbytes;
      strided_.push_back(idx);
      continue;
    }
    const auto* ptr = static_cast<const uint8_t*>(e.data_ptr);
    if (!runs_.empty() && runs_.back().live + runs_.back().bytes == ptr &&
        runs_.back().offset + runs_.back().bytes == cursor && (!joinable || joinable(ptr - 1, ptr))) {
      e.offset = cursor;
      runs_.back().bytes += e.nbytes;
    } else {
      e.offset = align_congruent(cursor, live % kAlignBytes);
      runs_.push_back({ptr, e.offset, e.nbytes});
    }
    cursor = e.offset + e.nbytes;
  }
  storage_bytes_ = std::max<size_t>(cursor, 1);
}

size_t Layout::find(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw UnknownNameError(cat("no tensor named '", name, "' in this pool"));
  return it->second;
}

void Layout::check_live(const char* op) const {
  for (const Entry& e : entries_) {
    const at::Tensor& t = e.live;
    const char* what = nullptr;
    std::string was, now;
    if (t.sizes() != at::IntArrayRef(e.sizes)) {
      what = "shape", was = shape_str(e.sizes), now = shape_str(t.sizes());
    } else if (t.strides() != at::IntArrayRef(e.strides)) {
      what = "strides", was = shape_str(e.strides), now = shape_str(t.strides());
    } else if (t.scalar_type() != e.dtype) {
      what = "dtype", was = c10::toString(e.dtype), now = c10::toString(t.scalar_type());
    } else if (t.device() != e.device) {
      what = "device", was = e.device.str(), now = t.device().str();
    } else if (t.data_ptr() != e.data_ptr) {
      what = "storage", was = cat(e.data_ptr), now = cat(t.data_ptr());
    }
    if (what != nullptr) {
      throw LayoutMismatchError(cat(op, ": live tensor '", e.names[0], "' changed ", what,
                                    " since the pool was built: was ", was, ", now ", now,
                                    "; build a new SnapshotPool for the new layout"));
    }
  }
}

void Layout::bump_versions() const {
  for (const Entry& e : entries_) {
    // Inference tensors (made under torch.inference_mode()) have no version counter: autograd never sees them.
    if (e.nbytes > 0 && !e.live.is_inference()) torch::autograd::impl::bump_version(e.live);
  }
}

std::vector<Run> Layout::pieces(size_t piece, size_t split) const {
  std::vector<Run> out;
  for (const Run& r : runs_) {
    size_t done = 0;
    while (done < r.bytes) {
      size_t n = r.bytes - done;
      if (piece > 0) n = std::min(n, piece);
      if (split > 0) n = std::min(n, split - (r.offset + done) % split);
      out.push_back({r.live + done, r.offset + done, n});
      done += n;
    }
  }
  return out;
}

}  // namespace dppo
