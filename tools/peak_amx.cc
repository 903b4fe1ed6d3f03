// AMX tile peak loop. Compiled with AMX flags (tools/CMakeLists.txt); only
// called on the amx kernel path once kernels::AmxTilesPermitted() said yes
// (tools/peak.cc).
#include <immintrin.h>

#include <cstdint>

#include "src/kernels/micro/tile_config_amx.h"
#include "tools/peak.h"

namespace ringsplash::cli::peak_detail {

double TileBf16Amx(int64_t iters) {
  // Four independent 16 x 16 f32 accumulator tiles, each TDPBF16PS doing
  // 16 x 16 x 32 bf16 products + adds = 16384 FLOP. Zero inputs: the loop
  // measures issue rate, and zeros keep the accumulators finite.
  kernels::micro::ConfigureTiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  _tile_release();
  volatile float sink = c[0];
  (void)sink;
  return static_cast<double>(iters) * 4 * 16384;
}

}  // namespace ringsplash::cli::peak_detail
