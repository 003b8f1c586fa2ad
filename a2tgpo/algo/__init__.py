"""Pure tensor math of every method: advantages, losses, masks, tree credit, rewards, and the
method table. Imports torch (and the standard library) only, so any trainer can use it."""

from a2tgpo.algo.api import TurnAdvantages, turn_advantages

__all__ = ["TurnAdvantages", "turn_advantages"]
