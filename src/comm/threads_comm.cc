// The `threads` communicator backend: N ranks as threads of one process.
//
// A World is one communicator's ranks: the RunThreadRanks (the root world)
// or a group Split made. It holds, per rank, the shifts it has posted but not
// yet matched with its neighbour. Shift #k of rank r sends to r+1 and
// receives from r-1; rank r's k-th send matches rank (r+1)'s k-th receive
// (every rank posts the same sequence of shifts, so sequence numbers match
// like MPI's non-overtaking rule). Once both sides of a transfer are posted,
// a copy job goes to the RECEIVING rank's delivery thread (one per rank of
// each world), which does the memcpy while both ranks keep computing — so the
// transfer overlaps compute as it would on a network. Shifts therefore
// complete in the order started. Collectives (all-reduce, barrier,
// all-to-all, split) are numbered per world too, so a world's messages and
// collectives never meet another world's.
//
// Link model (CommOptions::link): at the match, the message is scheduled on
// the sender's outgoing LinkClock of that world; the delivery thread copies
// at once, then holds the completion back until the modelled arrival,
// sleeping on the job's condition variable (so an abort or the end of the
// world wakes it). The ranks meanwhile compute: an emulated slow network
// that overlaps like a real one with its own transfer engine.
//
// One job. Every world of one RunThreadRanks shares a Job: one mutex, one
// condition variable, one failure. Abort() on any world marks the job
// failed, drops every world's copy jobs not yet started and waits for the
// (bounded) copies in progress, so that once Abort returns no thread touches
// any rank's buffers again — a rank may then unwind and free them. Every
// blocking call of every world wakes up and throws "rank R failed: <reason>"
// (R: the job rank). A peer that returned from its function, or destroyed
// its communicator of a split, without posting what a rank waits for fails
// that wait at once; a peer that is merely slow fails it after
// CommOptions::timeout_s. Such a rank-detected failure (timeout, vanished
// peer, mismatched sizes) aborts the job in the detecting rank's name: it
// throws the plain reason ("rank 1: timed out after ..."), its peers throw
// "rank 1 failed: <reason>". Messages name job ranks; a split's add its
// group (" of group {1, 3}").
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "src/comm/comm_util.h"
#include "src/comm/cores.h"

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

class World;

// What every world of one RunThreadRanks shares.
struct Job {
  explicit Job(int n) : size(n), finished(static_cast<size_t>(n), false) {}
  const int size;  // ranks of the RunThreadRanks
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  int failed_rank = -1;  // job rank
  std::string reason;
  int copies_in_progress = 0;  // memcpys into or out of ranks' buffers, any world
  std::vector<bool> finished;  // per job rank: its function returned or threw
  std::vector<World*> worlds;  // the job's live worlds
};

class World {
 public:
  // job_ranks[r]: the job rank of this world's rank r. `root`: the world of
  // the RunThreadRanks itself (else a split's).
  World(std::shared_ptr<Job> job, const CommOptions& options, const LinkModel& link,
        std::vector<int> job_ranks, bool root)
      : job_(std::move(job)),
        options_(options),
        link_(link),
        job_ranks_(std::move(job_ranks)),
        root_(root),
        label_(IsWholeJob(job_ranks_, job_->size) ? "" : comm_internal::GroupLabel(job_ranks_)),
        ranks_(job_ranks_.size()) {
    {
      std::lock_guard<std::mutex> lock(job_->mu);
      job_->worlds.push_back(this);
    }
    copiers_.reserve(ranks_.size());
    try {
      for (int r = 0; r < size(); ++r) copiers_.emplace_back([this, r] { DeliveryLoop(r); });
    } catch (...) {
      Stop();
      throw;
    }
  }

  ~World() { Stop(); }

  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  int job_size() const { return job_->size; }

  Handle StartShift(int rank, const void* send, void* recv, size_t bytes) {
    std::unique_lock<std::mutex> lock(job_->mu);
    if (job_->aborted) ThrowFailure(lock);
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
    job_->cv.notify_all();
    return seq;
  }

