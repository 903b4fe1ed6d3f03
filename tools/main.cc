// The `ringsplash` command: attend, bench, demo.
//
// Exit status: 0 success, 1 runtime failure (bad input file, failed check,
// failed rank), 2 usage error (unknown flag, bad flag value or combination).
// Every failure prints exactly one line on stderr: "ringsplash <cmd>: ...".
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include "ringsplash/error.h"
#include "tools/attend.h"
#include "tools/bench.h"
#include "tools/cli_common.h"
#include "tools/demo.h"

#ifndef RINGSPLASH_VERSION
#define RINGSPLASH_VERSION "unknown"
#endif

namespace {

using ringsplash::cli::kExitFailure;
using ringsplash::cli::kExitOk;
using ringsplash::cli::kExitUsage;

// "ringsplash attend" for messages: the subcommand named on the command line.
std::string CommandName(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "attend" || a == "bench" || a == "demo") return "ringsplash " + a;
  }
  return "ringsplash";
}

// One line: newlines inside a message would break "one line on stderr".
void PrintError(const std::string& cmd, const std::string& message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n') c = ' ';
  }
  std::fprintf(stderr, "%s: %s\n", cmd.c_str(), line.c_str());
}

int Run(int argc, char** argv) {
  CLI::App app(
      "ringsplash — exact ring attention over block-sparse flash-attention kernels.\n"
      "Start with `ringsplash demo`; see docs/CLI.md.",
      "ringsplash");
  app.set_version_flag("--version", std::string("ringsplash ") + RINGSPLASH_VERSION);
  app.require_subcommand(0, 1);
  app.footer(
      "\nExamples:\n  ringsplash demo\n  ringsplash bench --seq 4096,8192 --mask causal --ranks "
      "4 --check\n  ringsplash attend --q q.npy --k k.npy --v v.npy --out out.npy --mask "
      "causal");

  ringsplash::cli::AttendArgs attend_args;
  ringsplash::cli::BenchArgs bench_args;
  ringsplash::cli::DemoArgs demo_args;
  CLI::App* attend = ringsplash::cli::AddAttendCommand(app, attend_args);
  CLI::App* bench = ringsplash::cli::AddBenchCommand(app, bench_args);
  CLI::App* demo = ringsplash::cli::AddDemoCommand(app, demo_args);

  // CLI11 would say only "The following argument was not expected".
  const auto named = [&](CLI::App* sub) { return sub->check_name(argv[1]); };
  if (argc > 1 && argv[1][0] != '-' && app.get_subcommands(named).empty()) {
    PrintError("ringsplash", std::string("unknown subcommand '") + argv[1] +
                                 "' (expected demo, attend or bench; see ringsplash --help)");
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    PrintError(CommandName(argc, argv), std::string(e.what()) + " (run with --help for usage)");
    return kExitUsage;
  }
  if (attend->parsed()) {
    ringsplash::cli::RunAttend(attend_args);
    return kExitOk;
  }
  if (bench->parsed()) return ringsplash::cli::RunBench(bench_args);
  if (demo->parsed()) return ringsplash::cli::RunDemo(demo_args);
  std::cout << app.help();
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = CommandName(argc, argv);
  try {
    return Run(argc, argv);
  } catch (const ringsplash::cli::UsageError& e) {
    PrintError(cmd, e.what());
    return kExitUsage;
  } catch (const ringsplash::cli::SilentFailure&) {
    return kExitFailure;
  } catch (const ringsplash::Error& e) {
    PrintError(cmd, e.what());
    return kExitFailure;
  } catch (const std::bad_alloc&) {
    PrintError(cmd, "out of memory");
    return kExitFailure;
  } catch (const std::exception& e) {
    PrintError(cmd, e.what());
    return kExitFailure;
  }
}
