"""The frozen reference policy π_ref of the KL term (rl.py step 6), and where its weights live.

The reference is the starting policy, frozen. Three placements (`train.reference`):

  copy           a frozen copy on the rank's device: 2·P bytes per GPU in bf16 (16.4 GB for
                 Qwen3-8B), the simplest and the only one in one process.
  zero3          a DeepSpeed ZeRO-3 inference engine: each rank keeps 1/world of the weights
                 (2·P/world: 2.0 GB per GPU for Qwen3-8B on 8 ranks) and the forward gathers
                 one layer at a time; the gathered layer is freed after use.
  zero3_offload  the same with the partitions in CPU memory (ZeRO-Infinity parameter
                 offload): next to nothing on the GPU between passes, one PCIe transfer of
                 the weights per reference forward.

Under ZeRO-3 every forward and every gather is a collective, so `logprobs` is called with
this rank's micro-batch plan from `update.micro_batches`, which gives every rank the same
number of micro-batches; an empty micro-batch runs a one-token forward to keep the ranks in
step. The output layer is gathered once per micro-batch, after the decoder, and applied in
chunks (`update.hidden_logprobs`): calling it as a module per chunk would make one collective
per chunk, and ranks with different token counts have different numbers of chunks.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Literal

import torch

from a2tgpo.rollout.trajectory import Batch
from a2tgpo.train.update import final_hidden, hidden_logprobs, row_inputs, row_length

Placement = Literal["copy", "zero3", "zero3_offload"]


def reference_deepspeed_config(*, offload: bool, bf16: bool) -> dict:
    """ZeRO-3 for a module that only runs forwards (no optimizer section)."""
    zero: dict = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": bf16}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class ReferencePolicy:
    """log π_ref of a batch's tokens from a frozen copy of `model` placed per `placement`.

    Build it from the starting policy before any update (a resumed run builds it before the
    checkpoint is loaded into `model`). zero3 placements need the process group (DeepSpeed
    backend) and make collectives: every rank calls `logprobs` with its own plan of the same
    length.
    """

    def __init__(self, model: torch.nn.Module, placement: Placement, device) -> None:
        frozen = copy.deepcopy(model).eval()
        for p in frozen.parameters():
            p.requires_grad_(False)
        self.placement, self.device = placement, torch.device(device)
        if placement == "copy":
            self.module = frozen
            return
        if placement not in ("zero3", "zero3_offload"):
            raise ValueError(f"reference placement must be copy, zero3 or zero3_offload, got "
                             f"{placement!r}")
        import deepspeed

        from a2tgpo.train.distributed import init_distributed

        info = init_distributed()
        deepspeed.init_distributed(dist_backend=info.backend)
        config = reference_deepspeed_config(offload=placement == "zero3_offload",
                                            bf16=info.device.type == "cuda")
        self.engine, *_ = deepspeed.initialize(model=frozen, config=config)
        self.module = self.engine.module

    @contextlib.contextmanager
    def _output_layer(self) -> Iterator:
        """The output layer as a function (n, H) -> (n, V), its weight whole for the block."""
        head = self.module.get_output_embeddings()
        if self.placement == "copy":
            yield head
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(head.parameters())):
            yield lambda h: torch.nn.functional.linear(h, head.weight, head.bias)

    @torch.no_grad()
    def logprobs(self, batch: Batch, plan: list[list[int]], share_prefix: bool = False
                 ) -> tuple[list[int], torch.Tensor]:
        """(rows, logp) for this rank's micro-batches `plan`: rows = the plan's rows in order,
        logp (len(rows), L) on CPU, 0 past each micro-batch's longest row."""
        rows = [b for mb in plan for b in mb]
        out = torch.zeros(len(rows), batch.input_ids.shape[1])
        at = 0
        for mb in plan:
            # an empty micro-batch: one token of row 0, so that every rank forwards alike
            take, n = (mb, row_length(batch, mb)) if mb else ([0], 1)
            ids, mask, pos = row_inputs(batch, take, n, self.device)
            hidden = final_hidden(self.module, ids, mask, pos, share_prefix=share_prefix)
            with self._output_layer() as project:
                lp, _ = hidden_logprobs(hidden, ids, project)
            if mb:
                out[at: at + len(mb), :n] = lp.float().cpu()
                at += len(mb)
        return rows, out

    def close(self) -> None:
        if self.placement != "copy":
            self.engine.destroy()
