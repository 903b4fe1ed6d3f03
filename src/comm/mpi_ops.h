// The MPI backend's communicators and operations (mpi_comm.cc): what the
// progress thread posts and tests for each kind of call, and the messages
// that describe them. Included only by mpi_comm.cc (CMake compiles that file
// only when MPI is found; a header needs no such rule).
#ifndef RINGSPLASH_COMM_MPI_OPS_H_
#define RINGSPLASH_COMM_MPI_OPS_H_

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ringsplash/comm.h"
#include "src/comm/comm_util.h"
#include "src/comm/cores.h"

namespace ringsplash::comm_internal {

// Tags of the point-to-point messages on a communicator (the abort channel
// has its own communicator).
constexpr int kShiftTag = 7301;
constexpr int kAllToAllTag = 7303;
// MPI counts are int: larger messages go as several (same tag, so they
// match in order).
constexpr size_t kMaxMessageBytes = size_t{1} << 30;

inline std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

// One MPI communicator of this process: a Communicator's own. Immutable once
// made, except `comm` (freed by the progress thread) and `in_link`.
struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;  // MPI_COMM_WORLD rank of each rank
  std::string label;             // "" for the world in world order, else GroupLabel
  LinkClock in_link;             // progress thread only: the link from rank-1
};

enum class OpKind { kShift, kAllReduce, kBarrier, kAllToAll, kSplit, kDup };

// One queued or in-flight operation. Fields above the first marker are set
// by the posting thread before the op is queued and never changed; the
// next group belongs to the progress thread; the rest is guarded by the
// runtime's mutex.
struct Op {
  OpKind kind = OpKind::kShift;
  int64_t seq = 0;                // shift #, collective # or all-to-all # of the communicator
  std::shared_ptr<CommState> cs;  // its communicator (kDup: none yet)
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;                     // shift: bytes; all-to-all: bytes per rank
  std::vector<float> contrib;           // all-reduce: this rank's values (owned copy)
  std::vector<float> gathered;          // all-reduce: every rank's values, rank-major
  LinkModel link;                       // shift: the emulated link (inactive: none)
  int split_in[2] = {0, 0};             // split: (color or MPI_UNDEFINED, key)
  std::vector<int> split_all;           // split: every rank's (color, key)
  MPI_Comm dup_source = MPI_COMM_NULL;  // dup: the communicator to duplicate
  // --- progress thread only
  std::vector<MPI_Request> recv_requests, send_requests;
  std::vector<int> recv_sizes;  // bytes posted per receive request
  std::vector<int> recv_peers;  // all-to-all: the rank each receive is from
  std::vector<int> recvs_left;  // all-to-all: per rank, receives not complete
  MPI_Request coll_request = MPI_REQUEST_NULL;
  MPI_Comm dup_new = MPI_COMM_NULL;
  bool link_scheduled = false;  // the receive completed; modelled arrival set
  Clock::time_point arrival;    // ... at this time
  // --- guarded by the runtime's mutex
  bool recv_done = false;
  bool send_done = false;
  bool done = false;
  std::string error;
  std::string missing;                // all-to-all: world ranks whose blocks are not in
  std::shared_ptr<CommState> result;  // split, dup: the new communicator (split: null: none)
};

inline std::string JoinRanks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// The world ranks of the communicator's ranks other than this one.
inline std::string OtherRanks(const CommState& cs) {
  std::vector<int> others;
  for (int r = 0; r < cs.size; ++r) {
    if (r != cs.rank) others.push_back(cs.world_ranks[static_cast<size_t>(r)]);
  }
  return JoinRanks(others);
}

// "shift #3 (4096 bytes) of group {1, 3}", "all-reduce #0", ...
inline std::string Describe(const Op& op) {
  const std::string label = op.cs ? op.cs->label : "";
  const std::string n = " #" + std::to_string(op.seq);
  switch (op.kind) {
    case OpKind::kShift:
      return "shift" + n + " (" + std::to_string(op.bytes) + " bytes)" + label;
    case OpKind::kAllReduce:
      return "all-reduce" + n + label;
    case OpKind::kBarrier:
      return "barrier" + n + label;
    case OpKind::kAllToAll:
      return "all-to-all" + n + " (" + std::to_string(op.bytes) + " bytes per rank)" + label;
    case OpKind::kSplit:
      return "split" + n + label;
    case OpKind::kDup:
      return "making a communicator (MPI_Comm_idup)";
  }
  return "?";
}