  void Wait(int rank, Handle handle) {
    std::unique_lock<std::mutex> lock(job_->mu);
    RankState& me = ranks_[rank];
    if (handle < 0 || handle >= me.shifts_started) {
      Fail("Wait: ", Name(rank), " has no shift #", handle, label_, " (", me.shifts_started,
           " started)");
    }
    const int next = (rank + 1) % size();
    const int prev = (rank + size() - 1) % size();
    const Clock::time_point deadline = DeadlineAfter(options_.timeout_s);
    for (;;) {
      if (job_->aborted) ThrowFailure(lock);
      auto it = me.done.find(handle);
      if (it == me.done.end()) {
        Fail("Wait: ", Name(rank), " already waited for shift #", handle, label_);
      }
      const uint8_t bits = it->second;
      if (bits == (kSendDone | kRecvDone)) {
        me.done.erase(it);
        return;
      }
      // Who we are waiting for: the sender (prev) until our receive is done,
      // then the receiver (next).
      const int peer = (bits & kRecvDone) ? next : prev;
      if (Gone(peer) && ranks_[peer].shifts_started <= handle) {
        AbortAndThrow(lock, rank,
                      Name(rank) + ": " + Name(peer) + GoneVerb() + " without posting shift #" +
                          std::to_string(handle) + label_);
      }
      if (Clock::now() >= deadline) {
        AbortAndThrow(lock, rank,
                      Name(rank) + ": timed out after " + FormatSeconds(options_.timeout_s) +
                          " waiting for " + Name(peer) + " in shift #" + std::to_string(handle) +
                          label_);
      }
      job_->cv.wait_until(lock, deadline);
    }
  }

  // Element-wise sum over ranks, added in rank order so every rank gets the
  // same bits on every run. count == 0 is a barrier.
  void AllReduce(int rank, float* data, size_t count, const char* what) {
    std::unique_lock<std::mutex> lock(job_->mu);
    const CollectiveIt it = Join(lock, rank, Kind::kReduce, count, what, [&](Collective& col) {
      col.contrib[rank].assign(data, data + count);
    });
    const Collective& col = it->second;
    for (size_t i = 0; i < count; ++i) {
      float sum = col.contrib[0][i];
      for (size_t q = 1; q < ranks_.size(); ++q) sum += col.contrib[q][i];
      data[i] = sum;
    }
    LeaveCollective(it, nullptr);
  }

  // Each rank copies the blocks meant for it out of its peers' send buffers
  // (in parallel, like the delivery threads), then waits until every rank
  // has done so: after that nobody reads its send buffer again.
  void AllToAll(int rank, const void* send, void* recv, size_t bytes_per_rank) {
    std::unique_lock<std::mutex> lock(job_->mu);
    const CollectiveIt it =
        Join(lock, rank, Kind::kAllToAll, bytes_per_rank, "all-to-all",
             [&](Collective& col) { col.sends[rank] = static_cast<const char*>(send); });
    Collective& col = it->second;
    const int64_t seq = it->first;
    // A peer that failed since it arrived may have freed its send buffer.
    if (job_->aborted) ThrowFailure(lock);
    char* out = static_cast<char*>(recv);
    const size_t offset = bytes_per_rank * static_cast<size_t>(rank);
    ++job_->copies_in_progress;
    lock.unlock();
    for (int q = 0; q < size() && bytes_per_rank > 0; ++q) {
      std::memcpy(out + bytes_per_rank * static_cast<size_t>(q), col.sends[q] + offset,
                  bytes_per_rank);
    }
    lock.lock();
    --job_->copies_in_progress;
    ++col.num_copied;
    job_->cv.notify_all();
    Await(
        lock, rank, [&] { return col.num_copied == size(); },
        [&] { return "the other ranks to read its blocks in all-to-all #" + std::to_string(seq); });
    LeaveCollective(it, nullptr);
  }

  // Returns this rank's world and rank there (nullptr for a negative color).
  // The first rank to see every rank arrived builds every group's world
  // (outside the lock: it starts threads) and publishes them.
  std::pair<std::shared_ptr<World>, int> Split(int rank, int color, int key) {
    std::vector<std::shared_ptr<World>> release;  // destroyed after the lock is released
    std::unique_lock<std::mutex> lock(job_->mu);
    const CollectiveIt it = Join(lock, rank, Kind::kSplit, 0, "split", [&](Collective& col) {
      col.colors[rank] = color;
      col.keys[rank] = key;
    });
    Collective& col = it->second;
    const int64_t seq = it->first;
    if (!col.split_building) {
      col.split_building = true;
      const std::vector<int> colors = col.colors, keys = col.keys;
      lock.unlock();
      std::vector<std::shared_ptr<World>> worlds(ranks_.size());
      std::vector<int> new_ranks(ranks_.size(), -1);
      std::string error;
      try {
        BuildGroups(colors, keys, &worlds, &new_ranks);
      } catch (const std::exception& e) {
        error = Name(rank) + ": split #" + std::to_string(seq) + label_ + ": " + FailureReason(e);
        worlds.clear();  // stops their threads: needs the lock free
      }
      lock.lock();
      if (!error.empty()) AbortAndThrow(lock, rank, error);
      col.split_worlds = std::move(worlds);
      col.split_ranks = std::move(new_ranks);
      col.split_ready = true;
      job_->cv.notify_all();
    }
    Await(
        lock, rank, [&] { return col.split_ready; },
        [&] { return "the other ranks' groups in split #" + std::to_string(seq); });
    std::pair<std::shared_ptr<World>, int> mine{col.split_worlds[rank], col.split_ranks[rank]};
    LeaveCollective(it, &release);
    return mine;
  }

