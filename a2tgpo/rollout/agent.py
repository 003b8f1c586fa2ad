"""The search agent loop: token-in/token-out, in waves or per trajectory (`schedule`).

Each wave, every active trajectory generates one turn, until `</search>`, `</answer>` or an
end-of-sequence token (algorithms.md §10.3). The queries of all trajectories that searched are
sent to the retriever in one call; each result is formatted for the prompt style, tokenised on
its own and appended as observation ids (loss mask 0), truncated to a token budget. Nothing
sampled is ever decoded and re-encoded: decoding is used only to read the query and the answer.

Limits, as the papers' rollouts apply them:
  * tool calls: `max_tool_calls` (6); a further call either ends the episode (A2TGPO: the
    trajectory has no answer, so its reward is -1) or inserts AT2PO's warning and continues;
  * total length: prompt + response with observations (`max_response_tokens` counts every
    response token, sampled or not); reaching it ends the episode ("length");
  * per turn: `max_turn_tokens` sampled tokens ("max_tokens").
An action that ends on none of the protocol's markers is "invalid" (A2TGPO ends the episode;
Search-R1 inserts its "invalid action" message and lets the model try again).

Within a wave, the engine does the batching: the hf engine drops finished rows from its batch,
vLLM refills freed slots by continuous batching, so short turns never wait for long ones.

Schedules (`AgentConfig.schedule`):
  * waves (`rollout_wave`): every live trajectory generates one turn, the wave waits for its
    longest turn, then one retriever call with the wave's queries, then the next wave.
  * trajectory (`run_trajectories`): each trajectory advances on its own. Its turn is a
    request to the engine's `Streaming` interface (a2tgpo.rollout.engine); when the turn ends
    its search goes out with whatever other searches are pending at that moment (one retriever
    call: the in-process retriever batches them, the HTTP server would batch concurrent
    requests the same way), and its next turn is submitted as soon as the observation is
    appended. One driver thread runs every trajectory as a small state machine (submitted →
    generated → searching → submitted …), so no locks guard the builders and everything the
    driver does is in trajectory order whatever order the engine finishes in: results that
    are ready together are handled by trajectory index, searches before new submissions. With
    vLLM (`VllmEngine.submit`), requests run as they come by continuous batching, and the
    engine keeps generating while the driver searches. The hf engine streams through
    `engine.Batching`: pending requests run as one `generate` call when the driver waits, so
    with every trajectory at the same turn its batches are the waves' batches and the
    trajectories are the same, token for token (tests/rollout/test_schedule.py).
Both keep the prompts (a builder's exact ids), the per-(trajectory, turn) seeds `_seed`, the
limits and the stop handling of `_finish_turn`; the trajectory schedule asks each request for
`min(max_turn_tokens, its own room)` tokens where a wave asks for the largest room of the wave
and cuts (the same ids: a row's sampling does not depend on its `max_tokens`). A stop request
(`check_stop`) is read at every wave, and at every step of the driver.

Where the rollout's time goes (`RolloutStats`, on the tool): the engine's busy seconds (a
request in flight), each trajectory's seconds from its first turn's submission to its end, and
the seconds trajectories waited on search (from the query to the appended observation).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from a2tgpo.config import option
from a2tgpo.data import prompts
from a2tgpo.ops.preemption import check_stop
from a2tgpo.retrieval.base import Retriever
from a2tgpo.retrieval.retriever import RetrievalConfig, format_passages
from a2tgpo.rollout.engine import Engine, Generation, SamplingParams, streaming
from a2tgpo.rollout.trajectory import Trajectory, TrajectoryBuilder, Turn

log = logging.getLogger(__name__)

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
CALL_LIMIT_WARNING = (
    " I have reached the tool call limit, so I cannot search anymore. I should provide the "
    "final answer based on the information I have.\n"
)


@dataclass(frozen=True)
class AgentConfig:
    """The rollout loop's limits and sampling (rollout section)."""

    prompt_style: prompts.PromptStyle = option(
        "a2tgpo", "a2tgpo = A2TGPO/AT2PO system prompt, <result>, \\boxed{}; search_r1 = "
        "Search-R1's user prompt and <information>.")
    temperature: float = option(
        1.0, "Sampling temperature of training rollouts (A2TGPO App. B: 1.0); > 0, as sampling "
        "divides by it (validation and evaluation decode greedily, without it).", gt=0)
    top_p: float = option(1.0, "Nucleus sampling mass (1.0 = off).", gt=0, le=1)
    max_turn_tokens: int = option(500, "Sampled tokens per turn (Search-R1: 500).", ge=1)
    max_response_tokens: int = option(
        6192, "Total response tokens, observations included (A2TGPO App. B: 6192).", ge=1)
    max_obs_tokens: int = option(500, "Observation body tokens kept per search (Search-R1: 500).",
                                 ge=0)
    max_tool_calls: int = option(6, "Tool calls per trajectory (A2TGPO/AT2PO: 6).", ge=0)
    at_call_limit: Literal["stop", "warn"] = option(
        "stop", "stop = end the episode (A2TGPO); warn = insert AT2PO's warning and continue.")
    on_invalid: Literal["stop", "retry"] = option(
        "stop", "stop = end the episode (A2TGPO); retry = Search-R1's invalid-action message.")
    schedule: Literal["waves", "trajectory"] = option(
        "waves", "waves = every live trajectory generates one turn, then one search for the "
        "wave; trajectory = each trajectory advances on its own (its search goes out when its "
        "turn ends, its next turn when the observation is appended), the same trajectories on "
        "the hf engine (AEPO's branching stays per wave).")

    # what a search returns is the retrieval section's (one source for rollouts, the server's
    # default and `a2tgpo search`): these keys are refused here with a pointer there
    ELSEWHERE: ClassVar[dict[str, str]] = {
        "topk": "retrieval.topk", "max_passage_chars": "retrieval.max_passage_chars"}

    def __post_init__(self) -> None:
        if min(self.max_turn_tokens, self.max_response_tokens, self.max_obs_tokens) < 1 \
                or self.max_tool_calls < 0:
            raise ValueError("token limits must be >= 1, max_tool_calls >= 0")
        if self.max_turn_tokens > self.max_response_tokens:  # a turn is part of the response
            raise ValueError(f"max_turn_tokens ({self.max_turn_tokens}) exceeds "
                             f"max_response_tokens ({self.max_response_tokens})")


