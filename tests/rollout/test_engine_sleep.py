"""VllmEngine's sleep levels and partial wake-ups without vLLM (a stand-in `LLM`):
`weight_sync: ipc` sleeps at level 2 (the weights dropped) and refuses to wake the KV cache
before an update has replaced them; `bytes` keeps today's level 1 and plain wake-up. The real
engine on a GPU is tests/rollout/test_weight_sync.py."""

import pytest
import torch

from a2tgpo.rollout.vllm_engine import VllmEngine


class LLM:
    """The parts of vllm.LLM that sleep, wake and a weight update call."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, args=()):
        self.calls.append((method, None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))


def _engine(weight_sync):
    eng = VllmEngine.__new__(VllmEngine)
    eng.llm, eng.procs, eng.gone = LLM(), [], None
    eng.sleep_enabled, eng.weight_chunk_bytes, eng.weight_sync = True, 1 << 20, weight_sync
    return eng


def test_ipc_sleeps_at_level_2_and_wakes_weights_then_after_the_update_the_kv_cache():
    eng = _engine("ipc")
    eng.sleep()
    with pytest.raises(RuntimeError, match="while the weights sleep"):
        eng.update_weights({"w": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="dropped"):
        eng.wake()  # the KV cache (and then generation) before the weights are replaced
    eng.wake(("weights",))
    with pytest.raises(RuntimeError, match="dropped"):
        eng.wake(("kv_cache",))
    eng.update_weights({"w": torch.zeros(2)})
    eng.wake()
    assert eng.llm.calls == [("sleep", 2), ("wake_up", ["weights"]),
                             ("a2tgpo_load_shared", None), ("reset_prefix_cache", None),
                             ("wake_up", None)]
    assert not eng.sleeping and not eng.weights_dropped


def test_bytes_keeps_level_1_and_wakes_all_of_it_at_once():
    eng = _engine("bytes")
    eng.sleep()
    eng.wake(("weights",))  # level 1 restores the old weights: all of it wakes, as before
    eng.update_weights({"w": torch.zeros(2)})
    assert eng.llm.calls == [("sleep", 1), ("wake_up", None), ("a2tgpo_receive_weights", None),
                             ("a2tgpo_apply_weights", None), ("reset_prefix_cache", None)]
    with pytest.raises(ValueError, match="subset"):
        _engine("ipc").wake(("weights", "cuda_graphs"))