  void Abort(int rank, const std::string& reason) noexcept {
    std::unique_lock<std::mutex> lock(job_->mu);
    AbortLocked(lock, rank, reason);
  }

  // This rank's communicator is gone (its function returned, or a split's
  // communicator was destroyed): peers waiting for it fail at once.
  void Leave(int rank) {
    std::lock_guard<std::mutex> lock(job_->mu);
    ranks_[rank].left = true;
    job_->cv.notify_all();
  }

  // The job rank's function returned or threw: every world waiting for it
  // fails at once.
  void FinishJobRank(int job_rank) {
    std::lock_guard<std::mutex> lock(job_->mu);
    job_->finished[job_rank] = true;
    job_->cv.notify_all();
  }

  // The first failure of the job, if any.
  bool Failure(int* job_rank, std::string* reason) {
    std::lock_guard<std::mutex> lock(job_->mu);
    if (!job_->aborted) return false;
    *job_rank = job_->failed_rank;
    *reason = job_->reason;
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
    bool left = false;                          // its communicator is gone
  };
  enum class Kind { kReduce, kAllToAll, kSplit };
  // One collective, #seq of this world, from the first rank's arrival until
  // the last has left it.
  struct Collective {
    Kind kind = Kind::kReduce;
    size_t count = 0;  // floats (reduce) or bytes per rank (all-to-all)
    std::string what;  // as the first rank called it: "all-reduce", "barrier", ...
    std::vector<bool> arrived;
    int num_arrived = 0;
    int num_left = 0;
    std::vector<std::vector<float>> contrib;  // reduce: each rank's values
    std::vector<const char*> sends;           // all-to-all: each rank's send buffer
    int num_copied = 0;                       // all-to-all: ranks done reading
    std::vector<int> colors, keys;            // split
    bool split_building = false;
    bool split_ready = false;
    std::vector<std::shared_ptr<World>> split_worlds;  // split: per rank
    std::vector<int> split_ranks;                      // split: per rank
  };
  using CollectiveIt = std::map<int64_t, Collective>::iterator;

  std::string Name(int rank) const { return "rank " + std::to_string(job_ranks_[rank]); }
  const char* GoneVerb() const {
    return root_ ? " returned" : " returned or destroyed its communicator";
  }
  // Messages about the whole job in job order need no group label.
  static bool IsWholeJob(const std::vector<int>& job_ranks, int job_size) {
    if (static_cast<int>(job_ranks.size()) != job_size) return false;
    for (size_t i = 0; i < job_ranks.size(); ++i) {
      if (job_ranks[i] != static_cast<int>(i)) return false;
    }
    return true;
  }
  bool Gone(int rank) const { return ranks_[rank].left || job_->finished[job_ranks_[rank]]; }