@dataclass(frozen=True)
class Question:
    """One question to roll out (a row of the prepared data)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    hop_type: str | None = None  # as the data states it (failure breakdown by hop type)
    hops: int | None = None


def prompt_ids(tokenizer, question: str, style: prompts.PromptStyle,
               chat_kwargs: dict | None = None) -> list[int]:
    """The question in the prompt template, through the backbone's chat template, as ids."""
    text = tokenizer.apply_chat_template(prompts.build_messages(question, style),
                                         add_generation_prompt=True, tokenize=False,
                                         **(chat_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=False)


def extract_query(text: str) -> str | None:
    """The content of the last <search>…</search> (algorithms.md §10.3), stripped."""
    found = _SEARCH.findall(text)
    return found[-1].strip() if found else None


@dataclass
class RolloutStats:
    """Where rollout time went, summed until `take()` (module docstring; metrics per step)."""

    engine_busy_s: float = 0.0  # wall seconds with at least one generation in flight
    search_wait_s: float = 0.0  # summed over trajectories: query sent -> observation appended
    longest_s: float = 0.0  # the longest trajectory: first turn submitted -> its end
    trajectories: int = 0  # trajectories ended
    _started: dict[int, float] = field(default_factory=dict, repr=False)  # id(builder) -> t0

    def start(self, b: TrajectoryBuilder, now: float) -> None:
        self._started.setdefault(id(b), now)

    def end(self, b: TrajectoryBuilder, now: float) -> None:
        t0 = self._started.pop(id(b), None)
        if t0 is not None:
            self.longest_s = max(self.longest_s, now - t0)
            self.trajectories += 1

    def take(self) -> RolloutStats:
        """The sums so far; counting starts again from zero (trajectories under way are kept)."""
        out = RolloutStats(self.engine_busy_s, self.search_wait_s, self.longest_s,
                           self.trajectories)
        self.engine_busy_s = self.search_wait_s = self.longest_s = 0.0
        self.trajectories = 0
        return out


class SearchTool:
    """Retriever + formatting + tokenisation of observations for one prompt style: `cfg`'s
    prompt style and observation budget, `search`'s passages per call (topk) and characters
    per passage (max_passage_chars)."""

    def __init__(self, retriever: Retriever, tokenizer, cfg: AgentConfig,
                 search: RetrievalConfig):
        self.retriever, self.tokenizer, self.cfg = retriever, tokenizer, cfg
        self.topk, self.max_passage_chars = search.topk, search.max_passage_chars
        style = cfg.prompt_style
        head, tail = ((" <result>\n", "\n</result>") if style == "a2tgpo"
                      else ("\n\n<information>", "</information>\n\n"))
        self.head = self._ids(head)
        self.tail = self._ids(tail)
        self.calls = 0
        self.seconds = 0.0  # wall time inside the retriever (part of the rollout time)
        # observations made, and those whose passages max_obs_tokens cut: a policy trained on
        # whole observations misreads cut ones (the toy reader: 58% format failures)
        self.observations = 0
        self.cut = 0
        self.stats = RolloutStats()
        self._pending: list[tuple[str, Future]] = []  # searches of the trajectory schedule

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observe(self, queries: list[str]) -> list[list[int]]:
        """Observation ids for each query (one batched retriever call)."""
        if not queries:
            return []
        self.calls += 1
        t0 = time.perf_counter()
        hits = self.retriever.search(queries, self.topk)
        self.seconds += time.perf_counter() - t0
        out = []
        for h in hits:
            body = self._ids(format_passages(h, self.cfg.prompt_style, self.max_passage_chars))
            self.observations += 1
            self.cut += len(body) > self.cfg.max_obs_tokens
            # the budget cuts the passages, never the closing tag
            out.append(self.head + body[: self.cfg.max_obs_tokens] + self.tail)
        return out

    def submit(self, query: str) -> Future[list[int]]:
        """One trajectory's search; it goes to the retriever at the next `flush`."""
        fut: Future[list[int]] = Future()
        self._pending.append((query, fut))
        return fut

    def flush(self) -> bool:
        """Run every submitted search in one `observe` call; whether there was any."""
        pending, self._pending = self._pending, []
        if not pending:
            return False
        try:
            results = self.observe([q for q, _ in pending])
        except BaseException as e:
            for _, fut in pending:
                fut.set_exception(e)
            raise
        for (_, fut), obs in zip(pending, results, strict=True):
            fut.set_result(obs)
        return True

    def text_ids(self, text: str) -> list[int]:
        return self._ids(text)


def _seed(base: int, traj: int, turn: int) -> int:
    # distinct and reproducible per (rollout call, trajectory, turn)
    return (base * 1_000_003 + traj * 1009 + turn) % (2**31 - 1)


def _classify(g, n_ids: int, room: int) -> str:
    """Why a turn ended, from the engine's stop and the length budget."""
    if n_ids >= room:
        return "length"
    if g.stop_string == "</answer>":
        return "answer"
    if g.stop_string == "</search>":
        return "search"
    if g.stop_reason == "eos":
        return "eos"
    return "max_tokens" if g.stop_reason == "length" else "invalid"


def continue_rollouts(builders: list[TrajectoryBuilder], engine: Engine, tool: SearchTool,
                      cfg: AgentConfig, *, seed: int, greedy: bool = False,
                      traj_offset: int = 0) -> list[TrajectoryBuilder]:
    """Run every builder to the end of its episode, by `cfg.schedule`; returns the same
    builders.

    A trajectory goes on exactly while its last turn has an observation (a search result, the
    call-limit warning, Search-R1's invalid-action message). Builders may already hold turns
    (a tree branch starts from a node's prefix); `add_turn`'s invariant check guarantees that
    the shared prefix keeps its exact ids. Builder i's seeds are `_seed(seed, traj_offset + i,
    turn)` under either schedule.
    """
    live = [is_live(b, cfg) for b in builders]
    if cfg.schedule == "trajectory":
        run_trajectories(builders, live, engine, tool, cfg, seed=seed, greedy=greedy,
                         traj_offset=traj_offset)
        return builders
    while any(live):
        live = rollout_wave(builders, live, engine, tool, cfg, seed=seed, greedy=greedy,
                            traj_offset=traj_offset)
    return builders


def is_live(b: TrajectoryBuilder, cfg: AgentConfig) -> bool:
    """Whether the trajectory goes on: no turn yet, or an observation to react to, and room."""
    room = len(b) < len(b.prompt_ids) + cfg.max_response_tokens
    return room and (not b.turns or bool(b.turns[-1].obs_ids))


_STOPS = ("</search>", "</answer>")


def _room(b: TrajectoryBuilder, cfg: AgentConfig) -> int:
    """Response tokens the builder may still add (sampled and observed)."""
    return len(b.prompt_ids) + cfg.max_response_tokens - len(b)


def _action(b: TrajectoryBuilder, g: Generation, r: int, tool: SearchTool,
            cfg: AgentConfig) -> Turn:
    """The turn a generation makes, with room `r`: its sampled ids (a prefix where the total
    length limit cuts), why it ended, the query, and any observation that needs no search
    (the call-limit warning, Search-R1's invalid-action message). A "search" turn has no
    observation yet: `_observed` adds it."""
    # the total-length limit keeps a prefix of what was sampled, never other ids
    ids, lps = list(g.token_ids)[:r], list(g.logprobs)[:r]
    stop = _classify(g, len(ids), r)
    text = tool.tokenizer.decode(ids, skip_special_tokens=True)
    query, obs = None, []
    if stop == "search":
        query = extract_query(text)
        calls = sum(1 for t in b.turns if t.stop == "search")
        if not query:
            stop = "invalid"
        elif calls >= cfg.max_tool_calls:
            stop = "call_limit"
            if cfg.at_call_limit == "warn":
                obs = tool.text_ids(CALL_LIMIT_WARNING)
    if stop in ("invalid", "max_tokens") and cfg.on_invalid == "retry":
        obs = tool.text_ids(prompts.SEARCH_R1_INVALID)
    entropy = -sum(lps) / len(lps)
    return Turn(tuple(ids), tuple(lps), tuple(obs[: max(0, r - len(ids))]), stop, query,
                entropy)


def _observed(turn: Turn, obs: list[int], r: int) -> Turn:
    """A search turn with its observation, cut to the room `r` left before the turn."""
    room_left = r - len(turn.action_ids)
    return Turn(turn.action_ids, turn.action_logprobs, tuple(obs[:room_left]), "search",
                turn.query, turn.entropy)


def _params(cfg: AgentConfig, max_tokens: int, greedy: bool) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          stop=_STOPS, greedy=greedy)