// Whom a timed-out wait was waiting for. Called with the runtime's mutex.
inline std::string WaitingFor(const Op& op) {
  const std::string label = op.cs ? op.cs->label : "";
  if (op.kind == OpKind::kShift) {
    const CommState& cs = *op.cs;
    const int peer = op.recv_done ? (cs.rank + 1) % cs.size : (cs.rank + cs.size - 1) % cs.size;
    return "rank " + std::to_string(cs.world_ranks[static_cast<size_t>(peer)]) + " in shift #" +
           std::to_string(op.seq) + label;
  }
  if (op.kind == OpKind::kAllToAll && !op.missing.empty()) {
    return "rank(s) " + op.missing + " in all-to-all #" + std::to_string(op.seq) + label;
  }
  if (op.kind == OpKind::kDup) return "the other ranks in " + Describe(op);
  std::string what = Describe(op);
  if (op.kind == OpKind::kAllToAll) what = "all-to-all #" + std::to_string(op.seq) + label;
  return "the other ranks in " + what;
}

// Tests a list of requests; returns true when all are complete. Completed
// entries become MPI_REQUEST_NULL and their indices go to `completed` (if
// given). With `expected` (receives), a message shorter than posted is an
// error: the peer sent fewer bytes (its rank, in `cs`, named as world rank).
inline bool TestList(std::vector<MPI_Request>& requests, const std::vector<int>* expected,
                     const CommState* cs, std::vector<size_t>* completed, std::string* error) {
  bool all = true;
  for (size_t i = 0; i < requests.size(); ++i) {
    MPI_Request& rq = requests[i];
    if (rq == MPI_REQUEST_NULL) continue;
    int flag = 0;
    MPI_Status status;
    const int rc = MPI_Test(&rq, &flag, &status);
    if (rc != MPI_SUCCESS) {
      *error = MpiErrorText(rc);
      return false;
    }
    if (!flag) {
      all = false;
      continue;
    }
    if (completed != nullptr) completed->push_back(i);
    if (expected != nullptr) {
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      if (count != (*expected)[i]) {
        const int source = cs != nullptr && status.MPI_SOURCE >= 0 && status.MPI_SOURCE < cs->size
                               ? cs->world_ranks[static_cast<size_t>(status.MPI_SOURCE)]
                               : status.MPI_SOURCE;
        *error = "received " + std::to_string(count) + " bytes from rank " +
                 std::to_string(source) + " where " + std::to_string((*expected)[i]) +
                 " were expected (sizes differ)";
        return false;
      }
    }
  }
  return all;
}

// Posts `bytes` from `peer` into `recv` (chunked; at least one message, so
// zero-byte calls still match in sequence).
inline int PostReceives(Op& op, char* recv, size_t bytes, int peer, int tag) {
  for (size_t off = 0; off == 0 || off < bytes; off += kMaxMessageBytes) {
    const int n = static_cast<int>(std::min(kMaxMessageBytes, bytes - off));
    MPI_Request rq;
    const int rc = MPI_Irecv(recv + off, n, MPI_BYTE, peer, tag, op.cs->comm, &rq);
    if (rc != MPI_SUCCESS) return rc;
    op.recv_requests.push_back(rq);
    op.recv_sizes.push_back(n);
    op.recv_peers.push_back(peer);
    if (bytes == 0) break;
  }
  return MPI_SUCCESS;
}

inline int PostSends(Op& op, const char* send, size_t bytes, int peer, int tag) {
  for (size_t off = 0; off == 0 || off < bytes; off += kMaxMessageBytes) {
    const int n = static_cast<int>(std::min(kMaxMessageBytes, bytes - off));
    MPI_Request rq;
    const int rc = MPI_Isend(send + off, n, MPI_BYTE, peer, tag, op.cs->comm, &rq);
    if (rc != MPI_SUCCESS) return rc;
    op.send_requests.push_back(rq);
    if (bytes == 0) break;
  }
  return MPI_SUCCESS;
}

