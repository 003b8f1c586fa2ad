"""Worker of test_offload.py: DeepSpeed ZeRO-2 (gloo on CPU, one rank) updates of a tiny Qwen3
with and without the optimizer state offloaded between updates, as rl.train_step does with
train.offload_optimizer (`backend.reload_states()` before the update, `offload_states()` after
it), including a save while offloaded and a resume from it. Prints one JSON line.

    python offload_worker.py
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from a2tgpo.train.distributed import DeepSpeedBackend, shutdown_distributed

UPDATES, SAVE_AFTER = 4, 2


def _backend() -> DeepSpeedBackend:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    return DeepSpeedBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            zero_stage=2, grad_clip=1.0)


def _update(backend: DeepSpeedBackend, u: int) -> float:
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(u))
    backend.backward(backend.model(input_ids=ids, labels=ids).loss)
    return backend.step()


def _weights(backend: DeepSpeedBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.unwrapped.state_dict().items()}


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1")
    plain = _backend()
    norms_plain = [_update(plain, u) for u in range(UPDATES)]
    w_plain = _weights(plain)
    plain.close()

    off = _backend()
    off.offload_states()  # as start_run does before the engine starts
    flags, norms_off = [off.offloaded], []
    with tempfile.TemporaryDirectory() as saved:
        for u in range(UPDATES):
            off.reload_states()
            flags.append(off.offloaded)
            norms_off.append(_update(off, u))
            off.offload_states()
            flags.append(off.offloaded)
            if u + 1 == SAVE_AFTER:
                off.save_state(saved)  # a checkpoint taken while the engine is awake
        w_off = _weights(off)
        off.close()
        resumed = _backend()
        resumed.load_state(saved)
        norms_resumed = [_update(resumed, u) for u in range(SAVE_AFTER, UPDATES)]
        w_resumed = _weights(resumed)
        resumed.close()
    diff = lambda a, b: max(float((a[k] - b[k]).abs().max()) for k in a)  # noqa: E731
    print(json.dumps({"flags": flags, "norms_plain": norms_plain, "norms_offload": norms_off,
                      "norms_resumed": norms_resumed,
                      "offload_vs_plain": diff(w_off, w_plain),
                      "resumed_vs_plain": diff(w_resumed, w_plain),
                      "moved": diff(w_plain, _weights(_backend()))}), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
