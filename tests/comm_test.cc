// The threads communicator backend: ring shifts with several transfers in
// flight, all-reduce, barrier, and failure handling (a peer that throws, a
// peer that never posts) — every failure must end in an Error naming the
// failed rank, never a hang. And the emulated link (LinkModel): its syntax,
// its delays, and that they pass while the ranks are busy elsewhere.
#include "ringsplash/comm.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/error.h"

namespace ringsplash {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A recognisable payload: value depends on (origin rank, shift, index).
int32_t Payload(int origin, int shift, int i) { return origin * 1000003 + shift * 1009 + i; }

class ShiftTest : public ::testing::TestWithParam<int> {};

// Each rank starts `kInFlight` shifts before waiting for any of them, then
// forwards what it received; after t hops rank r holds rank (r - t)'s data.
TEST_P(ShiftTest, SeveralShiftsInFlightDeliverInOrder) {
  const int n = GetParam();
  constexpr int kInFlight = 3;
  constexpr int kRounds = 4;  // kInFlight shifts per round, each its own data
  constexpr int kLen = 257;   // odd length: no alignment luck
  CommOptions opt;
  opt.timeout_s = 30;
  RunThreadRanks(n, opt, [&](Communicator& comm) {
    ASSERT_EQ(comm.size(), n);
    ASSERT_STREQ(comm.backend(), "threads");
    const int r = comm.rank();
    // Slot j carries the data of "stream" j; each round every stream hops once.
    std::vector<std::vector<int32_t>> cur(kInFlight, std::vector<int32_t>(kLen));
    std::vector<std::vector<int32_t>> nxt(kInFlight, std::vector<int32_t>(kLen, -1));
    for (int j = 0; j < kInFlight; ++j)
      for (int i = 0; i < kLen; ++i) cur[j][i] = Payload(r, j, i);
    for (int round = 1; round <= kRounds; ++round) {
      std::vector<Communicator::Handle> handles;
      for (int j = 0; j < kInFlight; ++j) {
        handles.push_back(comm.StartShift(cur[j].data(), nxt[j].data(), kLen * sizeof(int32_t)));
      }
      for (Communicator::Handle h : handles) comm.Wait(h);
      std::swap(cur, nxt);
      const int origin = ((r - round) % n + n) % n;
      for (int j = 0; j < kInFlight; ++j)
        for (int i = 0; i < kLen; ++i) ASSERT_EQ(cur[j][i], Payload(origin, j, i));
    }
  });
}

TEST_P(ShiftTest, AllReduceSumIsIdenticalOnEveryRankAndBarrierPasses) {
  const int n = GetParam();
  std::vector<std::vector<float>> results(n);
  RunThreadRanks(n, CommOptions{}, [&](Communicator& comm) {
    const int r = comm.rank();
    // Values whose float sum depends on the order of addition.
    std::vector<float> data = {1.0f + r, 1e8f * (r % 2 ? 1 : -1), 0.1f * (r + 1), 0.0f};
    comm.Barrier();
    comm.AllReduceSum(data.data(), data.size());
    comm.Barrier();
    results[r] = data;
  });
  double expect0 = 0, expect2 = 0;
  for (int r = 0; r < n; ++r) {
    expect0 += 1.0 + r;
    expect2 += 0.1 * (r + 1);
  }
  for (int r = 0; r < n; ++r) {
    // Bitwise identical across ranks (summed in rank order everywhere).
    EXPECT_EQ(results[r], results[0]) << "rank " << r;
    EXPECT_FLOAT_EQ(results[r][0], static_cast<float>(expect0));
    EXPECT_NEAR(results[r][2], expect2, 1e-5 * n);
    EXPECT_EQ(results[r][3], 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(RingSizes, ShiftTest, ::testing::Values(1, 2, 3, 4, 8));

TEST(CommTest, ZeroByteShiftCompletes) {
  RunThreadRanks(3, CommOptions{},
                 [](Communicator& comm) { comm.Wait(comm.StartShift(nullptr, nullptr, 0)); });
}

TEST(CommTest, RejectsBadArguments) {
  EXPECT_THROW(RunThreadRanks(0, CommOptions{}, [](Communicator&) {}), Error);
  CommOptions bad;
  bad.timeout_s = 0;
  EXPECT_THROW(RunThreadRanks(2, bad, [](Communicator&) {}), Error);
}

// A rank that runs out of memory says so: std::bad_alloc's own what() is
// only "std::bad_alloc".
TEST(CommTest, OutOfMemoryOnARankIsNamed) {
  try {
    RunThreadRanks(3, CommOptions{}, [](Communicator& comm) {
      if (comm.rank() == 1) throw std::bad_alloc();
      comm.Barrier();
    });
    FAIL() << "no Error thrown";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
  }
}

// Null buffers with a non-zero size are argument errors naming the call and
// the argument (not a crash in the copy); null with size 0 stays valid (see
// ZeroByteShiftCompletes).
TEST(CommTest, NullBuffersWithBytesAreErrors) {
  struct Case {
    const char* name;
    void (*call)(Communicator&);
    std::vector<std::string> words;
  };
  const Case cases[] = {
      {"null send",
       [](Communicator& c) {
         std::vector<char> recv(64);
         c.Wait(c.StartShift(nullptr, recv.data(), recv.size()));
       },
       {"StartShift", "send", "null", "64"}},
      {"null recv",
       [](Communicator& c) {
         std::vector<char> send(64);
         c.Wait(c.StartShift(send.data(), nullptr, send.size()));
       },
       {"StartShift", "recv", "null", "64"}},
      {"both null",
       [](Communicator& c) { c.Wait(c.StartShift(nullptr, nullptr, 16)); },
       {"StartShift", "null", "16"}},
      {"all-reduce",
       [](Communicator& c) { c.AllReduceSum(nullptr, 4); },
       {"AllReduceSum", "data", "null", "4"}},
  };
  for (const Case& c : cases) {
    for (int n : {1, 2}) {
      try {
        RunThreadRanks(n, CommOptions{}, c.call);
        ADD_FAILURE() << c.name << ", " << n << " ranks: no Error";
      } catch (const Error& e) {
        const std::string msg = e.what();
        for (const std::string& w : c.words) {
          EXPECT_NE(msg.find(w), std::string::npos) << c.name << ": " << msg;
        }
      }
    }
  }
  RunThreadRanks(2, CommOptions{}, [](Communicator& comm) { comm.AllReduceSum(nullptr, 0); });
}

// Only rank 0 passes a null buffer: its peer, already waiting for the shift,
// is woken by the abort (its message names rank 0's reason), not left to time
// out.
TEST(CommTest, NullBufferOnOneRankFailsItsPeer) {
  CommOptions opt;
  opt.timeout_s = 60;
  std::string peer_message;
  try {
    RunThreadRanks(2, opt, [&](Communicator& comm) {
      std::vector<char> send(64), recv(64);
      if (comm.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let rank 1 post first
        comm.StartShift(send.data(), nullptr, 64);
        return;
      }
      try {
        comm.Wait(comm.StartShift(send.data(), recv.data(), 64));
      } catch (const Error& e) {
        peer_message = e.what();
        throw;
      }
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 0 failed: StartShift: recv is null but bytes = 64");
  }
  EXPECT_NE(peer_message.find("rank 0 failed: StartShift"), std::string::npos) << peer_message;
}

TEST(CommTest, MismatchedShiftSizesFailBothRanks) {
  try {
    RunThreadRanks(2, CommOptions{}, [](Communicator& comm) {
      std::vector<char> send(64), recv(64);
      const size_t bytes = comm.rank() == 0 ? 64 : 32;
      comm.Wait(comm.StartShift(send.data(), recv.data(), bytes));
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bytes but rank"), std::string::npos) << msg;
  }
}

// A rank that throws while its peers are blocked in Wait: every peer wakes
// up, RunThreadRanks rethrows naming the failed rank and its reason, long
// before the (large) timeout.
TEST(CommTest, ThrowingRankAbortsPeersQuickly) {
  for (int n : {2, 3, 8}) {
    CommOptions opt;
    opt.timeout_s = 60;
    std::atomic<int> peers_failed{0};
    const Clock::time_point start = Clock::now();
    try {
      RunThreadRanks(n, opt, [&](Communicator& comm) {
        std::vector<char> send(1024), recv(1024);
        if (comm.rank() == n - 1) {
          comm.Wait(comm.StartShift(send.data(), recv.data(), send.size()));
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          throw Error("deliberate failure");
        }
        try {
          // A slow peer (e.g. under ASan) may still be in this first shift
          // when rank n-1 fails, so it counts too.
          comm.Wait(comm.StartShift(send.data(), recv.data(), send.size()));
          // Blocks: rank n-1 never posts this shift / joins this barrier.
          if (comm.rank() % 2) {
            comm.Barrier();
          } else {
            comm.Wait(comm.StartShift(send.data(), recv.data(), send.size()));
          }
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(n - 1) + " failed"),
                    std::string::npos)
              << e.what();
          ++peers_failed;
          throw;
        }
      });
      FAIL() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "rank " + std::to_string(n - 1) + " failed: deliberate failure");
    }
    const double seconds = SecondsSince(start);
    EXPECT_EQ(peers_failed.load(), n - 1);
    // Detection does not rely on the timeout (60 s); the printed latency is
    // the measured fault-detection time.
    EXPECT_LT(seconds, opt.timeout_s / 2);
    std::printf("[ abort ] %d ranks: failure seen by all peers after %.1f ms\n", n,
                seconds * 1e3 - 20);
  }
}

// A peer that neither posts nor fails: the waiting rank times out with a
// message naming itself, the peer and the shift.
TEST(CommTest, SilentPeerTimesOut) {
  CommOptions opt;
  opt.timeout_s = 0.2;
  const Clock::time_point start = Clock::now();
  try {
    RunThreadRanks(2, opt, [&](Communicator& comm) {
      std::vector<char> send(16), recv(16);
      if (comm.rank() == 0) {
        comm.Wait(comm.StartShift(send.data(), recv.data(), 16));
        comm.Wait(comm.StartShift(send.data(), recv.data(), 16));
      } else {
        comm.Wait(comm.StartShift(send.data(), recv.data(), 16));
        std::this_thread::sleep_for(std::chrono::milliseconds(600));  // "hung"
      }
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "rank 0 failed: timed out after 0.2 s waiting for rank 1 in shift #1");
  }
  EXPECT_GE(SecondsSince(start), 0.2);
}

TEST(CommTest, SilentPeerTimesOutInAllReduce) {
  CommOptions opt;
  opt.timeout_s = 0.2;
  try {
    RunThreadRanks(3, opt, [&](Communicator& comm) {
      if (comm.rank() == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        return;
      }
      float x = 1;
      comm.AllReduceSum(&x, 1);
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("timed out after 0.2 s waiting for rank(s) 2 in all-reduce #0"),
              std::string::npos)
        << msg;
  }
}

// A peer that returned without posting: detected at once, not after the timeout.
TEST(CommTest, PeerThatReturnedIsDetectedWithoutTimeout) {
  CommOptions opt;
  opt.timeout_s = 60;
  const Clock::time_point start = Clock::now();
  try {
    RunThreadRanks(2, opt, [&](Communicator& comm) {
      if (comm.rank() == 1) return;
      std::vector<char> buf(8);
      comm.Wait(comm.StartShift(buf.data(), buf.data(), 0));
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 0 failed: rank 1 returned without posting shift #0");
  }
  EXPECT_LT(SecondsSince(start), 30.0);
}

TEST(CommTest, AbortBeforeThrowNamesTheAbortingRank) {
  try {
    RunThreadRanks(4, CommOptions{}, [](Communicator& comm) {
      if (comm.rank() == 2) {
        comm.Abort("injected");
        throw Error("something after the abort");
      }
      comm.Barrier();
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 2 failed: injected");
  }
}

TEST(CommTest, WaitingTwiceOnAHandleIsAnError) {
  try {
    RunThreadRanks(1, CommOptions{}, [](Communicator& comm) {
      int a = 1, b = 0;
      const Communicator::Handle h = comm.StartShift(&a, &b, sizeof(int));
      comm.Wait(h);
      EXPECT_EQ(b, 1);  // N = 1: the ring shift is a copy to self
      comm.Wait(h);
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already waited for shift #0"), std::string::npos)
        << e.what();
  }
}

TEST(CommTest, MpiStubOrBackendReportsAvailability) {
  if (MpiAvailable()) GTEST_SKIP() << "MPI backend built in; covered by tests/mpi";
  try {
    MakeMpiCommunicator(CommOptions{});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no MPI backend"), std::string::npos);
  }
}

// ---- The emulated link ------------------------------------------------------

TEST(LinkModelTest, ParsesMicrosecondsAndGigabytesPerSecond) {
  const LinkModel a = LinkModel::Parse("5,25");
  EXPECT_DOUBLE_EQ(a.latency_seconds, 5e-6);
  EXPECT_DOUBLE_EQ(a.bandwidth_bytes_per_second, 25e9);
  EXPECT_DOUBLE_EQ(a.MessageSeconds(1000000), 5e-6 + 4e-5);
  const LinkModel b = LinkModel::Parse("50000");  // latency only
  EXPECT_DOUBLE_EQ(b.latency_seconds, 0.05);
  EXPECT_EQ(b.bandwidth_bytes_per_second, 0.0);
  EXPECT_DOUBLE_EQ(b.MessageSeconds(size_t{1} << 30), 0.05);
  EXPECT_TRUE(b.active());
  const LinkModel c = LinkModel::Parse("0,0.5");  // bandwidth only
  EXPECT_DOUBLE_EQ(c.MessageSeconds(1000), 2e-6);
  EXPECT_TRUE(c.active());
  EXPECT_FALSE(LinkModel{}.active());
  for (const char* bad :
       {"", ",", "-1", "5,", "5,0", "5,-2", "x", "5,25,1", "1e999", "5;25", "nan", "5,inf", " 5"}) {
    try {
      LinkModel::Parse(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("LATENCY_US,GBPS"), std::string::npos) << e.what();
    }
  }
}

// RINGSPLASH_LINK is the default of CommOptions::link; a value that does not
// parse is an Error naming the variable (a typo must not silently run an
// undelayed link), and an explicit LinkModel{} overrides it.
TEST(LinkModelTest, EnvironmentIsTheDefaultAndIsChecked) {
  ASSERT_EQ(setenv("RINGSPLASH_LINK", "70000", 1), 0);
  EXPECT_DOUBLE_EQ(LinkModel::FromEnv().value().latency_seconds, 0.07);
  auto shift_seconds = [](const CommOptions& opt) {
    double seconds = 0;
    RunThreadRanks(2, opt, [&](Communicator& comm) {
      int a = comm.rank(), b = -1;
      const Clock::time_point t = Clock::now();
      comm.Wait(comm.StartShift(&a, &b, sizeof a));
      if (comm.rank() == 0) seconds = SecondsSince(t);
    });
    return seconds;
  };
  EXPECT_GE(shift_seconds(CommOptions{}), 0.07);
  CommOptions none;
  none.link = LinkModel{};
  EXPECT_LT(shift_seconds(none), 0.07);  // a sleep never returns early; this has none
  ASSERT_EQ(setenv("RINGSPLASH_LINK", "5,fast", 1), 0);
  try {
    RunThreadRanks(2, CommOptions{}, [](Communicator&) {});
    ADD_FAILURE() << "no Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RINGSPLASH_LINK"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("5,fast"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(shift_seconds(none));  // the explicit option wins, the variable is not read
  ASSERT_EQ(unsetenv("RINGSPLASH_LINK"), 0);
  EXPECT_FALSE(LinkModel::FromEnv().has_value());
  CommOptions bad;
  bad.link = LinkModel{-1e-3, 0};
  EXPECT_THROW(RunThreadRanks(2, bad, [](Communicator&) {}), Error);
  bad.link = LinkModel{0, -5};
  EXPECT_THROW(RunThreadRanks(2, bad, [](Communicator&) {}), Error);
}

// Each message arrives no earlier than latency + bytes / bandwidth after it
// could start, and one link carries one message at a time: two messages in
// flight on it take twice the bandwidth term but one latency. Only lower
// bounds and "less than the serialised sum" are asserted: a sleep can
// overshoot on a loaded machine but never undershoot, and the pipelined
// latency would need 100 ms of scheduling delay to look serialised.
TEST(LinkModelTest, DelaysEachMessageAndSharesBandwidth) {
  constexpr size_t kBytes = 1 << 20;
  struct Case {
    const char* name;
    LinkModel link;
    int in_flight;
    double at_least, below;
  };
  const Case cases[] = {
      {"latency 100 ms", {0.1, 0}, 1, 0.1, 1e9},
      {"1 MiB at 20 MB/s", {0, 20e6}, 1, kBytes / 20e6, 1e9},
      // Two messages: the second leaves when the first has left.
      {"2 x 1 MiB at 20 MB/s", {0, 20e6}, 2, 2 * kBytes / 20e6, 1e9},
      // Latency is paid once by messages in flight together (serialised
      // it would be 200 ms).
      {"2 messages, latency 100 ms", {0.1, 0}, 2, 0.1, 0.2},
  };
  for (const Case& c : cases) {
    CommOptions opt;
    opt.link = c.link;
    std::vector<double> seconds(2);
    RunThreadRanks(2, opt, [&](Communicator& comm) {
      std::vector<std::vector<char>> send(2, std::vector<char>(kBytes, 'a' + comm.rank()));
      std::vector<std::vector<char>> recv(2, std::vector<char>(kBytes));
      comm.Barrier();
      const Clock::time_point t = Clock::now();
      std::vector<Communicator::Handle> h;
      for (int i = 0; i < c.in_flight; ++i) {
        h.push_back(comm.StartShift(send[i].data(), recv[i].data(), kBytes));
      }
      for (Communicator::Handle x : h) comm.Wait(x);
      seconds[static_cast<size_t>(comm.rank())] = SecondsSince(t);
      for (int i = 0; i < c.in_flight; ++i) {
        EXPECT_EQ(recv[i][kBytes - 1], 'a' + (1 - comm.rank()));
      }
    });
    for (double s : seconds) {
      EXPECT_GE(s, c.at_least) << c.name;
      EXPECT_LT(s, c.below) << c.name;
    }
  }
}

// The point of the model: the delay passes while the ranks compute (here: a
// sleep, so that the check does not depend on free cores), so a transfer
// started before 200 ms of "compute" is ready after it. A ring of one sends
// to itself over no link: not delayed.
TEST(LinkModelTest, DelayPassesWhileRanksAreBusyAndSelfSendsAreFree) {
  constexpr double kLatency = 0.1;
  CommOptions opt;
  opt.link = LinkModel{kLatency, 0};
  std::vector<double> exposed(2);
  RunThreadRanks(2, opt, [&](Communicator& comm) {
    int a = comm.rank(), b = -1;
    const Communicator::Handle h = comm.StartShift(&a, &b, sizeof a);
    std::this_thread::sleep_for(std::chrono::duration<double>(2 * kLatency));
    const Clock::time_point w = Clock::now();
    comm.Wait(h);
    exposed[static_cast<size_t>(comm.rank())] = SecondsSince(w);
    EXPECT_EQ(b, 1 - comm.rank());
  });
  // Ready 100 ms before the wait; 50 ms is room for scheduling delay.
  for (double e : exposed) EXPECT_LT(e, kLatency / 2);
  opt.link = LinkModel{30.0, 0};
  const Clock::time_point start = Clock::now();
  RunThreadRanks(1, opt, [](Communicator& comm) {
    int a = 7, b = 0;
    comm.Wait(comm.StartShift(&a, &b, sizeof a));
    EXPECT_EQ(b, 7);
  });
  EXPECT_LT(SecondsSince(start), 15.0);
}

// A delay beyond the timeout is a timeout, and the world ends promptly (the
// delivery thread sleeping until the modelled arrival is woken).
TEST(LinkModelTest, DelayBeyondTheTimeoutTimesOut) {
  CommOptions opt;
  opt.timeout_s = 0.2;
  opt.link = LinkModel{30.0, 0};
  const Clock::time_point start = Clock::now();
  try {
    RunThreadRanks(2, opt, [](Communicator& comm) {
      int a = 0, b = 0;
      comm.Wait(comm.StartShift(&a, &b, sizeof a));
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out after 0.2 s"), std::string::npos) << e.what();
  }
  EXPECT_LT(SecondsSince(start), 15.0);
}

}  // namespace
}  // namespace ringsplash