def rollout_wave(builders: list[TrajectoryBuilder], live: list[bool], engine: Engine,
                 tool: SearchTool, cfg: AgentConfig, *, seed: int, greedy: bool = False,
                 traj_offset: int = 0) -> list[bool]:
    """One wave: every live builder generates one turn; the wave's searches go to the
    retriever in one call. Returns which builders are still live.

    A safe point for a time limit or preemption: raises `StopRequested` (every rollout shape
    unwinds; the caller abandons the rollouts) once this process was asked to stop."""
    check_stop()
    live = list(live)
    stats = tool.stats
    if any(live):
        active = [i for i, lv in enumerate(live) if lv]
        t0 = time.perf_counter()
        for i in active:
            stats.start(builders[i], t0)
        inputs = [builders[i].ids for i in active]
        room = [_room(builders[i], cfg) for i in active]
        params = _params(cfg, min(cfg.max_turn_tokens, max(room)), greedy)
        gens = engine.generate(inputs, params, seeds=[
            _seed(seed, traj_offset + i, len(builders[i].turns)) for i in active])
        t1 = time.perf_counter()
        stats.engine_busy_s += t1 - t0
        searches: list[tuple[int, Turn, list[int], int]] = []  # (index, turn, input, room)
        for i, g, engine_input, r in zip(active, gens, inputs, room, strict=True):
            b = builders[i]
            turn = _action(b, g, r, tool, cfg)
            if turn.stop == "search":
                searches.append((i, turn, engine_input, r))
                continue
            b.add_turn(turn, engine_input)
            live[i] = bool(turn.obs_ids) and is_live(b, cfg)
        results = tool.observe([t.query for _, t, _, _ in searches])
        t2 = time.perf_counter()
        stats.search_wait_s += (t2 - t1) * len(searches)
        for (i, turn, engine_input, r), obs in zip(searches, results, strict=True):
            b = builders[i]
            b.add_turn(_observed(turn, obs, r), engine_input)
            live[i] = is_live(b, cfg)
        for i in active:
            if not live[i]:
                stats.end(builders[i], t2)
    return live