  // Collective #seq of this rank: checks it is the same call as the other
  // ranks', adds this rank's part (contribute) and waits until every rank
  // has arrived.
  template <class Contribute>
  CollectiveIt Join(std::unique_lock<std::mutex>& lock, int rank, Kind kind, size_t count,
                    const char* what, Contribute contribute) {
    if (job_->aborted) ThrowFailure(lock);
    const int64_t seq = ranks_[rank].collectives_started++;
    const std::string where = std::string(what) + " #" + std::to_string(seq) + label_;
    auto [it, inserted] = collectives_.try_emplace(seq);
    Collective& col = it->second;
    if (inserted) {
      col.kind = kind;
      col.count = count;
      col.what = what;
      col.arrived.assign(ranks_.size(), false);
      col.contrib.resize(kind == Kind::kReduce ? ranks_.size() : 0);
      col.sends.resize(kind == Kind::kAllToAll ? ranks_.size() : 0);
      col.colors.resize(kind == Kind::kSplit ? ranks_.size() : 0);
      col.keys.resize(kind == Kind::kSplit ? ranks_.size() : 0);
    }
    if (col.kind != kind) {
      AbortAndThrow(lock, rank,
                    Name(rank) + ": " + where + ", but another rank called " + col.what + " #" +
                        std::to_string(seq) + " there");
    }
    if (col.count != count) {
      const std::string unit = kind == Kind::kReduce ? " floats" : " bytes per rank";
      AbortAndThrow(lock, rank,
                    Name(rank) + ": " + where + " with " + std::to_string(count) + unit +
                        ", but another rank passed " + std::to_string(col.count));
    }
    contribute(col);
    col.arrived[rank] = true;
    ++col.num_arrived;
    job_->cv.notify_all();
    const Clock::time_point deadline = DeadlineAfter(options_.timeout_s);
    while (col.num_arrived < size()) {
      if (job_->aborted) ThrowFailure(lock);
      std::string missing;
      for (int q = 0; q < size(); ++q) {
        if (col.arrived[q]) continue;
        if (Gone(q)) {
          AbortAndThrow(lock, rank,
                        Name(rank) + ": " + Name(q) + GoneVerb() + " without joining " + where);
        }
        missing += (missing.empty() ? "" : ", ") + std::to_string(job_ranks_[q]);
      }
      if (Clock::now() >= deadline) {
        AbortAndThrow(lock, rank,
                      Name(rank) + ": timed out after " + FormatSeconds(options_.timeout_s) +
                          " waiting for rank(s) " + missing + " in " + where);
      }
      job_->cv.wait_until(lock, deadline);
    }
    // Every rank arrived: the collective's inputs are complete, so a failure
    // from now on does not undo it (an all-reduce still returns its sum).
    return it;
  }

  // Waits, after every rank has arrived, for the rest of a collective
  // (peers are inside the same call: only a failure or the timeout stops it).
  template <class Done, class Describe>
  void Await(std::unique_lock<std::mutex>& lock, int rank, Done done, Describe describe) {
    const Clock::time_point deadline = DeadlineAfter(options_.timeout_s);
    for (;;) {
      if (done()) return;
      if (job_->aborted) ThrowFailure(lock);
      if (Clock::now() >= deadline) {
        AbortAndThrow(lock, rank,
                      Name(rank) + ": timed out after " + FormatSeconds(options_.timeout_s) +
                          " waiting for " + describe() + label_);
      }
      job_->cv.wait_until(lock, deadline);
    }
  }

  // Ends this rank's part of a collective; the last rank erases it (handing
  // the split's worlds to `release`, to be let go of outside the lock).
  void LeaveCollective(CollectiveIt it, std::vector<std::shared_ptr<World>>* release) {
    if (++it->second.num_left < size()) return;
    if (release != nullptr) *release = std::move(it->second.split_worlds);
    collectives_.erase(it);
  }

