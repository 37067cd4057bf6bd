"""What a forced split_k must cut in the tests: the planner cuts a request only where rank 0
(which holds the most of every window) has at least two pieces' worth of 64-token tiles of
it (src/plan.cpp). Not part of the float64 reference: it is the planner's rule, not the
contract's."""

from __future__ import annotations

import dcpmla

# A forced split_k in the tests runs with pieces of at least this many tokens (the library's
# default is 256), so that rows of a few hundred tokens are cut too.
SPLIT_MIN_SEGMENT = 16


def cuttable(lens, qlens, world, interleave, min_segment=SPLIT_MIN_SEGMENT):
    """Whether some request with query rows has, on rank 0, at least two pieces' worth of
    64-token tiles: a forced split_k over such lengths must cut, and over shorter ones cannot."""
    floor_tiles = -(-min_segment // 64)
    return any(n > 0 and -(-dcpmla.local_length(int(L), world, 0, interleave) // 64) >= 2 * floor_tiles
               for L, n in zip(lens, qlens))
