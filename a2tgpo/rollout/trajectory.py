"""Typed trajectories with explicit turns, and their collation into a training batch.

Token ids are the source of truth. A `Turn` holds the ids the engine sampled (exactly as
sampled, stop string included) with their log-probabilities, then the ids of the observation
appended after them (retrieved passages, tool messages; never trained on). A `Trajectory` is
the prompt ids plus its turns. `TrajectoryBuilder` checks, turn by turn, that what the engine
was given equals everything so far (the prefix invariant whose violation is "retokenisation
drift"). `collate` builds the `Batch` the trainer consumes, with the loss mask 1 exactly on
sampled tokens and an explicit turn id on every token (−1 outside sampled turns), so turns are
never inferred from mask runs or equal advantages.

Shape legend: B trajectories, L tokens (padded), K turns (max over the batch).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from a2tgpo.algo.types import TreePath

if TYPE_CHECKING:  # torch is imported where batches are built: configs stay import-light
    import torch


TurnStop = Literal[
    "search",      # ended with a search call; an observation follows
    "answer",      # ended with </answer>
    "eos",         # the end-of-sequence token without an answer
    "max_tokens",  # the per-turn token limit
    "length",      # the total-length limit (prompt + response, observations included)
    "call_limit",  # a tool call beyond the limit
    "invalid",     # stopped on nothing the protocol understands
]


@dataclass(frozen=True)
class Turn:
    """One model action plus the observation that followed it."""

    action_ids: tuple[int, ...]
    action_logprobs: tuple[float, ...]
    obs_ids: tuple[int, ...] = ()
    stop: TurnStop = "answer"
    query: str | None = None  # the search query, when the turn called the tool
    entropy: float | None = None  # mean −log π of the sampled tokens (AT2PO node entropy)

    def __post_init__(self) -> None:
        if len(self.action_ids) != len(self.action_logprobs):
            raise ValueError(f"turn has {len(self.action_ids)} sampled ids but "
                             f"{len(self.action_logprobs)} logprobs")
        if not self.action_ids:
            raise ValueError("a turn needs at least one sampled token")


@dataclass(frozen=True)
class Trajectory:
    """A prompt and its turns, plus what credit assignment needs."""

    prompt_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    question_id: str
    group_id: Hashable
    golden_answers: tuple[str, ...] = ()
    reward: float | None = None
    tree: TreePath | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.tree is not None and len(self.tree.nodes) != len(self.turns) + 1:
            raise ValueError("a tree path has one node per turn plus the root")

    @property
    def num_tool_calls(self) -> int:
        return sum(1 for t in self.turns if t.stop == "search")

    def prefix_ids(self, k: int) -> list[int]:
        """prompt + a_1 + o_1 + … + a_k + o_k: what the engine saw before turn k+1 (0-based k)."""
        ids = list(self.prompt_ids)
        for t in self.turns[:k]:
            ids += t.action_ids + t.obs_ids
        return ids

    def token_ids(self) -> list[int]:
        return self.prefix_ids(len(self.turns))

    def response_ids(self) -> list[int]:
        """Everything after the prompt: actions and observations, in order. The reward reads
        the turns one by one instead (`a2tgpo.train.episodes.response_of`)."""
        return self.token_ids()[len(self.prompt_ids):]

    def response_length(self) -> int:
        return sum(len(t.action_ids) + len(t.obs_ids) for t in self.turns)

    def probe_points(self) -> list[int]:
        """Prefix lengths at which information gain is probed: after the prompt, then after each
        tool call's observation (algorithms.md §9.3, the paper's reading)."""
        points, n = [len(self.prompt_ids)], len(self.prompt_ids)
        for t in self.turns:
            n += len(t.action_ids) + len(t.obs_ids)
            if t.stop == "search":
                points.append(n)
        return points


class TrajectoryBuilder:
    """Appends turns while checking the prefix invariant; `build()` freezes the trajectory."""

    def __init__(self, prompt_ids: Sequence[int], *, question_id: str, group_id: Hashable,
                 golden_answers: Sequence[str] = ()):
        self.prompt_ids = tuple(prompt_ids)
        self.turns: list[Turn] = []
        self.question_id, self.group_id = question_id, group_id
        self.golden_answers = tuple(golden_answers)
        self._ids = list(self.prompt_ids)
        self.node_ids: list[int] = []  # tree node of each turn (tree rollouts assign them)

    @property
    def ids(self) -> list[int]:
        """Everything so far: the input of the next engine call."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def add_turn(self, turn: Turn, engine_input: Sequence[int]) -> None:
        """Append `turn`, which the engine sampled from `engine_input`."""
        if list(engine_input) != self._ids:
            # strict=False: the lengths may differ; past the shorter one the default applies
            first = next((i for i, (a, b) in enumerate(zip(engine_input, self._ids, strict=False))
                          if a != b),
                         min(len(engine_input), len(self._ids)))
            raise AssertionError(
                f"{self.question_id}: engine input of turn {len(self.turns) + 1} differs from "
                f"the trajectory so far at token {first} (lengths {len(engine_input)} vs "
                f"{len(self._ids)}): tokens were changed between turns")
        self.turns.append(turn)
        self._ids += list(turn.action_ids) + list(turn.obs_ids)

    def branch(self, k: int) -> TrajectoryBuilder:
        """A new builder holding this one's prompt and first `k` turns (the same ids, shared
        by reference): a tree branch that continues from turn k's observation."""
        if not 0 <= k <= len(self.turns):
            raise ValueError(f"cannot branch after turn {k} of {len(self.turns)}")
        other = TrajectoryBuilder(self.prompt_ids, question_id=self.question_id,
                                  group_id=self.group_id, golden_answers=self.golden_answers)
        for turn in self.turns[:k]:
            other.add_turn(turn, other.ids)
        other.node_ids = list(self.node_ids[:k])
        return other

    def build(self, **fields) -> Trajectory:
        return Trajectory(self.prompt_ids, tuple(self.turns), self.question_id, self.group_id,
                          self.golden_answers, **fields)


