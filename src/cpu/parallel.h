// Whether this process may open an OpenMP parallel region. GNU libgomp's thread pool does not
// survive fork(): a child that opens a region after its parent has run one waits forever for
// pool threads that exist only in the parent (Python's multiprocessing "fork" start method
// after the parent called the CPU engine). So the CPU kernels and the reference open their
// regions with `if (omp_parallel_allowed())`, which is false in any process forked after this
// library was loaded: there they run on the calling thread, as correct and slower.
#pragma once

namespace dcpmla::detail {

bool omp_parallel_allowed();

}  // namespace dcpmla::detail
