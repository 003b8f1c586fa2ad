"""a2tgpo: reinforcement learning of LLM search agents (A2TGPO, AT2PO and baselines)."""

__version__ = "0.1.0"
