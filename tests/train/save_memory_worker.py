"""Worker of test_checkpoint.py's save-memory test: the resident memory a checkpoint save adds,
for a model wrapped by DeepSpeed ZeRO-2 (gloo on CPU, one rank) as the trainer saves it.

    python save_memory_worker.py --out DIR [--dtype float32|bfloat16]

Under ZeRO-1/2 every parameter is a view of one flat buffer. The measure is the peak resident
memory during `save_checkpoint(model=backend.unwrapped)` (what `rl.save` calls) above the
resident memory just before it: Linux's peak (VmHWM) is reset right before the save by writing
5 to /proc/self/clear_refs. Run with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the
resident set (bench/plan_memory.py does the same). Prints one JSON line: weights_bytes,
growth_bytes, largest_tensor_bytes, shard_bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from a2tgpo.train.checkpoint import save_checkpoint
from a2tgpo.train.distributed import DeepSpeedBackend, shutdown_distributed

# ~91M parameters (12 layers of 7.1M, an 8,192 x 768 embedding tied to the output layer), so
# that no single tensor is a large share of the weights: the largest (the embedding, 6.3M
# elements) is 7% of them
ARCH = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, head_dim=64,
            tie_word_embeddings=True)
SHARD_BYTES = 32 * 2**20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


class _NoTokenizer:
    """The save's tokenizer files are not what is measured."""

    def save_pretrained(self, directory) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**ARCH)).to(getattr(torch, args.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    backend = DeepSpeedBackend(model, opt, zero_stage=2, grad_clip=1.0)
    module = backend.unwrapped
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    largest = max(p.numel() * p.element_size() for p in module.parameters())
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    save_checkpoint(args.out, 0, model=module, tokenizer=_NoTokenizer(), optimizer=None,
                    trainer_state={"step": 0}, keep_last=1, shard_bytes=SHARD_BYTES)
    growth = _status("VmHWM") - before
    print(json.dumps({"weights_bytes": weights, "growth_bytes": growth,
                      "largest_tensor_bytes": largest, "shard_bytes": SHARD_BYTES,
                      "parameter_storages": len(storages)}), flush=True)
    backend.close()
    shutdown_distributed()


if __name__ == "__main__":
    main()
