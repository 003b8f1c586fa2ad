"""Supervised warm start (`a2tgpo sft`): oracle search demonstrations, then SFT on their actions.

A randomly initialised toy backbone cannot produce a single well-formatted trajectory, so RL
from it would see reward -1 everywhere. This stage gives it a starting policy that uses the
tags: an oracle agent answers the training questions of the toy world with the real search
tool, and the backbone is fine-tuned on the oracle's actions only.

Oracle demonstrations (a2tgpo prompt style). The world's QA rows carry `metadata.lookups`, the
entity looked up at each hop. The oracle searches for the first lookup (its name appears
verbatim in the question), reads the decoded observation (the page titled by that entity) and
takes the sentence that names the next lookup (or the answer, or a year for comparisons) as
its thought; then searches the next name, and so on, and finally writes
`<answer> The final answer is \\[ \\boxed{…} \\] </answer>`. Observations are exactly the
`SearchTool`'s ids, so the model learns on what it will see at rollout. If a page is missing
from the results the oracle searches again with the exact name, or answers with what it has.

A share of demonstrations (`imperfect_fraction`) is deliberately imperfect, so the starting
policy leaves RL room to improve, while every demonstration stays well formatted:
  * `guess`: answers right after its first thought, without searching;
  * `early_answer`: answers after the first hop with the entity read there;
  * `wrong_query`: one query is a slightly wrong spelling of the name (a dropped or swapped
    letter, or a dropped word); the oracle goes on if the page still comes back, and otherwise
    searches again.
`early_answer_fraction` sets the share of multi-hop questions whose demonstration stops after
the first hop, before `imperfect_fraction` is drawn from the rest. Above one half it makes the
greedy starting policy short-sighted on multi-hop questions (greedy decoding follows the
majority of demonstrations at each decision), which RL then has to correct: searching again
after the first observation is the turn-level decision the credit-assignment methods differ on.
`guess_fraction` sets the share of all questions whose demonstration answers without searching
(drawn first). Above one half the greedy starting policy answers from memory, as a base model
does, and RL has to learn to call the tool: the first turn's decision.
`plan_thought` adds the number of searches to a multi-hop question's first thought ("I need
to find X. The question takes 2 searches."), so that the later choice between searching again
and answering can read the agent's own plan; without it the first thought of a bridge question
is the same as a single-hop one's, and a model that has not learned to look back at the
question's wording stops after the first hop (measured with the toy reader: 71% of the bridge
questions of a world it was fine-tuned on).
With `kind_draws` > 1 the kinds are drawn again for each of that many demonstration sets and
the epochs cycle through them, so the warm start learns a share of imperfect behaviour per
question type rather than which question was imperfect (the RL questions are the SFT's).
The imperfect demonstrations reuse the perfect ones' thoughts, so the model learns a
probability of stopping early or guessing at the same decision points, not a separate style.

Training: causal-LM cross-entropy on action tokens only (the `collate` loss mask, shifted by
one), AdamW, linear warm-up then cosine decay, gradient clipping, seeded data order. Batches
group sequences of similar length and run the prefix all rows share (the system prompt) once.
Sequences longer than `max_seq_len` are left out and counted, never truncated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import re
import time
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from a2tgpo.config import load_config, to_dict
from a2tgpo.io import atomic_path, atomic_write_json
from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
from a2tgpo.retrieval.retriever import RetrievalConfig, build_retriever
from a2tgpo.rollout.agent import AgentConfig, SearchTool, prompt_ids
from a2tgpo.rollout.trajectory import Batch, Trajectory, TrajectoryBuilder, Turn, collate
from a2tgpo.train.config import SftConfig
from a2tgpo.train.episodes import score_trajectory

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# questions


@dataclass(frozen=True)
class OracleQuestion:
    """A world question with what the oracle needs: the entity looked up at each hop."""

    id: str  # <dataset>/<raw id>, the prepared data's id
    question: str
    golden_answers: tuple[str, ...]
    hop_type: str
    lookups: tuple[str, ...]


def load_oracle_questions(world_dir: str | Path,
                          dataset_split_pairs: Sequence[tuple[str, str]]) -> list[OracleQuestion]:
    """Rows of `qa/<dataset>/<split>.jsonl` under the world, in file order.

    The prepared parquet files drop `metadata`, so the world's files are read directly.
    """
    out = []
    for dataset, split in dataset_split_pairs:
        path = Path(world_dir, "qa", dataset, f"{split}.jsonl")
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                meta = row.get("metadata") or {}
                if not meta.get("lookups"):
                    raise ValueError(f"{path}: row {row['id']} has no metadata.lookups; the "
                                     "oracle needs the toy world's question metadata")
                out.append(OracleQuestion(f"{dataset}/{row['id']}", row["question"],
                                          tuple(row["golden_answers"]), meta["hop_type"],
                                          tuple(meta["lookups"])))
    return out


# --------------------------------------------------------------------------------------------
# reading observations

_PAGE = re.compile(r'(?:^|\n)Page \d+: "([^"\n]*)"\n')
_SENTENCE_END = re.compile(r"(?<=\.)\s+")
_YEAR = re.compile(r"in the year (\d+)")


def read_pages(observation: str) -> dict[str, str]:
    """The a2tgpo-style result text as {title (lower case): passage text}, first page wins."""
    body = observation.replace("<result>", "").replace("</result>", "")
    parts = _PAGE.split(body)
    pages: dict[str, str] = {}
    for title, text in zip(parts[1::2], parts[2::2], strict=True):
        pages.setdefault(title.lower(), text.strip())
    return pages


def find_fact(observation: str, entity: str, target: str | re.Pattern) -> str | None:
    """The first sentence of `entity`'s page that names `target` (a name, as a whole word,
    or a pattern); None when the page is not in the observation or does not name it."""
    page = read_pages(observation).get(entity.lower())
    if page is None:
        return None
    if isinstance(target, str):  # "Boville" must not match inside "Bovilleton"
        target = re.compile(rf"(?<!\w){re.escape(target)}(?!\w)")
    for sentence in _SENTENCE_END.split(page):
        if target.search(sentence):
            return sentence.strip()
    return None


# --------------------------------------------------------------------------------------------
# the oracle agent

KINDS = ("perfect", "guess", "early_answer", "wrong_query")

# One oracle step: the action text and its search query (None: the action answers).
Step = tuple[str, str | None]


def _search(think: str, query: str, first: bool) -> Step:
    # after an observation the next action starts with a space, as in the prompt's example
    return f"{'' if first else ' '}<think> {think} </think> <search> {query} </search>", query


def _answer(think: str, answer: str, first: bool) -> Step:
    # "{ X}", not "{X}": byte-level BPE splits a name after "{" differently from the same name
    # after a space (" Keak|field" in the passage, "K|eak|field" after "{"), so "{X}" would
    # ask the tiny model to re-tokenise what it read. With the space the boxed answer is an
    # exact copy of the passage's tokens: toy dev EM 0.33 -> 0.45 (single-hop 0.52 -> 0.81).
    # The answer's normalisation drops the space.
    return ((f"{'' if first else ' '}<think> {think} </think> <answer> The final answer is "
             f"\\[ \\boxed{{ {answer}}} \\] </answer>"), None)


def misspell(name: str, rng: random.Random) -> str:
    """A slightly wrong query for `name`: a dropped or swapped letter, or a dropped word."""
    words = name.split()
    i = max(range(len(words)), key=lambda k: len(words[k]))
    w = words[i]
    how = rng.choice(("drop", "swap", "word") if len(words) > 1 else ("drop", "swap"))
    if how == "word":
        return " ".join(words[:i] + words[i + 1:])
    if len(w) < 3:
        return name + "s"
    j = rng.randrange(1, len(w) - 1)
    words[i] = w[:j] + w[j + 1:] if how == "drop" else w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def oracle(q: OracleQuestion, kind: str, rng: random.Random, plan: bool = False
           ) -> Generator[Step, str, None]:
    """The oracle agent for one question: yields steps; receives the decoded observation
    after each search. `plan`: the first thought of a multi-hop question names its number of
    searches."""
    comparison = q.hop_type == "comparison"
    n = len(q.lookups)
    bad_hop = rng.randrange(n) if kind == "wrong_query" else -1
    think = f"I need to find {q.lookups[0]}."
    if plan and n > 1:
        think += f" The question takes {n} searches."
    first = True
    if kind == "guess":
        # a guess from the only names it has: those in the question
        yield _answer(think, rng.choice(q.lookups) if comparison else q.lookups[0], first)
        return
    years: dict[str, int] = {}
    have = q.lookups[0]  # what it would answer with if it had to stop now
    for k, name in enumerate(q.lookups):
        last = k == n - 1
        target: str | re.Pattern = (_YEAR if comparison else
                                    q.golden_answers[0] if last else q.lookups[k + 1])
        query = misspell(name, rng) if k == bad_hop else name
        obs = yield _search(think, query, first)
        first = False
        fact = find_fact(obs, name, target)
        if fact is None and query != name:  # a real agent notices the miss and retries
            obs = yield _search(f"The results do not mention {name}. I need to find {name}.",
                                name, first)
            fact = find_fact(obs, name, target)
        if fact is None:
            yield _answer(f"I could not find {name}.", have, first)
            return
        if comparison:
            years[name] = int(_YEAR.search(fact).group(1))
            if last:
                a, b = sorted(years, key=years.get)
                yield _answer(f"{fact} {years[a]} is before {years[b]}.", a, first)
                return
            have = name
        elif last:
            yield _answer(fact, q.golden_answers[0], first)
            return
        else:
            have = q.lookups[k + 1]
        if kind == "early_answer" and k == 0:
            yield _answer(fact, have, first)
            return
        think = f"{fact} I need to find {q.lookups[k + 1]}."


def assign_kinds(questions: Sequence[OracleQuestion], imperfect_fraction: float,
                 seed: int, early_answer_fraction: float = 0.0,
                 guess_fraction: float = 0.0) -> list[str]:
    """Each question's demonstration kind.

    First exactly round(guess_fraction × N) of the N questions get `guess`; then exactly
    round(early_answer_fraction × m) of the m multi-hop questions (more than one lookup) not
    drawn yet get `early_answer`; then exactly round(imperfect_fraction × r) of the r others
    get an imperfect kind drawn uniformly, the rest `perfect`. With both first fractions 0
    the draw is the one-fraction draw alone.
    """
    kinds = ["perfect"] * len(questions)
    if guess_fraction:
        for i in random.Random(f"{seed}:guess").sample(range(len(questions)),
                                                        round(guess_fraction * len(questions))):
            kinds[i] = "guess"
    if early_answer_fraction:
        multi = [i for i, q in enumerate(questions)
                 if len(q.lookups) > 1 and kinds[i] == "perfect"]
        early = random.Random(f"{seed}:early").sample(multi,
                                                      round(early_answer_fraction * len(multi)))
        for i in early:
            kinds[i] = "early_answer"
    rest = [i for i, k in enumerate(kinds) if k == "perfect"]
    rng = random.Random(seed)
    for j in sorted(rng.sample(range(len(rest)), round(imperfect_fraction * len(rest)))):
        i = rest[j]
        # early_answer needs a second hop to skip
        options = ("guess", "wrong_query") + (("early_answer",)
                                              if len(questions[i].lookups) > 1 else ())
        kinds[i] = rng.choice(options)
    return kinds


def write_demonstrations(questions: Sequence[OracleQuestion], tool: SearchTool, cfg: AgentConfig,
                         *, imperfect_fraction: float, seed: int,
                         early_answer_fraction: float = 0.0, guess_fraction: float = 0.0,
                         plan: bool = False, chat_kwargs: dict | None = None
                         ) -> list[Trajectory]:
    """One oracle trajectory per question, built turn by turn with `TrajectoryBuilder`.

    All oracles advance in waves with one batched search per wave, as the rollout does. Action
    texts are tokenised once and stand for the sampled ids (logprobs 0); observations are the
    SearchTool's ids. `extra` holds the demonstration's kind and its score.
    """
    if cfg.prompt_style != "a2tgpo":
        raise ValueError("the oracle writes a2tgpo-style demonstrations; set prompt_style: a2tgpo")
    tok = tool.tokenizer
    kinds = assign_kinds(questions, imperfect_fraction, seed, early_answer_fraction,
                         guess_fraction)
    builders = [TrajectoryBuilder(prompt_ids(tok, q.question, cfg.prompt_style, chat_kwargs),
                                  question_id=q.id, group_id=q.id, golden_answers=q.golden_answers)
                for q in questions]
    agents = [oracle(q, kind, random.Random(f"{seed}:{q.id}"), plan)
              for q, kind in zip(questions, kinds, strict=True)]
    steps: list[Step | None] = [next(a) for a in agents]
    while any(s is not None for s in steps):
        searching = [i for i, s in enumerate(steps) if s is not None and s[1] is not None]
        observations = tool.observe([steps[i][1] for i in searching])
        obs_of = dict(zip(searching, observations, strict=True))
        for i, step in enumerate(steps):
            if step is None:
                continue
            text, query = step
            ids = tok.encode(text, add_special_tokens=False)
            obs = obs_of.get(i, [])
            builders[i].add_turn(Turn(tuple(ids), (0.0,) * len(ids), tuple(obs),
                                      "answer" if query is None else "search", query),
                                 builders[i].ids)
            if query is None:
                steps[i] = None
            else:
                steps[i] = agents[i].send(tok.decode(obs, skip_special_tokens=True))
    out = []
    for b, kind in zip(builders, kinds, strict=True):
        traj = b.build()
        s = score_trajectory(tok, traj, "a2tgpo", training=True)
        out.append(dataclasses.replace(traj, reward=s.reward, extra={
            "kind": kind, "em": s.em, "format_ok": s.format_ok}))
    return out


def demo_stats(demos: Sequence[Trajectory]) -> dict:
    """Counts, mean turns and searches, share correct (EM) and format-ok, per kind."""
    def share(rows, key):
        return round(sum(t.extra[key] for t in rows) / len(rows), 4) if rows else 0.0

    kinds = Counter(t.extra["kind"] for t in demos)
    n = len(demos)
    return {
        "demos": n,
        "mean_turns": round(sum(len(t.turns) for t in demos) / n, 3) if n else 0.0,
        "mean_searches": round(sum(t.num_tool_calls for t in demos) / n, 3) if n else 0.0,
        "correct": share(demos, "em"),
        "format_ok": share(demos, "format_ok"),
        "kinds": {k: {"n": kinds[k], "correct": share([t for t in demos
                                                       if t.extra["kind"] == k], "em")}
                  for k in KINDS if kinds[k]},
    }


# --------------------------------------------------------------------------------------------
# training


def shared_prefix_length(batch: Batch) -> int:
    """Leading tokens every row of the batch has in common (the system prompt, for one),
    capped so that each row keeps at least its last prompt token after the prefix."""
    ids = batch.input_ids
    same = (ids == ids[:1]).all(0).long()
    return min(int(same.cumprod(0).sum()), int(batch.prompt_lengths.min()) - 1)


def action_token_loss(model, batch: Batch) -> tuple[torch.Tensor, int]:
    """(sum of cross-entropy over action tokens, number of action tokens).

    The token at position t is predicted from position t-1, so the mask is shifted by one;
    prompt, observation and padding positions carry no loss. The prefix all rows share is
    run once and its key/value cache repeated over the batch (gradients flow back through the
    repeat): on the toy the system prompt is half of every sequence, so this halves the work.
    """
    device = next(model.parameters()).device
    ids, attn, pos = (batch.input_ids.to(device), batch.attention_mask.to(device),
                      batch.position_ids.to(device))
    p = shared_prefix_length(batch) if len(batch) > 1 else 0
    if p > 0:
        cache = model(input_ids=ids[:1, :p], use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
        logits = model(input_ids=ids[:, p:], attention_mask=attn, position_ids=pos[:, p:],
                       past_key_values=cache, use_cache=True).logits
    else:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    # logits[:, j] is at position p + j and predicts token p + j + 1; p's own token is prompt
    mask = batch.loss_mask[:, p + 1:].to(device).bool()
    targets = ids[:, p + 1:][mask]
    picked = logits[:, :-1][mask].float()
    loss = torch.nn.functional.cross_entropy(picked, targets, reduction="sum")
    return loss, int(mask.sum())


@torch.no_grad()
def demo_loss(model, demos: Sequence[Trajectory], pad_id: int, batch_size: int = 8) -> float:
    """Mean action-token cross-entropy of `model` on `demos` (evaluation mode)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(demos), batch_size):
        loss, n = action_token_loss(model, collate(demos[s: s + batch_size], pad_id))
        total, count = total + float(loss), count + n
    model.train(was_training)
    return total / max(count, 1)


