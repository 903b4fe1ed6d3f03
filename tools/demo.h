// `ringsplash demo`: the main job with no arguments — a realistic ring on
// this machine (threads backend), checked against the single-device kernel,
// summarised in a short table (or JSON).
#ifndef RINGSPLASH_TOOLS_DEMO_H_
#define RINGSPLASH_TOOLS_DEMO_H_

#include <cstdint>
#include <string>

namespace CLI {
class App;
}

namespace ringsplash::cli {

struct DemoArgs {
  int64_t seq = 16384;
  int ranks = 4;
  std::string layout = "zigzag";
  std::string mask = "causal";
  std::string dtype = "f32";
  int threads_per_rank = 0;  // 0: the cores each rank may use
  bool json = false;
};

CLI::App* AddDemoCommand(CLI::App& app, DemoArgs& args);
// Returns the exit status: 0, or 1 when the check fails.
int RunDemo(const DemoArgs& args);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_DEMO_H_
