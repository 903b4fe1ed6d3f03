// The `threads` communicator backend: N ranks as threads of one process.
//
// A shared World holds, per rank, the shifts it has posted but not yet matched
// with its neighbour. Shift #k of rank r sends to r+1 and receives from r-1;
// rank r's k-th send matches rank (r+1)'s k-th receive (every rank posts the
// same sequence of shifts, so sequence numbers match like MPI's
// non-overtaking rule). Once both sides of a transfer are posted, a copy job
// goes to the RECEIVING rank's delivery thread, which does the memcpy while
// both ranks keep computing — so the transfer overlaps compute as it would on
// a network. Shifts therefore complete in the order started.
//
// Link model (CommOptions::link): at the match, the message is scheduled on
// the sender's outgoing LinkClock; the delivery thread copies at once, then
// holds the completion back until the modelled arrival, sleeping on the
// world's condition variable (so an abort or the end of the world wakes it).
// The ranks meanwhile compute: an emulated slow network that overlaps like a
// real one with its own transfer engine.
//
// Failure: Abort() marks the world failed, drops copy jobs not yet started and
// waits for the (bounded) copies in progress, so that once Abort returns no
// thread touches any rank's buffers again — a rank may then unwind and free
// them. Every blocking call wakes up and throws "rank R failed: <reason>".
// A peer that returned from its function without posting what a rank waits
// for fails that wait at once; a peer that is merely slow fails it after
// CommOptions::timeout_s. Such a rank-detected failure (timeout, vanished
// peer, mismatched sizes) aborts the world in the detecting rank's name: it
// throws the plain reason ("rank 1: timed out after ..."), its peers throw
// "rank 1 failed: <reason>".
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "src/comm/comm_util.h"

namespace ringsplash {

namespace {

using comm_internal::Clock;
using comm_internal::DeadlineAfter;
using comm_internal::FormatSeconds;
using comm_internal::LinkClock;
using comm_internal::PeerFailedMessage;
using Handle = Communicator::Handle;

constexpr uint8_t kSendDone = 1;
constexpr uint8_t kRecvDone = 2;

class World {
 public:
  World(int num_ranks, const CommOptions& options, const LinkModel& link)
      : options_(options), link_(link), ranks_(static_cast<size_t>(num_ranks)) {
    copiers_.reserve(ranks_.size());
    for (int r = 0; r < num_ranks; ++r) copiers_.emplace_back([this, r] { DeliveryLoop(r); });
  }

