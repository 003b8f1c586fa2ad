"""Names of the loss settings, without torch: the method table and configs read these, and
reading a config must not import torch (the DAG plans hundreds of cells from them)."""

from typing import Literal

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm")
