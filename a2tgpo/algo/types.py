"""Light types, without torch: the method table and configs read these, and reading a config
must not import torch (the DAG plans hundreds of cells from them)."""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class TreePath:
    """Where a tree leaf sits: its tree, the node ids of its path (root first) and each node's
    entropy. A path of n + 1 nodes is a trajectory of n turns."""

    tree: Hashable
    nodes: Sequence[Hashable]
    entropies: Sequence[float]