  ~World() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : copiers_) t.join();
  }

  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }

  Handle StartShift(int rank, const void* send, void* recv, size_t bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) ThrowFailure(lock);
    RankState& me = ranks_[rank];
    const int64_t seq = me.shifts_started++;
    me.done[seq] = 0;
    const int next = (rank + 1) % size();
    const int prev = (rank + size() - 1) % size();
    // Our send pairs with next's receive #seq, our receive with prev's send #seq.
    if (auto it = ranks_[next].unmatched_recvs.find(seq);
        it != ranks_[next].unmatched_recvs.end()) {
      const Post post = it->second;
      ranks_[next].unmatched_recvs.erase(it);
      Match(lock, seq, rank, next, send, bytes, post.recv, post.bytes);
    } else {
      me.unmatched_sends[seq] = Post{send, nullptr, bytes};
    }
    if (auto it = ranks_[prev].unmatched_sends.find(seq);
        it != ranks_[prev].unmatched_sends.end()) {
      const Post post = it->second;
      ranks_[prev].unmatched_sends.erase(it);
      Match(lock, seq, prev, rank, post.send, post.bytes, recv, bytes);
    } else {
      me.unmatched_recvs[seq] = Post{nullptr, recv, bytes};
    }
    cv_.notify_all();
    return seq;
  }

  void Wait(int rank, Handle handle) {
    std::unique_lock<std::mutex> lock(mu_);
    RankState& me = ranks_[rank];
    if (handle < 0 || handle >= me.shifts_started) {
      Fail("Wait: rank ", rank, " has no shift #", handle, " (", me.shifts_started, " started)");
    }
    const int next = (rank + 1) % size();
    const int prev = (rank + size() - 1) % size();
    const Clock::time_point deadline = DeadlineAfter(options_.timeout_s);
    for (;;) {
      if (aborted_) ThrowFailure(lock);
      auto it = me.done.find(handle);
      if (it == me.done.end()) Fail("Wait: rank ", rank, " already waited for shift #", handle);
      const uint8_t bits = it->second;
      if (bits == (kSendDone | kRecvDone)) {
        me.done.erase(it);
        return;
      }
      // Who we are waiting for: the sender (prev) until our receive is done,
      // then the receiver (next).
      const int peer = (bits & kRecvDone) ? next : prev;
      const RankState& p = ranks_[peer];
      if (p.finished && p.shifts_started <= handle) {
        AbortAndThrow(lock, rank,
                      "rank " + std::to_string(rank) + ": rank " + std::to_string(peer) +
                          " returned without posting shift #" + std::to_string(handle));
      }
      if (Clock::now() >= deadline) {
        AbortAndThrow(lock, rank,
                      "rank " + std::to_string(rank) + ": timed out after " +
                          FormatSeconds(options_.timeout_s) + " waiting for rank " +
                          std::to_string(peer) + " in shift #" + std::to_string(handle));
      }
      cv_.wait_until(lock, deadline);
    }
  }

  // Element-wise sum over ranks, added in rank order so every rank gets the
  // same bits on every run. count == 0 is a barrier.
  void AllReduce(int rank, float* data, size_t count, const char* what) {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) ThrowFailure(lock);
    const int64_t seq = ranks_[rank].collectives_started++;
    auto [it, inserted] = collectives_.try_emplace(seq);
    Collective& col = it->second;
    if (inserted) {
      col.count = count;
      col.contrib.resize(ranks_.size());
      col.arrived.assign(ranks_.size(), false);
    }
    if (col.count != count) {
      AbortAndThrow(lock, rank,
                    "rank " + std::to_string(rank) + ": " + what + " #" + std::to_string(seq) +
                        " with " + std::to_string(count) + " floats, but another rank passed " +
                        std::to_string(col.count));
    }
    col.contrib[rank].assign(data, data + count);
    col.arrived[rank] = true;
    ++col.num_arrived;
    cv_.notify_all();
    const Clock::time_point deadline = DeadlineAfter(options_.timeout_s);
    while (col.num_arrived < size()) {
      if (aborted_) ThrowFailure(lock);
      std::string missing;
      for (int q = 0; q < size(); ++q) {
        if (col.arrived[q]) continue;
        if (ranks_[q].finished) {
          AbortAndThrow(lock, rank,
                        "rank " + std::to_string(rank) + ": rank " + std::to_string(q) +
                            " returned without joining " + what + " #" + std::to_string(seq));
        }
        missing += (missing.empty() ? "" : ", ") + std::to_string(q);
      }
      if (Clock::now() >= deadline) {
        AbortAndThrow(lock, rank,
                      "rank " + std::to_string(rank) + ": timed out after " +
                          FormatSeconds(options_.timeout_s) + " waiting for rank(s) " + missing +
                          " in " + what + " #" + std::to_string(seq));
      }
      cv_.wait_until(lock, deadline);
    }
    for (size_t i = 0; i < count; ++i) {
      float sum = col.contrib[0][i];
      for (size_t q = 1; q < ranks_.size(); ++q) sum += col.contrib[q][i];
      data[i] = sum;
    }
    if (++col.num_left == size()) collectives_.erase(it);
  }

  void Abort(int rank, const std::string& reason) noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    AbortLocked(lock, rank, reason);
  }

  void Finish(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    ranks_[rank].finished = true;
    cv_.notify_all();
  }

  // The first failure, if any.
  bool Failure(int* rank, std::string* reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) return false;
    *rank = failed_rank_;
    *reason = reason_;
    return true;
  }

 private:
  struct Post {
    const void* send = nullptr;
    void* recv = nullptr;
    size_t bytes = 0;
  };
  struct CopyJob {
    int64_t seq;
    int from, to;
    const void* src;
    void* dst;
    size_t bytes;
    bool delayed;               // by the link model: complete no earlier than `arrival`
    Clock::time_point arrival;  // modelled arrival (when delayed)
  };
  struct RankState {
    int64_t shifts_started = 0;
    int64_t collectives_started = 0;
    std::map<int64_t, Post> unmatched_sends;    // to rank+1, receive not posted yet
    std::map<int64_t, Post> unmatched_recvs;    // from rank-1, send not posted yet
    std::unordered_map<int64_t, uint8_t> done;  // started, not yet waited: kSendDone|kRecvDone
    std::deque<CopyJob> jobs;                   // copies INTO this rank, in order
    LinkClock out_link;                         // the link to rank+1 (link model)
    bool finished = false;                      // its function returned or threw
  };
  struct Collective {
    size_t count = 0;
    std::vector<std::vector<float>> contrib;
    std::vector<bool> arrived;
    int num_arrived = 0;
    int num_left = 0;
  };

  void Match(std::unique_lock<std::mutex>& lock, int64_t seq, int from, int to, const void* src,
             size_t src_bytes, void* dst, size_t dst_bytes) {
    if (src_bytes != dst_bytes) {
      AbortAndThrow(lock, to,
                    "shift #" + std::to_string(seq) + ": rank " + std::to_string(from) + " sends " +
                        std::to_string(src_bytes) + " bytes but rank " + std::to_string(to) +
                        " expects " + std::to_string(dst_bytes));
    }
    // Both sides are posted now: the message may start (a ring of one sends
    // to itself, over no link).
    const bool delayed = link_.active() && from != to;
    const Clock::time_point arrival =
        delayed ? ranks_[from].out_link.Schedule(link_, Clock::now(), src_bytes) : Clock::now();
    ranks_[to].jobs.push_back(CopyJob{seq, from, to, src, dst, src_bytes, delayed, arrival});
  }

  // One per rank: copies arriving data into that rank's receive buffers.
  void DeliveryLoop(int rank) {
    std::unique_lock<std::mutex> lock(mu_);
    std::deque<CopyJob>& jobs = ranks_[rank].jobs;
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !jobs.empty(); });
      if (stopping_) return;
      const CopyJob job = jobs.front();
      jobs.pop_front();
      if (aborted_) continue;  // never touch buffers of a failed world
      ++copies_in_progress_;
      lock.unlock();
      if (job.bytes > 0) std::memcpy(job.dst, job.src, job.bytes);
      lock.lock();
      --copies_in_progress_;
      if (job.delayed) {
        // The data is in place; the shift completes at its modelled arrival.
        // Jobs of this queue arrive in order (one link, one message at a time).
        cv_.wait_until(lock, job.arrival, [&] { return stopping_ || aborted_; });
        if (stopping_) return;
        if (aborted_) continue;
      }
      ranks_[job.from].done[job.seq] |= kSendDone;
      ranks_[job.to].done[job.seq] |= kRecvDone;
      cv_.notify_all();
    }
  }

  void AbortLocked(std::unique_lock<std::mutex>& lock, int rank, const std::string& reason) {
    if (!aborted_) {
      aborted_ = true;
      failed_rank_ = rank;
      reason_ = reason;
      for (RankState& r : ranks_) r.jobs.clear();
    }
    cv_.notify_all();
    // After this no copy touches any buffer: callers may free theirs.
    cv_.wait(lock, [&] { return copies_in_progress_ == 0; });
  }

  // This rank's own failure: peers learn "rank R failed: <reason>", the rank
  // itself throws the plain reason.
  [[noreturn]] void AbortAndThrow(std::unique_lock<std::mutex>& lock, int rank,
                                  const std::string& reason) {
    AbortLocked(lock, rank, reason);
    throw Error(reason);
  }

  [[noreturn]] void ThrowFailure(std::unique_lock<std::mutex>& lock) {
    cv_.wait(lock, [&] { return copies_in_progress_ == 0; });
    throw Error(PeerFailedMessage(failed_rank_, reason_));
  }

  const CommOptions options_;
  const LinkModel link_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool aborted_ = false;
  int failed_rank_ = -1;
  std::string reason_;
  int copies_in_progress_ = 0;
  std::vector<RankState> ranks_;
  std::map<int64_t, Collective> collectives_;
  std::vector<std::thread> copiers_;
};

