// The rows of the single-GPU DCP benchmark (bench::run_dcp_bench) as results-file JSON
// (results_json.h), for dcpmla_dcp_bench and `dcpmla bench`.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dcp_bench_core.h"
#include "results_json.h"

namespace dcpmla::results {

inline nlohmann::json dcp_rows(const std::vector<bench::DcpBenchRow>& rows, const bench::DcpBenchOptions& o) {
  nlohmann::json out = nlohmann::json::array();
  const std::string kv_suffix = kv_row_suffix(o.kv_dtype);
  for (const auto& r : rows)
    out.push_back({{"name", "dcp_rank_h" + std::to_string(r.heads_local) + "_q" + std::to_string(r.qlen) + "_n" +
                                std::to_string(r.world_size) + kv_suffix},
                   {"batch", o.batch},
                   {"context", o.context},
                   {"heads_local", r.heads_local},
                   {"qlen", r.qlen},
                   {"world_size", r.world_size},
                   {"heads_total", r.heads_total},
                   {"launches", r.groups},
                   {"local_tokens", r.local_tokens},
                   {"kv_dtype", std::string(to_string(o.kv_dtype))},
                   {"route", r.route},
                   {"attention_us", r.attention_us},
                   {"kv_TBps", r.attention_tbps},
                   {"correct_us", r.correct_us},
                   {"correct_GBps", r.correct_gbps},
                   {"reduce_us", r.reduce_us},
                   {"reduce_GBps", r.reduce_gbps},
                   {"pack_us", r.pack_us},
                   {"combine_us", r.combine_us},
                   {"combine_GBps", r.combine_gbps},
                   {"q_bytes", r.q_bytes},
                   {"sent_q_all_gather", r.traffic.q_all_gather},
                   {"sent_lse_all_gather", r.traffic.lse_all_gather},
                   {"sent_reduce_scatter_bf16", r.traffic.reduce_scatter},
                   {"sent_all_to_all", r.traffic.all_to_all}});
  return out;
}

}  // namespace dcpmla::results
