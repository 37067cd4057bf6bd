// The results files' command line (bench/results_json.h), on the host: the record names the
// program and its --json file by their file names and keeps every other word as given, so a
// varlen --shape (lengths joined by '/') can be run again from the record. Registered in
// bench/CMakeLists.txt, where the bench's nlohmann-json is found (no GPU, no label: CI runs it).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "results_json.h"

namespace {

std::string command(std::vector<std::string> words) {
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  return dcpmla::results::command_line(int(argv.size()), argv.data());
}

TEST(ResultsCommandLine, KeepsAVarlenShapeWhole) {
  EXPECT_EQ(command({"/build/bench/dcpmla_bench", "--no-baseline", "--shape", "3:4641/45118/1730:16:4,2:7/9:128:1",
                     "--json", "/tmp/out/varlen.json"}),
            "dcpmla_bench --no-baseline --shape 3:4641/45118/1730:16:4,2:7/9:128:1 --json varlen.json");
}

TEST(ResultsCommandLine, NamesTheJsonFileByItsFileNameInBothForms) {
  EXPECT_EQ(command({"./dcpmla_dcp_bench", "--json=/a/b/c.json", "--runs", "15"}),
            "dcpmla_dcp_bench --json=c.json --runs 15");
  EXPECT_EQ(command({"dcpmla_wgmma_probe", "--json", "probe.json"}), "dcpmla_wgmma_probe --json probe.json");
}

}  // namespace
