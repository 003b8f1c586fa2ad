"""Why a trajectory failed: one outcome per scored trajectory, for the metrics and the plots.

Every trajectory gets exactly one outcome, the first of these that applies:

  correct        exact match with a golden answer
  limit          ended by a limit: the tool-call limit, the total length or a turn's token budget
  format         no readable answer (no protocol marker, an end-of-sequence token, an answer
                 without \\boxed{} / the tags), or one the style's format check refuses (the
                 training reward's -1)
  not_copied     a golden answer was in a retrieved passage, but the answer given is another
  stopped_early  answered after fewer searches than the question has hops (no hop count known:
                 without any search), and no golden answer was retrieved
  query_missed   searched at least as often as the question has hops, yet no golden answer
                 was ever retrieved: the queries did not name the entities the answer needs

The outcome is read from the trajectory alone (its turns' stops, observations, answer) plus the
question's hop count where the data states it, so the same breakdown works on the toy world and
on the real benchmarks. "Retrieved" is a whole-word match of a normalised golden answer in the
normalised observation text (the EM normalisation): an answer that is merely a substring of a
longer word does not count.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from a2tgpo.algo.rewards import normalize_answer
from a2tgpo.rollout.agent import Question
from a2tgpo.rollout.trajectory import Trajectory

OUTCOMES: tuple[str, ...] = ("correct", "limit", "format", "not_copied", "stopped_early",
                             "query_missed")
LIMIT_STOPS = frozenset({"call_limit", "length", "max_tokens"})


def answer_retrieved(observation_text: str, golden_answers: Sequence[str]) -> bool:
    """Whether a normalised golden answer occurs as whole words in the normalised text."""
    text = f" {normalize_answer(observation_text)} "
    return any(g and f" {g} " in text for g in map(normalize_answer, golden_answers))


def classify(traj: Trajectory, observation_text: str, hops: int | None) -> str:
    """The outcome of one scored trajectory (`extra` holds em and format_ok, as
    `train.episodes.score` writes them); `observation_text` is its decoded observations."""
    if traj.extra["em"] >= 1.0:
        return "correct"
    if traj.turns[-1].stop in LIMIT_STOPS:
        return "limit"
    if traj.extra.get("answer") is None or not traj.extra["format_ok"]:
        return "format"
    if answer_retrieved(observation_text, traj.golden_answers):
        return "not_copied"
    if traj.num_tool_calls < max(1, hops or 0):
        return "stopped_early"
    return "query_missed"


def label_outcomes(trajs: Sequence[Trajectory], tok, questions: Mapping[str, Question]
                   ) -> list[str]:
    """Each scored trajectory's outcome; `tok` decodes the observations, `questions` (by id)
    give the hop counts where the data states them."""
    out = []
    for t in trajs:
        obs = [i for turn in t.turns for i in turn.obs_ids]
        q = questions.get(t.question_id)
        out.append(classify(t, tok.decode(obs, skip_special_tokens=True) if obs else "",
                            None if q is None else q.hops))
    return out


def outcome_shares(outcomes: Sequence[str], hop_types: Sequence[str | None], prefix: str
                   ) -> dict[str, float]:
    """`{prefix}/<outcome>` shares over all trajectories and `{prefix}/<hop type>/<outcome>`
    within each hop type (every outcome listed, zeros included, so curves never have gaps)."""
    out: dict[str, float] = {}
    if not outcomes:
        return out
    by_hop: dict[str, list[str]] = defaultdict(list)
    for o, h in zip(outcomes, hop_types, strict=True):
        if h is not None:
            by_hop[h].append(o)
    for key, group in [("", list(outcomes)), *((f"{h}/", g) for h, g in sorted(by_hop.items()))]:
        counts = Counter(group)
        out.update({f"{prefix}/{key}{o}": counts[o] / len(group) for o in OUTCOMES})
    return out


def outcome_metrics(trajs: Sequence[Trajectory], tok, questions: Mapping[str, Question],
                    prefix: str) -> dict[str, float]:
    """The outcome shares of scored trajectories, overall and by their questions' hop type."""
    hop_types = [getattr(questions.get(t.question_id), "hop_type", None) for t in trajs]
    return outcome_shares(label_outcomes(trajs, tok, questions), hop_types, prefix)
