"""Pure tensor math of every method: advantages, losses, masks, tree credit, rewards, and the
method table. Imports torch (and the standard library) only, so any trainer can use it.

The advantage entry points (`turn_advantage_tensors`, and the dict wrapper `turn_advantages`)
are loaded on first use, so reading the method table (configs, the DAG's planning) does not
import torch.
"""

__all__ = ["TurnAdvantages", "TurnInputs", "turn_advantage_tensors", "turn_advantages"]


def __getattr__(name: str):
    if name in __all__:
        from a2tgpo.algo import api

        return getattr(api, name)
    raise AttributeError(f"module 'a2tgpo.algo' has no attribute {name!r}")
