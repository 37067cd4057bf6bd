// The schedule's invariants (plan.h), checked on any accepted plan by the unit tests and by
// fuzz_planner alike: returns the first one a plan breaks, or an empty string.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "dcpmla/plan.h"

namespace dcpmla::testing {

inline std::string schedule_error(const PlannerConfig& c, const Plan& plan) {
  const PlanView v = plan.view();
  const PlanHeader& h = *v.header;
  auto bad = [](const std::string& what, int64_t at) { return what + " (at " + std::to_string(at) + ")"; };
  if (h.chunks < 1 || h.chunks > v.chunk_capacity) return bad("chunks outside [1, capacity]", h.chunks);
  if (h.work_count < 0 || h.work_count > v.work_capacity) return bad("work_count outside [0, capacity]", h.work_count);
  if (v.chunk_work[0] != 0 || v.chunk_work[h.chunks] != h.work_count) return bad("chunk offsets do not span the work", 0);
  for (int k = 0; k < h.chunks; ++k)
    if (v.chunk_work[k] > v.chunk_work[k + 1]) return bad("chunk offsets decrease", k);
  if (v.q_start[0] != 0 || v.q_start[h.batch] != h.rows) return bad("query row offsets do not span the rows", 0);
  // A request of fewer than two min_segment_tokens is not cut; the shortest piece allowed is
  // min_segment_tokens, or the even share of the step's tiles over the chunks when that is
  // shorter (at least a tile). In int64: min_segment_tokens may be any positive int (found by
  // fuzz_planner).
  int64_t step_tiles = 0;
  for (int b = 0; b < h.batch; ++b) {
    int32_t longest = 0;
    for (int t = v.q_start[b]; t < v.q_start[b + 1]; ++t) longest = std::max(longest, v.row_local_len[t]);
    step_tiles += (int64_t(longest) + kCutTokens - 1) / kCutTokens;
  }
  const int64_t floor_tiles = (int64_t(c.min_segment_tokens) + kCutTokens - 1) / kCutTokens;
  const int64_t min_tiles = std::clamp<int64_t>(step_tiles / h.chunks, 1, floor_tiles);

  int w = 0, splits = 0, slots = 0, widest = 0;
  for (int b = 0; b < h.batch; ++b) {
    const int q0 = v.q_start[b], qlen = v.q_start[b + 1] - q0;
    if (qlen < 0 || qlen > h.qlen) return bad("a request's query rows outside [0, qlen]", b);
    widest = std::max(widest, qlen);
    if (qlen == 0) {  // no rows: no piece
      if (w < h.work_count && v.work[w].request == b) return bad("a request without rows has a piece", b);
      continue;
    }
    int32_t longest = 0;
    for (int t = 0; t < qlen; ++t) longest = std::max(longest, v.row_local_len[q0 + t]);
    // Its pieces: adjacent, in order, covering [0, longest) once, cut on tile edges.
    const int first = w;
    int32_t next = 0;
    while (w < h.work_count && v.work[w].request == b) {
      const WorkItem& it = v.work[w];
      if (it.tok_begin != next) return bad("pieces leave a gap or overlap", w);
      if (it.tok_begin % kCutTokens != 0) return bad("a cut inside a tile", w);
      if (it.tok_end < it.tok_begin || (it.tok_end == it.tok_begin && longest > 0)) return bad("an empty piece", w);
      next = it.tok_end;
      ++w;
    }
    if (w == first) return bad("a request with rows has no piece", b);
    if (next != longest) return bad("pieces do not end at the request's longest row", b);
    const int pieces = w - first;
    if (pieces == 1) {
      if (v.work[first].slot != -1) return bad("a whole request writes a partial", b);
      continue;
    }
    if (c.route == Route::one_stage) return bad("one_stage cut a request", b);
    if ((int64_t(longest) + kCutTokens - 1) / kCutTokens < 2 * floor_tiles)
      return bad("a request shorter than two min_segment_tokens was cut", b);
    if (splits >= h.split_requests || v.split_request[splits] != b || v.split_slot[splits] != slots)
      return bad("the cut requests' list misses a cut request", b);
    for (int i = first; i < w; ++i) {
      if (v.work[i].slot != slots++) return bad("partial slots are not consecutive", i);
      const int64_t tiles = (int64_t(v.work[i].tok_end) - v.work[i].tok_begin + kCutTokens - 1) / kCutTokens;
      if (tiles < min_tiles) return bad("a piece shorter than min_segment_tokens (or the even share)", i);
    }
    ++splits;
  }
  if (w != h.work_count) return bad("pieces out of request order", w);
  if (splits != h.split_requests || v.split_slot[splits] != slots) return bad("more cut requests listed than cut", splits);
  if (slots > v.work_capacity) return bad("more partial slots than capacity", slots);
  if (h.widest_qlen != widest) return bad("widest_qlen is not the largest request's rows", widest);
  const Route route = Route(h.route);
  if (c.route == Route::automatic && route != (splits > 0 ? Route::split_k : Route::one_stage))
    return bad("the automatic route does not follow the cuts", splits);
  if (c.route != Route::automatic && route != c.route) return bad("a forced route was not kept", int(route));
  return {};
}

}  // namespace dcpmla::testing
