// LinkModel (include/ringsplash/comm.h): parsing, checks and the per-message
// cost. The backends schedule messages with comm_internal::LinkClock.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "src/comm/comm_util.h"

namespace ringsplash {

namespace {

// A finite number filling all of `text`, or false.
bool ParseNumber(const std::string& text, double* value) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  *value = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && std::isfinite(*value);
}

}  // namespace

double LinkModel::OccupySeconds(size_t bytes) const {
  return bandwidth_bytes_per_second > 0 ? static_cast<double>(bytes) / bandwidth_bytes_per_second
                                        : 0.0;
}

void LinkModel::Check(const std::string& what) const {
  ringsplash::Check(std::isfinite(latency_seconds) && latency_seconds >= 0, what,
                    ": latency_seconds must be finite and >= 0, got ", latency_seconds);
  ringsplash::Check(std::isfinite(bandwidth_bytes_per_second) && bandwidth_bytes_per_second >= 0,
                    what, ": bandwidth_bytes_per_second must be finite and > 0 (or 0: unlimited), ",
                    "got ", bandwidth_bytes_per_second);
}

LinkModel LinkModel::Parse(const std::string& text) {
  const size_t comma = text.find(',');
  const std::string latency_text = text.substr(0, comma);
  const std::string bandwidth_text = comma == std::string::npos ? "" : text.substr(comma + 1);
  double latency_us = 0, gbps = 0;
  const bool ok = ParseNumber(latency_text, &latency_us) && latency_us >= 0 &&
                  (comma == std::string::npos || (ParseNumber(bandwidth_text, &gbps) && gbps > 0));
  ringsplash::Check(ok, "link model: expected 'LATENCY_US' or 'LATENCY_US,GBPS' (microseconds ",
                    ">= 0 per message, gigabytes per second > 0), e.g. '5,25', got '", text, "'");
  LinkModel m;
  m.latency_seconds = latency_us * 1e-6;
  m.bandwidth_bytes_per_second = gbps * 1e9;
  return m;
}

std::optional<LinkModel> LinkModel::FromEnv() {
  const char* v = std::getenv("RINGSPLASH_LINK");
  if (v == nullptr || *v == '\0') return std::nullopt;
  try {
    return Parse(v);
  } catch (const Error& e) {
    throw Error(std::string("RINGSPLASH_LINK: ") + e.what());
  }
}

namespace comm_internal {

LinkModel ResolveLink(const CommOptions& options) {
  const LinkModel link = options.link ? *options.link : LinkModel::FromEnv().value_or(LinkModel{});
  link.Check("CommOptions::link");
  return link;
}

Clock::time_point LinkClock::Schedule(const LinkModel& link, Clock::time_point ready,
                                      size_t bytes) {
  const Clock::time_point start = std::max(ready, free_);
  free_ = start + ToDuration(link.OccupySeconds(bytes));
  return free_ + ToDuration(link.latency_seconds);
}

}  // namespace comm_internal

}  // namespace ringsplash
