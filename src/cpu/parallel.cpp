#include "parallel.h"

#include <omp.h>
#include <pthread.h>

#include <atomic>

namespace dcpmla::detail {
namespace {

std::atomic<bool> g_forked_child{false};
// Registered when the library is loaded, so before any fork that could matter.
[[maybe_unused]] const int g_at_fork =
    pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true, std::memory_order_relaxed); });

}  // namespace

bool omp_parallel_allowed() { return !g_forked_child.load(std::memory_order_relaxed); }

int parallel_threads() { return omp_parallel_allowed() ? omp_get_max_threads() : 1; }

}  // namespace dcpmla::detail
