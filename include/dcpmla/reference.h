// Float64 reference over global windows: no ranks, no pages (SPEC §1). Inputs are
// rounded as the system stores them (q to bf16; kv to bf16, then to fp8 when asked).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dcpmla/types.h"

namespace dcpmla {

struct ReferenceResult {
  std::vector<double> out;  // [rows, H, R]
  std::vector<double> lse;  // [rows, H] natural log, -inf for an empty window
};

// q [rows, H, D] and the results' rows: B x qlen, or with qlens (one per request, each in
// [0, qlen]) sum(qlens) rows packed by request, request b's windows those of its own qlens[b].
// kv [B, max_len, D]. Throws dcpmla::Error naming the field on any bad size or span length,
// seq_lens[b] outside [0, max_len] or below its qlen in decode/verify (0 = padding), qlen != 1
// in decode, rank_dim outside [1, D], an unknown mode or dtype, a bad kv_scale, or a
// softmax_scale not finite and > 0. batch = 0 is an empty call. Checks never change the numbers.
// Each thread holds one row's window in float64 (window x D doubles); an allocation that fails
// there is rethrown to the caller (std::bad_alloc), never left to end the process.
ReferenceResult reference_attention(std::span<const float> q, std::span<const float> kv,
                                    std::span<const int32_t> seq_lens, int batch, int qlen,
                                    int heads, int64_t max_len, int dim, Mode mode,
                                    KvDtype kv_dtype, float kv_scale, double softmax_scale,
                                    int rank_dim, std::span<const int32_t> qlens = {});

// Worst per-(request, row) errors of a result against the reference: relative L2 of
// out over (heads, R), absolute lse error (inf == inf counts as 0), NaN count. out / ref_out
// hold [batch x qlen, heads, rank_dim] and lse / ref_lse [batch x qlen, heads], or it throws.
struct ErrorReport {
  double max_rel_l2 = 0;
  double max_lse_err = 0;
  int64_t nan_count = 0;
  bool within(double bound) const { return nan_count == 0 && max_rel_l2 <= bound && max_lse_err <= bound; }
};
ErrorReport compare(std::span<const float> out, std::span<const float> lse,
                    std::span<const double> ref_out, std::span<const double> ref_lse, int batch,
                    int qlen, int heads, int rank_dim);

}  // namespace dcpmla