def run_trajectories(builders: list[TrajectoryBuilder], live: list[bool], engine: Engine,
                     tool: SearchTool, cfg: AgentConfig, *, seed: int, greedy: bool = False,
                     traj_offset: int = 0) -> None:
    """The trajectory schedule (module docstring): every live builder runs to the end of its
    episode, each on its own. The driver loop, in one thread:

      1. results that are ready are handled in trajectory order: an observation is appended
         (the trajectory is ready for its next turn, or ends); a generation becomes a turn,
         which either submits its search or is appended (ready again, or ends);
      2. searches that were submitted go to the retriever together (`SearchTool.flush`), and
         their observations are handled before anything new is submitted;
      3. every trajectory ready for a turn submits it, in trajectory order;
      4. if nothing was ready, wait for the engine (`Streaming.wait_any`).

    A stop request is read at every pass (`check_stop`)."""
    stream = streaming(engine)
    try:
        _drive(builders, stream, tool, cfg, seed=seed, greedy=greedy, traj_offset=traj_offset,
               ready=[i for i, lv in enumerate(live) if lv])
    except BaseException:
        stream.cancel()  # the rollout is abandoned: nothing it submitted may linger
        raise


def _drive(builders: list[TrajectoryBuilder], stream, tool: SearchTool, cfg: AgentConfig, *,
           seed: int, greedy: bool, traj_offset: int, ready: list[int]) -> None:
    """`run_trajectories`' loop."""
    stats = tool.stats
    gens: dict[int, tuple[Future, list[int], int]] = {}  # i -> (future, engine input, room)
    searches: dict[int, tuple[Future, Turn, list[int], int, float]] = {}  # + query sent at
    busy_since: float | None = None  # a generation in flight since

    def after_turn(i: int, turn: Turn, engine_input: list[int], now: float) -> None:
        b = builders[i]
        b.add_turn(turn, engine_input)
        if bool(turn.obs_ids) and is_live(b, cfg):
            ready.append(i)
        else:
            stats.end(b, now)

    while ready or gens or searches:
        check_stop()
        now = time.perf_counter()
        done_s = sorted(i for i, v in searches.items() if v[0].done())
        for i in done_s:
            fut, turn, engine_input, r, sent = searches.pop(i)
            stats.search_wait_s += now - sent
            after_turn(i, _observed(turn, fut.result(), r), engine_input, now)
        done_g = sorted(i for i, v in gens.items() if v[0].done())
        for i in done_g:
            fut, engine_input, r = gens.pop(i)
            turn = _action(builders[i], fut.result(), r, tool, cfg)
            if turn.stop == "search":
                searches[i] = (tool.submit(turn.query), turn, engine_input, r, now)
            else:
                after_turn(i, turn, engine_input, now)
        if busy_since is not None and not gens:
            stats.engine_busy_s += now - busy_since
            busy_since = None
        if tool.flush():
            continue  # its observations first: those trajectories join this pass's turns
        for i in sorted(ready):
            b = builders[i]
            stats.start(b, now)
            r = _room(b, cfg)
            engine_input = b.ids
            fut = stream.submit(engine_input, _params(cfg, min(cfg.max_turn_tokens, r), greedy),
                                _seed(seed, traj_offset + i, len(b.turns)))
            gens[i] = (fut, engine_input, r)
        ready.clear()
        if gens and busy_since is None:
            busy_since = now
        if not done_s and not done_g and gens:
            stream.wait_any()
    if busy_since is not None:
        stats.engine_busy_s += time.perf_counter() - busy_since


def rollout_chains(questions: Sequence[Question], n: int, engine: Engine, tool: SearchTool,
                   cfg: AgentConfig, *, seed: int, greedy: bool = False,
                   chat_kwargs: dict | None = None) -> list[Trajectory]:
    """`n` independent trajectories per question (group id = question id), in question order."""
    builders = []
    for q in questions:
        ids = prompt_ids(tool.tokenizer, q.question, cfg.prompt_style, chat_kwargs)
        builders += [TrajectoryBuilder(ids, question_id=q.id, group_id=q.id,
                                       golden_answers=q.golden_answers) for _ in range(n)]
    continue_rollouts(builders, engine, tool, cfg, seed=seed, greedy=greedy)
    return [b.build() for b in builders]