  // The worlds of a split: ranks of equal color >= 0, ordered by (key,
  // rank here) as MPI_Comm_split orders them.
  void BuildGroups(const std::vector<int>& colors, const std::vector<int>& keys,
                   std::vector<std::shared_ptr<World>>* worlds, std::vector<int>* new_ranks) {
    std::vector<int> order(ranks_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      if (colors[a] != colors[b]) return colors[a] < colors[b];
      return keys[a] < keys[b];  // stable: ties keep rank order
    });
    for (size_t begin = 0; begin < order.size();) {
      size_t end = begin;
      while (end < order.size() && colors[order[end]] == colors[order[begin]]) ++end;
      if (colors[order[begin]] >= 0) {
        std::vector<int> job_ranks;
        for (size_t i = begin; i < end; ++i) job_ranks.push_back(job_ranks_[order[i]]);
        auto world = std::make_shared<World>(job_, options_, link_, std::move(job_ranks),
                                             /*root=*/false);
        for (size_t i = begin; i < end; ++i) {
          (*worlds)[order[i]] = world;
          (*new_ranks)[order[i]] = static_cast<int>(i - begin);
        }
      }
      begin = end;
    }
  }

  void Match(std::unique_lock<std::mutex>& lock, int64_t seq, int from, int to, const void* src,
             size_t src_bytes, void* dst, size_t dst_bytes) {
    if (src_bytes != dst_bytes) {
      AbortAndThrow(lock, to,
                    "shift #" + std::to_string(seq) + label_ + ": " + Name(from) + " sends " +
                        std::to_string(src_bytes) + " bytes but " + Name(to) + " expects " +
                        std::to_string(dst_bytes));
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
    std::unique_lock<std::mutex> lock(job_->mu);
    std::deque<CopyJob>& jobs = ranks_[rank].jobs;
    for (;;) {
      job_->cv.wait(lock, [&] { return stopping_ || !jobs.empty(); });
      if (stopping_) return;
      const CopyJob job = jobs.front();
      jobs.pop_front();
      if (job_->aborted) continue;  // never touch buffers of a failed job
      ++job_->copies_in_progress;
      lock.unlock();
      if (job.bytes > 0) std::memcpy(job.dst, job.src, job.bytes);
      lock.lock();
      --job_->copies_in_progress;
      job_->cv.notify_all();
      if (job.delayed) {
        // The data is in place; the shift completes at its modelled arrival.
        // Jobs of this queue arrive in order (one link, one message at a time).
        job_->cv.wait_until(lock, job.arrival, [&] { return stopping_ || job_->aborted; });
        if (stopping_) return;
        if (job_->aborted) continue;
      }
      ranks_[job.from].done[job.seq] |= kSendDone;
      ranks_[job.to].done[job.seq] |= kRecvDone;
      job_->cv.notify_all();
    }
  }

  // Ends the delivery threads and leaves the job's list of worlds.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(job_->mu);
      stopping_ = true;
      std::erase(job_->worlds, this);
    }
    job_->cv.notify_all();
    for (std::thread& t : copiers_) t.join();
  }

  void AbortLocked(std::unique_lock<std::mutex>& lock, int rank, const std::string& reason) {
    if (!job_->aborted) {
      job_->aborted = true;
      job_->failed_rank = job_ranks_[rank];
      job_->reason = reason;
      for (World* w : job_->worlds) {
        for (RankState& r : w->ranks_) r.jobs.clear();
      }
    }
    job_->cv.notify_all();
    // After this no copy touches any buffer: callers may free theirs.
    job_->cv.wait(lock, [&] { return job_->copies_in_progress == 0; });
  }

  // This rank's own failure: peers learn "rank R failed: <reason>", the rank
  // itself throws the plain reason.
  [[noreturn]] void AbortAndThrow(std::unique_lock<std::mutex>& lock, int rank,
                                  const std::string& reason) {
    AbortLocked(lock, rank, reason);
    throw Error(reason);
  }

  [[noreturn]] void ThrowFailure(std::unique_lock<std::mutex>& lock) {
    job_->cv.wait(lock, [&] { return job_->copies_in_progress == 0; });
    throw Error(PeerFailedMessage(job_->failed_rank, job_->reason));
  }

  const std::shared_ptr<Job> job_;
  const CommOptions options_;
  const LinkModel link_;
  const std::vector<int> job_ranks_;
  const bool root_;
  const std::string label_;
  // Guarded by job_->mu.
  bool stopping_ = false;
  std::vector<RankState> ranks_;
  std::map<int64_t, Collective> collectives_;
  std::vector<std::thread> copiers_;
};

class ThreadComm final : public Communicator {
 public:
  ThreadComm(std::shared_ptr<World> world, int rank) : world_(std::move(world)), rank_(rank) {}
  ~ThreadComm() override { world_->Leave(rank_); }
  ThreadComm(const ThreadComm&) = delete;
  ThreadComm& operator=(const ThreadComm&) = delete;

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
  std::unique_ptr<Communicator> Split(int color, int key) override {
    auto [world, rank] = world_->Split(rank_, color, key);
    if (world == nullptr) return nullptr;
    return std::make_unique<ThreadComm>(std::move(world), rank);
  }
  void AllToAll(const void* send, void* recv, size_t bytes_per_rank) override {
    comm_internal::CheckAllToAllArguments(send, recv, bytes_per_rank, size());
    world_->AllToAll(rank_, send, recv, bytes_per_rank);
  }
  // Every rank of the job is a thread of this process.
  int DefaultThreads() const override {
    return std::max(1, comm_internal::UsableCores() / world_->job_size());
  }

 private:
  std::shared_ptr<World> world_;
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
  const LinkModel link = comm_internal::ResolveLink(options);
  std::vector<int> job_ranks(static_cast<size_t>(num_ranks));
  std::iota(job_ranks.begin(), job_ranks.end(), 0);
  const auto root = std::make_shared<World>(std::make_shared<Job>(num_ranks), options, link,
                                            std::move(job_ranks), /*root=*/true);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&root, &fn, r] {
      {
        ThreadComm comm(root, r);
        try {
          fn(comm);
        } catch (const std::exception& e) {
          root->Abort(r, FailureReason(e));
        } catch (...) {
          root->Abort(r, "unknown exception");
        }
      }
      root->FinishJobRank(r);
    });
  }
  for (std::thread& t : threads) t.join();
  int failed_rank = -1;
  std::string reason;
  if (root->Failure(&failed_rank, &reason)) {
    throw Error(PeerFailedMessage(failed_rank, StripOwnPrefix(failed_rank, reason)));
  }
}

}  // namespace ringsplash