class ThreadComm final : public Communicator {
 public:
  ThreadComm(World* world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  const char* backend() const override { return "threads"; }
  Handle StartShift(const void* send, void* recv, size_t bytes) override {
    // Checked before any shared state changes, so a bad call leaves the
    // communicator usable for the Abort that follows the throw.
    Check(send != nullptr || bytes == 0, "StartShift: send is null but bytes = ", bytes);
    Check(recv != nullptr || bytes == 0, "StartShift: recv is null but bytes = ", bytes);
    return world_->StartShift(rank_, send, recv, bytes);
  }
  void Wait(Handle handle) override { world_->Wait(rank_, handle); }
  void AllReduceSum(float* data, size_t count) override {
    Check(data != nullptr || count == 0, "AllReduceSum: data is null but count = ", count);
    world_->AllReduce(rank_, data, count, "all-reduce");
  }
  void Barrier() override { world_->AllReduce(rank_, nullptr, 0, "barrier"); }
  void Abort(const std::string& reason) noexcept override { world_->Abort(rank_, reason); }

 private:
  World* world_;
  int rank_;
};

// "rank 2 failed: rank 2: timed out ..." reads better without the repeat.
std::string StripOwnPrefix(int rank, const std::string& reason) {
  const std::string prefix = "rank " + std::to_string(rank) + ": ";
  return reason.rfind(prefix, 0) == 0 ? reason.substr(prefix.size()) : reason;
}

}  // namespace

void RunThreadRanks(int num_ranks, const CommOptions& options,
                    const std::function<void(Communicator&)>& fn) {
  Check(num_ranks >= 1, "RunThreadRanks: num_ranks must be >= 1, got ", num_ranks);
  Check(options.timeout_s > 0, "CommOptions::timeout_s must be > 0, got ", options.timeout_s);
  Check(static_cast<bool>(fn), "RunThreadRanks: fn is empty");
  World world(num_ranks, options, comm_internal::ResolveLink(options));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&world, &fn, r] {
      ThreadComm comm(&world, r);
      try {
        fn(comm);
      } catch (const std::exception& e) {
        world.Abort(r, FailureReason(e));
      } catch (...) {
        world.Abort(r, "unknown exception");
      }
      world.Finish(r);
    });
  }
  for (std::thread& t : threads) t.join();
  int failed_rank = -1;
  std::string reason;
  if (world.Failure(&failed_rank, &reason)) {
    throw Error(PeerFailedMessage(failed_rank, StripOwnPrefix(failed_rank, reason)));
  }
}

}  // namespace ringsplash
