"""`a2tgpo train` that pauses at a chosen moment until its stop request arrives, so a test
knows where a signal sent to the whole job lands (test_vllm_ranks.py).

    A2TGPO_PAUSE=<phase>:<step> A2TGPO_PAUSE_DIR=<dir> python paused_job.py train CONFIG

At the moment, each rank writes <dir>/<phase>.rank<RANK> and waits (at most 10 minutes) until
the trainer's signal handler has recorded a stop request, then goes on as `a2tgpo train` would.
<step> is the step being made, numbered as the log numbers steps (the first is 1). Phases:

  rollout  in the step's first rollout wave, after its stop check, as vLLM's generate starts
           (`LLM.generate`; per trajectory: the first `VllmEngine.submit`): the engine is
           asked for the wave (the first request) after the signal. (Inside the
           engine's own work the moment could not be pinned: the toy's requests are done
           within milliseconds, before a signal sent on the marker lands.)
  update   before the step's policy update (after its rollouts and log-prob passes)

Without A2TGPO_PAUSE it is `a2tgpo train`. Imports stay inside functions: vLLM's spawned
processes import this file as their main module.
"""

import os
import sys
import time
from pathlib import Path

PAUSE_S = 600


def _pause(phase: str) -> None:
    from a2tgpo.ops.preemption import stop_requested

    marker = Path(os.environ["A2TGPO_PAUSE_DIR"]) / f"{phase}.rank{os.environ.get('RANK', '0')}"
    marker.write_text(str(os.getpid()))
    deadline = time.monotonic() + PAUSE_S
    while not stop_requested() and time.monotonic() < deadline:
        time.sleep(0.05)


def _install(phase: str, step: int) -> None:
    from a2tgpo.train import rl

    making = {"step": None}  # the step train_step is making, numbered from 1
    train_step = rl.train_step

    def marked_train_step(run, index):
        making["step"] = index + 1
        try:
            return train_step(run, index)
        finally:
            making["step"] = None

    rl.train_step = marked_train_step
    if phase == "update":
        update_policy = rl.update_policy

        def paused_update_policy(*args, **kwargs):
            if making["step"] == step:
                _pause(phase)
            return update_policy(*args, **kwargs)

        rl.update_policy = paused_update_policy
    elif phase == "rollout":
        from vllm import LLM

        from a2tgpo.rollout.vllm_engine import VllmEngine

        paused = []

        def pausing(call):
            def paused_call(self, *args, **kwargs):
                if making["step"] == step and not paused:
                    paused.append(True)
                    _pause(phase)
                return call(self, *args, **kwargs)
            return paused_call

        # a wave asks `LLM.generate`; the per-trajectory schedule submits one request at a time
        LLM.generate = pausing(LLM.generate)
        VllmEngine.submit = pausing(VllmEngine.submit)
    else:
        raise ValueError(f"A2TGPO_PAUSE: unknown phase {phase!r} (rollout or update)")


if __name__ == "__main__":
    if os.environ.get("A2TGPO_PAUSE"):
        phase, step = os.environ["A2TGPO_PAUSE"].split(":")
        _install(phase, int(step))
    from a2tgpo.cli import main

    sys.exit(main(sys.argv[1:]))
