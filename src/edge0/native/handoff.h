// edge0.Handoff: what a staged decode token in one native call (TokenDecoder.staged_step,
// decode_ops.cpp) shares with the expert pool's Python side while it runs without the GIL.
//
// - A state per pool slot (0 arriving, 1 loaded, -1 its read failed), set by the pool's I/O
//   threads through `set_slot` (store/pool.py's slot hook), which the call waits on before it
//   computes with a slot's experts. A store with release order and a load with acquire order:
//   what the reader wrote into the slot is seen by the call that sees it loaded.
// - Messages from the call to a Python thread (engine/backends/native_staged.py), which does
//   what the per-layer path does at those points with the pool: request a head's chosen
//   experts for the next token (kStage), pin and read the experts a layer routed to now and
//   answer with their slots (kNeed), unpin a layer's experts after it ran (kRelease), and say
//   when it has done every one of a token's (kEnd). The thread takes them in order, so the
//   pool sees the per-layer path's sequence of requests and releases. The call waits for
//   every one but a release: a stage not waited for started its reads later, when the thread
//   next got a core from the two that compute (docs/kernels.md).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace edge0 {

class Handoff : public torch::CustomClassHolder {
 public:
  // A message: [kind, layer, reserve, experts...]
  enum Kind : int64_t { kStage = 0, kNeed = 1, kRelease = 2, kEnd = 3, kStop = 4 };

  explicit Handoff(int64_t slots) : slots_(slots), state_(new std::atomic<int64_t>[slots]) {
    TORCH_CHECK(slots >= 1, "a pool has at least one slot");
    for (int64_t i = 0; i < slots; ++i) state_[i].store(0);
  }

  int64_t slots() const { return slots_; }

  // The pool's side: slot `slot` is arriving (0), loaded (1) or failed (-1).
  void set_slot(int64_t slot, int64_t state) {
    TORCH_CHECK(slot >= 0 && slot < slots_, "slot ", slot, " of ", slots_);
    state_[slot].store(state, std::memory_order_release);
    const std::lock_guard<std::mutex> lock(ready_mutex_);
    ready_.notify_all();
  }

  int64_t slot_state(int64_t slot) const {
    TORCH_CHECK(slot >= 0 && slot < slots_, "slot ", slot, " of ", slots_);
    return state_[slot].load(std::memory_order_acquire);
  }

  // The call's side: blocks until every slot is loaded; the nanoseconds it waited. A failed
  // read raises (the Python side then raises the read's own error).
  int64_t wait_loaded(const std::vector<int64_t>& slots) {
    auto seen = [&] {
      int64_t all = 1;
      for (int64_t s : slots) {
        const int64_t v = slot_state(s);
        if (v < 0) return int64_t{-1};
        if (v == 0) all = 0;
      }
      return all;
    };
    int64_t state = seen();
    if (state == 1) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    if (state == 0) {
      std::unique_lock<std::mutex> lock(ready_mutex_);
      ready_.wait(lock, [&] { return (state = seen()) != 0; });
    }
    TORCH_CHECK(state > 0, "edge0: an expert's read failed");
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now() - t0)
        .count();
  }

  // The call's side: a message for the Python thread, not waited on. A release does not wake
  // the thread (each wake takes a core from the call for a while): it is taken with the next
  // message that does, a head's stage or a layer's need in the next layer, or the token's end.
  void post(int64_t kind, int64_t layer, int64_t reserve, const int64_t* experts, int64_t n) {
    std::vector<int64_t> message = {kind, layer, reserve};
    message.insert(message.end(), experts, experts + n);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      messages_.push_back(std::move(message));
    }
    if (kind != kRelease) posted_.notify_one();
  }

  // The call's side: a message whose answer it waits for (kNeed: the experts' slots, in their
  // order; kStage and kEnd: none, once done). Raises with the Python side's reason where it
  // refused.
  std::vector<int64_t> ask(int64_t kind, int64_t layer, int64_t reserve, const int64_t* experts,
                           int64_t n) {
    post(kind, layer, reserve, experts, n);
    std::unique_lock<std::mutex> lock(mutex_);
    answered_.wait(lock, [&] { return answer_.has_value(); });
    std::vector<int64_t> answer = std::move(*answer_);
    answer_.reset();
    const std::string refused = std::move(refused_);
    refused_.clear();
    TORCH_CHECK(refused.empty(), refused);
    return answer;
  }

  // The Python thread's side: every message posted since it last asked, in order, once one
  // that wakes it is there (blocks; called without the GIL).
  std::vector<std::vector<int64_t>> next() {
    std::unique_lock<std::mutex> lock(mutex_);
    posted_.wait(lock, [&] {
      for (const auto& m : messages_)
        if (m[0] != kRelease) return true;
      return false;
    });
    std::vector<std::vector<int64_t>> out(std::make_move_iterator(messages_.begin()),
                                          std::make_move_iterator(messages_.end()));
    messages_.clear();
    return out;
  }

  // The Python thread's side: the answer to the message the call waits on, or its refusal.
  void answer(std::vector<int64_t> values) { give(std::move(values), ""); }
  void refuse(std::string why) { give({}, why.empty() ? std::string("refused") : why); }

  // Ends the Python thread's loop (it takes kStop and returns).
  void stop() {
    const int64_t none = 0;
    post(kStop, -1, 0, &none, 0);
  }

 private:
  void give(std::vector<int64_t> values, std::string why) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      answer_ = std::move(values);
      refused_ = std::move(why);
    }
    answered_.notify_all();
  }

  int64_t slots_;
  std::unique_ptr<std::atomic<int64_t>[]> state_;
  std::mutex ready_mutex_;
  std::condition_variable ready_;
  std::mutex mutex_;
  std::condition_variable posted_, answered_;
  std::deque<std::vector<int64_t>> messages_;
  std::optional<std::vector<int64_t>> answer_;
  std::string refused_;
};

}  // namespace edge0
