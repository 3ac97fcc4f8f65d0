// Index math shared by the CPU and CUDA copies between per-layer caches and the canonical layout.
//
// Canonical chunk layout (DESIGN.md decision 6): contiguous [layers, 2 (K,V), tokens, kv_heads,
// head_dim]. A model's cache is a table of 2*layers tensors (index layer*2 + kv), each shaped
// [kv_heads, seq, head_dim] (batch 1) with arbitrary head/seq strides and a contiguous head_dim.
#pragma once

#include "kdn/common.h"

namespace kdn {

struct KvShape {
  int64_t layers;
  int64_t tokens;    // tokens in the canonical chunk
  int64_t kv_heads;
  int64_t head_dim;
};

// Where the model-side tensors live: one pointer and (head, seq) strides in elements per tensor.
struct KvTable {
  void* const* ptrs;        // 2 * layers pointers
  const int64_t* strides;   // 2 * layers * 2 values: head stride, seq stride
};

KDN_HD int64_t canonical_offset(const KvShape& s, int64_t layer, int64_t kv, int64_t token,
                                int64_t head, int64_t dim) {
  return (((layer * 2 + kv) * s.tokens + token) * s.kv_heads + head) * s.head_dim + dim;
}

KDN_HD int64_t cache_offset(const KvTable& t, int64_t tensor, int64_t seq, int64_t head,
                            int64_t dim) {
  return head * t.strides[2 * tensor] + seq * t.strides[2 * tensor + 1] + dim;
}

// Decompose a flat canonical element index into (tensor = layer*2+kv, token, head, dim).
KDN_HD void canonical_unravel(const KvShape& s, int64_t index, int64_t* tensor, int64_t* token,
                              int64_t* head, int64_t* dim) {
  *dim = index % s.head_dim;
  index /= s.head_dim;
  *head = index % s.kv_heads;
  index /= s.kv_heads;
  *token = index % s.tokens;
  *tensor = index / s.tokens;
}

}  // namespace kdn
