"""The weight sync's check (rl.sync_engine): after every sync each vLLM engine's weight
checksum must be that of the weights its rank sent, or training stops. The engine here is a
stand-in that reports the checksum of what it applied; the real engine's checksum is
tests/rollout/test_vllm_engine.py."""

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.rollout.weight_checksum import state_checksum
from a2tgpo.train import rl
from a2tgpo.train.config import TrainConfig
from a2tgpo.train.distributed import EnginePlacement, SingleBackend


class Engine:
    """Applies what it is sent (or, stale, nothing after the first) and reports the checksum
    of what it holds; gone: the engine ended after a stop request (reports None)."""

    def __init__(self, stale=False, gone=False):
        self.stale, self.gone, self.held = stale, gone, None

    def update_weights(self, state):
        if self.held is None or not self.stale:
            self.held = state_checksum(state)
        return sum(t.numel() * t.element_size() for t in state.values())  # bytes copied

    def weights_checksum(self):
        return None if self.gone else self.held


def make_run(engine) -> rl.Run:
    cfg = TrainConfig(run_dir="unused", results_dir="unused", method=METHODS["grpo"],
                      backbone=BackboneConfig(id="tiny", path="unused"), train_file="unused",
                      dev_file="unused", corpus="unused", device="cpu", engine="vllm")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return rl.Run(cfg=cfg, backend=SingleBackend(model, optimizer, 1.0),
                  placement=EnginePlacement(hosts_engine=True, group=0, n_groups=1,
                                            devices=(0,)),
                  optimizer=optimizer, scheduler=None, ref=None, tok=None, engine=engine,
                  tool=None, train_qs=[], dev_qs=[], order=None, start=0)


def _train(run):
    with torch.no_grad():
        run.backend.unwrapped.weight.add_(1e-3)  # an update


def test_an_engine_that_holds_the_sent_weights_passes_and_is_logged():
    run = make_run(Engine())
    for _ in range(2):
        _train(run)
        out = rl.sync_engine(run, rl.Clock())
        # Linear(3, 2): 8 float32 weights sent
        assert out == {"engine/sync_bytes": 32.0, "engine/weights_match/rank0": 1.0,
                       "engine/weights_match": 1.0}


def test_a_stale_engine_stops_training_with_the_rank_named():
    run = make_run(Engine(stale=True))
    rl.sync_engine(run, rl.Clock())  # the first sync arrives
    _train(run)
    with pytest.raises(RuntimeError, match=r"vLLM engine of rank\(s\) 0 does not hold"):
        rl.sync_engine(run, rl.Clock())


def test_nothing_is_checked_without_an_engine_to_ask():
    out = rl.sync_engine(make_run(Engine(gone=True)), rl.Clock())
    assert out == {"engine/sync_bytes": 32.0}


class Sleeper(Engine):
    """Records the order of wake and update calls (tags as given)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def wake(self, tags=None):
        self.calls.append(("wake", tags))

    def update_weights(self, state):
        self.calls.append(("update", None))
        return super().update_weights(state)


def test_a_vllm_engine_wakes_its_weights_before_the_sync_and_its_kv_cache_after():
    run = make_run(Sleeper())
    clock = rl.Clock()
    out = rl.wake_and_sync(run, clock)
    assert run.engine.calls == [("wake", ("weights",)), ("update", None), ("wake", None)]
    assert out["engine/weights_match"] == 1.0
    assert {"engine_wake", "weight_sync"} <= set(clock.times)
