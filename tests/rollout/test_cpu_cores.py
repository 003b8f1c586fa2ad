"""vLLM engines on CPU get disjoint cores per rank (a2tgpo/rollout/vllm_engine.py)."""

import pytest

from a2tgpo.rollout.vllm_engine import rank_cpu_cores


@pytest.mark.parametrize(("cores", "size", "want"), [
    # 2 ranks on 2 cores (the rehearsal): one core each, never both on core 0
    ([0, 1], 2, [[0], [1]]),
    # 8 ranks on 64 cores (train.threads 64): 8 contiguous cores each
    (list(range(64)), 8, [list(range(8 * r, 8 * r + 8)) for r in range(8)]),
    # uneven: 5 cores over 2 ranks -> [0, 1] and [2, 3, 4] (floor(r * 5 / 2) boundaries)
    ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3, 4]]),
    # a job's cores need not start at 0 or be contiguous (a cgroup's cpuset)
    ([4, 5, 12, 13], 2, [[4, 5], [12, 13]]),
    # fewer cores than ranks: shared round-robin
    ([3], 2, [[3], [3]]),
])
def test_every_rank_gets_its_own_cores(cores, size, want):
    got = [rank_cpu_cores(cores, r, size) for r in range(size)]
    assert got == want
    if len(cores) >= size:  # disjoint and covering
        assert sorted(c for share in got for c in share) == cores
