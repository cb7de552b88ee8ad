// What the AMX paths of cpu/bf16_linear.cpp and cpu/prefill_attention.cpp share: the tile
// configuration's layout and the one-time request for the tile data (Linux lets a process use it
// only once it has asked, with arch_prctl).
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace duet_amx {

// ldtilecfg's 64-byte operand: palette 1, then bytes per row and rows of each tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int64_t rows_, int64_t bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

inline bool available() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

}  // namespace duet_amx

#endif
