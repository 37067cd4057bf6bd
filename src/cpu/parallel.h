// The CPU backend's parallel loops.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>

namespace dcpmla::detail {

// Whether this process may open an OpenMP parallel region. GNU libgomp's thread pool does not
// survive fork(): a child that opens a region after its parent has run one waits forever for
// pool threads that exist only in the parent (Python's multiprocessing "fork" start method
// after the parent called the CPU engine). So the CPU loops open their regions only when this
// is true, which it is not in any process forked after this library was loaded: there they
// run on the calling thread, as correct and slower.
bool omp_parallel_allowed();
// The threads a parallel region here runs on (1 where omp_parallel_allowed() is false).
int parallel_threads();

enum class Schedule { even, dynamic };  // OpenMP's static and dynamic schedules

// body(i) for every i in [0, n), on OpenMP threads. An exception may not leave a parallel
// region (the process would end in std::terminate): the first one a body throws (an
// allocation that fails, say) is kept, the iterations not yet begun are skipped, and it is
// rethrown on the calling thread after the region.
template <class Body>
void parallel_for(int64_t n, Schedule schedule, Body&& body) {
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  const auto step = [&](int64_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
#pragma omp critical(dcpmla_parallel_for_error)
      {
        if (!error) error = std::current_exception();
      }
      failed.store(true, std::memory_order_relaxed);
    }
  };
  if (schedule == Schedule::dynamic) {
#pragma omp parallel for schedule(dynamic) if (omp_parallel_allowed())
    for (int64_t i = 0; i < n; ++i) step(i);
  } else {
#pragma omp parallel for schedule(static) if (omp_parallel_allowed())
    for (int64_t i = 0; i < n; ++i) step(i);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace dcpmla::detail
