// Links against the installed dcpmla: the DCP layout must deal every position of a
// window to exactly one rank (SPEC §2: sum_r n_r(w) = w), and bad input must throw.
#include <cstdio>
#include <initializer_list>

#include <dcpmla/error.h>
#include <dcpmla/layout.h>

int main() {
  int failures = 0;
  for (int world_size : {1, 2, 4, 8}) {
    for (int interleave : {1, 2, 16}) {
      for (long long w : {0LL, 1LL, 5LL, 63LL, 64LL, 1000LL, 4097LL}) {
        dcpmla::Layout layout{world_size, 0, interleave};
        layout.validate();
        long long sum = 0;
        for (int r = 0; r < world_size; ++r) sum += layout.local_length_of(w, r);
        if (sum != w) {
          std::fprintf(stderr, "N=%d I=%d w=%lld: local lengths sum to %lld\n", world_size,
                       interleave, w, sum);
          ++failures;
        }
      }
    }
  }
  // validate() lives in the library (not inline), so this also proves it linked.
  try {
    dcpmla::Layout{4, 4, 1}.validate();
    std::fprintf(stderr, "rank 4 of 4 was accepted\n");
    ++failures;
  } catch (const dcpmla::Error&) {
  }
  std::printf("install check: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
