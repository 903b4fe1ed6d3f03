// The AMX tile configuration shared by the amx micro-kernels
// (micro/path_amx.cc) and the tile peak loop (tools/peak_amx.cc). Include only
// from translation units compiled with the AMX flags, and run only once
// AmxTilesPermitted() (cpu_features.h) said yes.
#ifndef RINGSPLASH_KERNELS_MICRO_TILE_CONFIG_AMX_H_
#define RINGSPLASH_KERNELS_MICRO_TILE_CONFIG_AMX_H_

#include <immintrin.h>

#include <cstdint>

namespace ringsplash::kernels::micro {

// LDTILECFG's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures tmm0-7 as 16 rows x 64 bytes each (16 x 16 f32, or 16 x 32
// bf16 = 16 pair rows of 16 columns): every tile the kernels use.
//
// Not through _tile_loadconfig: GCC 12's declares only the first 8 bytes of
// the 64-byte operand as read (its asm operand is *(const void**)), so the
// optimiser may drop the stores of `rows` and `colsb` as dead. A test
// program built with -O2 did exactly that: every tile left unconfigured and
// SIGILL at the first tile instruction. Here the whole struct is the operand.
inline void ConfigureTiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = 16;
    config.colsb[i] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(config));
}

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_TILE_CONFIG_AMX_H_