# --------------------------------------------------------------------------------------------
# collation


@dataclass
class Batch:
    """Right-padded training tensors of B trajectories.

    input_ids, attention_mask, loss_mask, turn_id, position_ids, rollout_logprobs: (B, L);
    loss_mask is 1 exactly on sampled tokens; turn_id is the 0-based turn of a sampled token and
    −1 on prompt, observation and padding; rollout_logprobs is the engine's log-prob of each
    sampled token (0 elsewhere), to compare with the trainer's. turn_mask (B, K): turn k
    exists; tool_call (B, K): turn k ended with a tool call. prompt_lengths (B,), group_ids:
    one label per row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    turn_id: torch.Tensor
    position_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    turn_mask: torch.Tensor
    tool_call: torch.Tensor
    prompt_lengths: torch.Tensor
    group_ids: list

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_turns(self) -> torch.Tensor:
        """(B,) turns per trajectory, the final one included."""
        return self.turn_mask.sum(1)


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> Batch:
    """Stack trajectories into a `Batch`, checking the mask invariants."""
    import torch

    if not trajectories:
        raise ValueError("nothing to collate")
    B = len(trajectories)
    L = max(len(t.prompt_ids) + t.response_length() for t in trajectories)
    K = max(1, max(len(t.turns) for t in trajectories))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L, dtype=torch.long)
    turn_id = torch.full((B, L), -1, dtype=torch.long)
    logprobs = torch.zeros(B, L, dtype=torch.float32)
    turn_mask = torch.zeros(B, K, dtype=torch.bool)
    tool_call = torch.zeros(B, K, dtype=torch.bool)
    for b, traj in enumerate(trajectories):
        ids = list(traj.prompt_ids)
        mask = [0] * len(ids)
        tid = [-1] * len(ids)
        lp = [0.0] * len(ids)
        for k, turn in enumerate(traj.turns):
            ids += turn.action_ids + turn.obs_ids
            mask += [1] * len(turn.action_ids) + [0] * len(turn.obs_ids)
            tid += [k] * len(turn.action_ids) + [-1] * len(turn.obs_ids)
            lp += list(turn.action_logprobs) + [0.0] * len(turn.obs_ids)
            turn_mask[b, k] = True
            tool_call[b, k] = turn.stop == "search"
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids)
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(mask)
        turn_id[b, :n] = torch.tensor(tid)
        logprobs[b, :n] = torch.tensor(lp)
        sampled = sum(len(t.action_ids) for t in traj.turns)
        if int(loss_mask[b].sum()) != sampled:
            raise AssertionError(f"{traj.question_id}: loss mask covers {int(loss_mask[b].sum())} "
                                 f"tokens but {sampled} were sampled")
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return Batch(input_ids, attention, loss_mask, turn_id, position_ids, logprobs, turn_mask,
                 tool_call, torch.tensor([len(t.prompt_ids) for t in trajectories]),
                 [t.group_id for t in trajectories])
