// Row-deterministic attention (see attention.cpp).
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

struct AttentionArgs {
  const float* q;       // [M][H][D]
  const float* k;       // [KVH][S][D] (S = rows of the KV buffer; rows [0, L) are read)
  const float* v;       // [KVH][S][D]
  const uint8_t* mask;  // [M][L], 1 = row may attend to that KV row
  float* out;           // [M][H][D]
  int M, H, KVH, D, S, L;
  float scale;
  int threads;
};

void attention_rows(const AttentionArgs& a);

}  // namespace bitmtp_cpu