def length_batches(lengths: Sequence[int], batch_size: int, rng: random.Random,
                   pool: int = 16) -> list[list[int]]:
    """One epoch of batches (index lists) in a random order, each cut from a sorted window
    of `pool` batches' worth of random sequences: similar lengths share a batch, so little
    compute goes to padding, while batch contents still vary from epoch to epoch."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for w in range(0, len(order), batch_size * pool):
        window = sorted(order[w: w + batch_size * pool], key=lambda i: lengths[i])
        batches += [window[s: s + batch_size] for s in range(0, len(window), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_lambda(step: int, total: int, warmup: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_sft(model, demos: Sequence[Trajectory], cfg: SftConfig, pad_id: int, *,
              progress: bool = True, redraws: Sequence[Sequence[Trajectory]] = ()) -> dict:
    """Fine-tune `model` in place on the demonstrations' action tokens; returns the history.

    `redraws`: more demonstration sets of the same questions (kinds drawn again); epoch e
    trains on set e mod (1 + len(redraws)), `demos` first. Deterministic given `cfg.seed`
    (torch's seed and the data order), on one device.
    """
    from a2tgpo.progress import progress_bar

    sets, skipped = [], 0
    for demo_set in (demos, *redraws):
        fits = [t for t in demo_set if len(t.prompt_ids) + t.response_length() <= cfg.max_seq_len]
        skipped += len(demo_set) - len(fits)
        if not fits:
            raise ValueError(f"no demonstration fits max_seq_len {cfg.max_seq_len}")
        sets.append(fits)
    if skipped:
        log.warning("sft: %d of %d demonstrations are longer than max_seq_len %d and are left "
                    "out", skipped, sum(map(len, (demos, *redraws))), cfg.max_seq_len)
    torch.manual_seed(cfg.seed)
    order_rng = random.Random(cfg.seed)
    epoch_sets = [sets[e % len(sets)] for e in range(cfg.epochs)]
    total = sum(math.ceil(len(kept) / cfg.batch_size) for kept in epoch_sets)
    warmup = max(1, round(cfg.warmup_ratio * total))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total, warmup))
    model.train()
    history = []
    bar = progress_bar(total=total, desc="sft", unit="step", disable=not progress)
    for epoch, kept in enumerate(epoch_sets):
        start, ep_loss, ep_actions, ep_tokens = time.perf_counter(), 0.0, 0, 0
        lengths = [len(t.prompt_ids) + t.response_length() for t in kept]
        for rows in length_batches(lengths, cfg.batch_size, order_rng):
            batch = collate([kept[i] for i in rows], pad_id)
            loss_sum, n = action_token_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            (loss_sum / n).backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            ep_loss, ep_actions = ep_loss + loss_sum.item(), ep_actions + n
            ep_tokens += int(batch.attention_mask.sum())
            bar.update(1)
            if bar.n % cfg.log_every == 0:
                bar.set_postfix(loss=f"{loss_sum.item() / n:.4f}",
                                lr=f"{sched.get_last_lr()[0]:.2e}")
        seconds = time.perf_counter() - start
        row = {"epoch": epoch + 1, "loss": ep_loss / ep_actions, "seconds": round(seconds, 2),
               "tokens_per_s": round(ep_tokens / seconds, 1)}
        history.append(row)
        line = (f"sft epoch {epoch + 1}/{cfg.epochs}: loss {row['loss']:.4f}, "
                f"{row['tokens_per_s']:.0f} tokens/s, {seconds:.1f} s")
        # one line per epoch, under the bar when there is one
        (bar.write if progress else log.info)(line)
    bar.close()
    model.eval()
    return {"sequences": len(sets[0]), "skipped_too_long": skipped, "steps": total,
            "final_loss": history[-1]["loss"], "epochs": history}


# --------------------------------------------------------------------------------------------
# the stage


def _demo_questions(cfg: SftConfig, world_dir: str | Path, holdout: str | Path | None
                    ) -> tuple[list, int]:
    """The world questions to demonstrate: cfg.datasets less the `holdout` file's ids, then a
    seeded sample of cfg.max_questions; and how many were held out."""
    questions = load_oracle_questions(world_dir, [tuple(d.split("/")) for d in cfg.datasets])
    held = 0
    if holdout is not None:
        from a2tgpo.data.qa import load_split

        ids = {r["id"] for r in load_split(holdout)}
        held = sum(q.id in ids for q in questions)
        questions = [q for q in questions if q.id not in ids]
    if cfg.max_questions is not None and cfg.max_questions < len(questions):
        keep = sorted(random.Random(cfg.seed).sample(range(len(questions)), cfg.max_questions))
        questions = [questions[i] for i in keep]
    return questions, held


def main(config_path: str | Path, overrides: Sequence[str], *, backbone_dir: str | Path,
         world_dir: str | Path, corpus: str | Path, index: str | Path, out_dir: str | Path,
         section: str | None = "sft", holdout: str | Path | None = None,
         retrieval: RetrievalConfig | None = None, agent: AgentConfig | None = None) -> int:
    """Write the oracle demonstrations, fine-tune the backbone on them, save the result.

    `out_dir` receives the model and tokenizer (`save_pretrained`) and `sft_summary.json`,
    atomically. `holdout` names a prepared QA file (e.g. data/dev.parquet) whose ids are left
    out, so that checkpoint selection on it is not measured on memorised questions.
    `retrieval` and `agent` default to their configs' defaults (dense MiniLM, a2tgpo style).
    """
    t0 = time.perf_counter()
    cfg = load_config(SftConfig, config_path, overrides, section=section)
    agent = agent or AgentConfig()
    questions, held = _demo_questions(cfg, world_dir, holdout)
    backbone = BackboneConfig(id=Path(backbone_dir).name, path=str(backbone_dir),
                              dtype="float32")  # full-precision weights for the optimiser
    tok = load_tokenizer(backbone)
    retrieval = retrieval or RetrievalConfig()
    retriever = build_retriever(retrieval, corpus, index)
    try:
        tool = SearchTool(retriever, tok, agent, retrieval)
        demos, *redraws = [
            write_demonstrations(questions, tool, agent,
                                 imperfect_fraction=cfg.imperfect_fraction, seed=cfg.seed + d,
                                 early_answer_fraction=cfg.early_answer_fraction,
                                 guess_fraction=cfg.guess_fraction, plan=cfg.plan_thought)
            for d in range(cfg.kind_draws)]
    finally:
        retriever.close()
    stats = demo_stats(demos)
    print(f"sft demonstrations: {stats['demos']} ({held} held out), mean turns "
          f"{stats['mean_turns']}, correct {stats['correct']:.1%}, format ok "
          f"{stats['format_ok']:.1%}, kinds {({k: v['n'] for k, v in stats['kinds'].items()})}")
    t_demo = time.perf_counter() - t0

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(backbone, device)
    history = train_sft(model, demos, cfg, tok.pad_token_id, redraws=redraws)
    summary = {
        "config": to_dict(cfg),
        "backbone": str(backbone_dir),
        "held_out": held,
        "demonstrations": stats,
        "training": history,
        "final_loss": history["final_loss"],
        "seconds": {"demonstrations": round(t_demo, 1),
                    "total": round(time.perf_counter() - t0, 1)},
    }
    with atomic_path(out_dir, directory=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "sft_summary.json", summary)
    print(f"sft: final loss {history['final_loss']:.4f} after {history['steps']} steps, "
          f"{summary['seconds']['total']:.0f} s -> {out_dir}")
    return 0