// Hands `op` to MPI. False (and `error`) if posting failed.
inline bool PostOp(Op& op, std::string* error) {
  int rc = MPI_SUCCESS;
  switch (op.kind) {
    case OpKind::kShift: {
      const CommState& cs = *op.cs;
      const int next = (cs.rank + 1) % cs.size, prev = (cs.rank + cs.size - 1) % cs.size;
      rc = PostReceives(op, static_cast<char*>(op.recv), op.bytes, prev, kShiftTag);
      if (rc == MPI_SUCCESS) {
        rc = PostSends(op, static_cast<const char*>(op.send), op.bytes, next, kShiftTag);
      }
      break;
    }
    case OpKind::kAllToAll: {
      // Every other rank, starting from the next: no rank is everyone's first.
      const CommState& cs = *op.cs;
      op.recvs_left.assign(static_cast<size_t>(cs.size), 0);
      for (int i = 1; i < cs.size && rc == MPI_SUCCESS; ++i) {
        const int peer = (cs.rank + cs.size - i) % cs.size;
        const size_t before = op.recv_requests.size();
        rc = PostReceives(op, static_cast<char*>(op.recv) + op.bytes * static_cast<size_t>(peer),
                          op.bytes, peer, kAllToAllTag);
        op.recvs_left[static_cast<size_t>(peer)] =
            static_cast<int>(op.recv_requests.size() - before);
      }
      for (int i = 1; i < cs.size && rc == MPI_SUCCESS; ++i) {
        const int peer = (cs.rank + i) % cs.size;
        rc = PostSends(op, static_cast<const char*>(op.send) + op.bytes * static_cast<size_t>(peer),
                       op.bytes, peer, kAllToAllTag);
      }
      break;
    }
    case OpKind::kAllReduce: {
      const int n = static_cast<int>(op.contrib.size());
      rc = MPI_Iallgather(op.contrib.data(), n, MPI_FLOAT, op.gathered.data(), n, MPI_FLOAT,
                          op.cs->comm, &op.coll_request);
      break;
    }
    case OpKind::kBarrier:
      rc = MPI_Ibarrier(op.cs->comm, &op.coll_request);
      break;
    case OpKind::kSplit:
      rc = MPI_Iallgather(op.split_in, 2, MPI_INT, op.split_all.data(), 2, MPI_INT, op.cs->comm,
                          &op.coll_request);
      break;
    case OpKind::kDup: {
      int inter = 0;
      rc = MPI_Comm_test_inter(op.dup_source, &inter);
      if (rc == MPI_SUCCESS && inter) {
        *error = "the communicator is an inter-communicator; a ring needs an intra-communicator";
        return false;
      }
      if (rc == MPI_SUCCESS) rc = MPI_Comm_idup(op.dup_source, &op.dup_new, &op.coll_request);
      break;
    }
  }
  if (rc != MPI_SUCCESS) *error = "posting failed: " + MpiErrorText(rc);
  return rc == MPI_SUCCESS;
}

// The state of a new communicator (set to return errors; ranks translated
// to world ranks through `world_group`). On error: null and `error`.
inline std::shared_ptr<CommState> MakeState(MPI_Comm comm, MPI_Group world_group,
                                            std::string* error) {
  auto cs = std::make_shared<CommState>();
  cs->comm = comm;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm, &cs->rank);
  MPI_Comm_size(comm, &cs->size);
  std::vector<int> ranks(static_cast<size_t>(cs->size));
  for (int r = 0; r < cs->size; ++r) ranks[static_cast<size_t>(r)] = r;
  cs->world_ranks.assign(ranks.size(), MPI_UNDEFINED);
  MPI_Group group = MPI_GROUP_NULL;
  int rc = MPI_Comm_group(comm, &group);
  if (rc == MPI_SUCCESS) {
    rc = MPI_Group_translate_ranks(group, cs->size, ranks.data(), world_group,
                                   cs->world_ranks.data());
    MPI_Group_free(&group);
  }
  if (rc != MPI_SUCCESS) {
    *error = "reading the new communicator's ranks failed: " + MpiErrorText(rc);
    MPI_Comm_free(&cs->comm);
    return nullptr;
  }
  int world_size = 0;
  MPI_Group_size(world_group, &world_size);
  cs->label = cs->world_ranks == ranks && cs->size == world_size ? "" : GroupLabel(cs->world_ranks);
  return cs;
}

// What one poll found out about an op.
struct Progress {
  bool recv_done = false, send_done = false, done = false;
  bool missing_changed = false;  // all-to-all: `missing` is new
  std::string missing;
  std::shared_ptr<CommState> result;
  std::string error;
};

