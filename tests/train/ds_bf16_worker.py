"""One process (world size 1, gloo, DeepSpeed's CPU accelerator): a bf16 DeepSpeed engine
built from `deepspeed_config(bf16=True)` accumulates 65 backward calls' gradients, and the
gradient norm of the update is printed as `<stage> <variant> <norm>` (tests/train/
test_distributed.py::test_zero_accumulates_bf16_gradients_in_fp32 reads it).

The gradients are chosen so that the accumulation's precision shows: the model is y = w·1
with w in bf16 (4 elements), micro-batch i's loss is Σ c_i·y, so its gradient is c_i on every
element, exactly (a bf16 number times 1). c_0 = 1, then 64 times c = 2^-9: in fp32 the sum is
1 + 64·2^-9 = 1.125 exactly; in bf16 (8 significant bits, spacing 2^-7 at 1) every 1 + 2^-9
rounds back to 1, so the sum stays 1. The norm over the 4 elements is 2·sum: 2.25 or 2.0.

    python ds_bf16_worker.py PORT STAGE [STAGE ...]
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    port, stages = sys.argv[1], [int(s) for s in sys.argv[2:]]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    import deepspeed
    import torch.distributed as dist

    from a2tgpo.train.distributed import deepspeed_config

    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in stages:
        full = deepspeed_config(zero_stage=stage, grad_clip=0.0, bf16=True)
        # the control: DeepSpeed's defaults (accumulate and reduce in the model's dtype)
        plain = {k: v for k, v in full.items() if k not in ("data_types",
                                                            "communication_data_type")}
        for variant, config in (("config", full), ("bf16_default", plain)):
            model = torch.nn.Linear(1, 4, bias=False)
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                config=config)
            x = torch.ones(1, 1, dtype=torch.bfloat16)
            for i in range(65):
                c = 1.0 if i == 0 else 2.0**-9
                engine.backward((engine(x) * c).sum(), scale_wrt_gas=False)
            engine.step()
            print(stage, variant, float(engine.get_global_grad_norm()), flush=True)
            engine.destroy()


if __name__ == "__main__":
    main()