// Polls `op` (progress thread). A split whose gather completed calls
// MPI_Comm_split here: every rank is past the gather, so it waits for no one.
inline Progress TestOp(Op& op, MPI_Group world_group) {
  Progress p;
  switch (op.kind) {
    case OpKind::kShift: {
      CommState& cs = *op.cs;
      p.recv_done = TestList(op.recv_requests, &op.recv_sizes, &cs, nullptr, &p.error);
      if (p.recv_done && op.link.active() && cs.size > 1) {
        // The data is here; the emulated link delivers it later.
        const Clock::time_point now = Clock::now();
        if (!op.link_scheduled) {
          op.arrival = cs.in_link.Schedule(op.link, now, op.bytes);
          op.link_scheduled = true;
        }
        p.recv_done = now >= op.arrival;
      }
      if (p.error.empty())
        p.send_done = TestList(op.send_requests, nullptr, nullptr, nullptr, &p.error);
      p.done = p.recv_done && p.send_done;
      return p;
    }
    case OpKind::kAllToAll: {
      std::vector<size_t> completed;
      p.recv_done = TestList(op.recv_requests, &op.recv_sizes, op.cs.get(), &completed, &p.error);
      for (size_t i : completed) {
        const int peer = op.recv_peers[i];
        if (--op.recvs_left[static_cast<size_t>(peer)] == 0) p.missing_changed = true;
      }
      if (p.missing_changed) {
        std::vector<int> missing;
        for (int r = 0; r < op.cs->size; ++r) {
          if (op.recvs_left[static_cast<size_t>(r)] > 0) {
            missing.push_back(op.cs->world_ranks[static_cast<size_t>(r)]);
          }
        }
        p.missing = JoinRanks(missing);
      }
      if (p.error.empty())
        p.send_done = TestList(op.send_requests, nullptr, nullptr, nullptr, &p.error);
      p.done = p.recv_done && p.send_done;
      return p;
    }
    default:
      break;
  }
  int flag = 0;
  int rc = MPI_Test(&op.coll_request, &flag, MPI_STATUS_IGNORE);
  if (rc != MPI_SUCCESS) {
    p.error = MpiErrorText(rc);
    return p;
  }
  if (!flag) return p;
  if (op.kind == OpKind::kSplit) {
    MPI_Comm comm = MPI_COMM_NULL;
    rc = MPI_Comm_split(op.cs->comm, op.split_in[0], op.split_in[1], &comm);
    if (rc != MPI_SUCCESS) {
      p.error = "MPI_Comm_split failed: " + MpiErrorText(rc);
      return p;
    }
    if (comm != MPI_COMM_NULL) {
      p.result = MakeState(comm, world_group, &p.error);
      if (p.result == nullptr) return p;
    }
  } else if (op.kind == OpKind::kDup) {
    p.result = MakeState(op.dup_new, world_group, &p.error);
    if (p.result == nullptr) return p;
  }
  p.done = true;
  return p;
}

// Communicator::DefaultThreads of every communicator of this process (see
// comm.h): this process's cores / the processes on this machine whose
// affinity masks overlap this one's. Collective over `world` (at start-up);
// on an MPI error, the process's cores.
inline int SharedCoresPerProcess(MPI_Comm world) {
  std::vector<uint64_t> mask = UsableCpuMask();
  const int cores = CountCores(mask);
  MPI_Comm local = MPI_COMM_NULL;
  int world_rank = 0;
  MPI_Comm_rank(world, &world_rank);
  if (MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &local) !=
      MPI_SUCCESS) {
    return cores;
  }
  int local_size = 1;
  MPI_Comm_size(local, &local_size);
  // Every mask padded to the longest (masks of one machine have the same
  // CPUs, but not necessarily the same highest one set).
  int words = static_cast<int>(mask.size());
  int sharing = local_size;
  if (MPI_Allreduce(MPI_IN_PLACE, &words, 1, MPI_INT, MPI_MAX, local) == MPI_SUCCESS && words > 0) {
    const bool known = !mask.empty();
    mask.resize(static_cast<size_t>(words), 0);
    std::vector<uint64_t> all(static_cast<size_t>(words) * static_cast<size_t>(local_size));
    std::vector<int> known_all(static_cast<size_t>(local_size));
    int k = known ? 1 : 0;
    if (MPI_Allgather(mask.data(), words, MPI_UINT64_T, all.data(), words, MPI_UINT64_T, local) ==
            MPI_SUCCESS &&
        MPI_Allgather(&k, 1, MPI_INT, known_all.data(), 1, MPI_INT, local) == MPI_SUCCESS) {
      sharing = 0;
      for (int q = 0; q < local_size; ++q) {
        std::vector<uint64_t> theirs;
        if (known_all[static_cast<size_t>(q)]) {
          theirs.assign(all.begin() + static_cast<ptrdiff_t>(q) * words,
                        all.begin() + static_cast<ptrdiff_t>(q + 1) * words);
        }
        sharing += MasksOverlap(known ? mask : std::vector<uint64_t>{}, theirs) ? 1 : 0;
      }
    }
  }
  MPI_Comm_free(&local);
  return std::max(1, cores / std::max(1, sharing));
}

}  // namespace ringsplash::comm_internal

#endif  // RINGSPLASH_COMM_MPI_OPS_H_
