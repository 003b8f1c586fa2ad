"""Answer extraction, QA metrics, format checks and outcome rewards (algorithms.md §10.2).

One implementation serves training rewards and evaluation, because repos that kept two copies
let them drift apart (ecosystem.md, "EM"). Two prompt styles (a2tgpo/data/prompts.py):

- `a2tgpo` (A2TGPO / AT2PO): the answer is the last `\\boxed{...}` inside `<answer>`; reward in
  {-1, 0, 1}. Read from zzfoutofspace/ATPO @98e60f6,
  `ATPO/verl_atpo/verl/utils/reward_score/deep_research_em.py` (`validate_format`,
  `extract_answer`, `last_boxed_only_string`, `remove_boxed`, `get_f1_score`, `get_em_score`,
  `compute_score`). The A2TGPO script names the same file (algorithms.md §10.2).
- `search_r1`: the answer is the last `<answer>...</answer>`; reward EM, or the v0.3 format reward.
  The official PeterGriffinJin/Search-R1 reward files are not in our source index, so they were
  read from forks that keep them: `verl/utils/reward_score/qa_em_format.py` from
  quanwei0/Search-R1 @616dc94 (the cross-checked LuYueee/Search-R1 @6f659a6 copy has the same
  table) and `verl/utils/reward_score/qa_em.py` from xuetae/Search-R1 @64f8b25, which matches
  volcengine/verl @32a02aa `verl/utils/reward_score/search_r1_like_qa_em.py`.

What is read (`Response`; `a2tgpo.train.episodes.score_trajectory` builds it from a
trajectory's token ids, for training rewards, validation and evaluation alike):
- The answer is read from the policy's own text of the LAST turn only, the answer turn (a turn
  that ends in `</answer>` ends the episode, so a model's answer is always there), by the
  style's rule: A2TGPO the last `\\boxed{}` of the first `<answer>` block, Search-R1 the last
  `<answer>` block. Observations (retrieved passages, tool messages) are never read for it, nor
  are earlier turns: a passage holding `<answer> \\boxed{X} </answer>` cannot become the answer.
- The format checks read every turn's policy text and each observation's envelope (the
  `<result>` / `<information>` tags the tool wrapped it in); tags inside an observation are
  inert text (`inert`), so retrieved text can neither add nor close a block.
- A golden answer that normalises to the empty string (e.g. "the") matches nothing, and neither
  does a prediction that normalises to it: EM, subEM, F1 and the rewards then agree (all 0).
  `a2tgpo prepare-data` refuses such golden answers (a2tgpo/data/qa.py).

Deviations from those sources, on purpose:
- The scored string is the response only, never the prompt (both repos score prompt+response in
  Search-R1). So `<answer>` needs 1 match, not Search-R1's 2 (algorithms.md §13.3), and the
  Search-R1 state machine runs on the whole response instead of the text after
  `<|im_start|>assistant`. Decode responses without special tokens (as ATPO's reward manager
  does): anything after `</answer>`, an EOS text included, breaks the Search-R1 format.
- Both sources decode and score the whole response, passages included (ATPO reads the FIRST
  `<answer>` there); the answer turn and inert observations above are ours. For a response whose
  observations hold no protocol tags and whose only `<answer>` block is in its last turn, the
  two readings agree.
- Search-R1 and ATPO count an empty normalised prediction as an exact match of an empty
  normalised golden answer (EM 1 while F1 is 0); here it is no match.
- `a2tgpo_reward(check_format=False)` gives 0, not ATPO's -1, when no boxed answer can be read:
  without the format check the reward is a pure correctness score (ATPO's validation logs EM).
- ATPO's bonus of F1 + 0.1 for using both search and python is left out: this agent has only the
  search tool, so the reward stays in {-1, 0, 1} as the papers state.
- verl's `search_r1_like_qa_em.py` divides the reward by 4 past 10 answer tags; Search-R1 does
  not, and neither do we.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Golds = str | Sequence[str]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_SEARCH_R1_TAG = re.compile(r"(</?(?:think|search|information|answer)>)")
# every tag either format check reads; inside an observation they are made inert
_PROTOCOL_TAG = re.compile(r"<(/?)(think|search|result|information|answer|python)>")
# an observation's envelope: the tool's opening tag at its start, the closing one at its end (a
# result cut by the length limit has no closing tag)
_ENVELOPE = re.compile(r"\A(\s*<(?:result|information)>)(.*?)(</(?:result|information)>\s*)?\Z",
                       re.DOTALL)


def _as_list(golds: Golds) -> list[str]:
    # A bare string is a Sequence[str] of characters; treat it as one golden answer, as the
    # sources do, instead of silently matching single letters.
    return [golds] if isinstance(golds, str) else list(golds)


def _matchable(golds: Golds) -> list[str]:
    """The normalised golden answers that can be matched: an empty one matches nothing (see the
    module docstring), so EM, subEM and F1 agree on it."""
    return [g for g in map(normalize_answer, _as_list(golds)) if g]


# ---------------------------------------------------------------------------------------------
# Normalisation and metrics
# ---------------------------------------------------------------------------------------------

def normalize_answer(s: str) -> str:
    """SQuAD normalisation, in the order of Search-R1 `qa_em.py: normalize_answer` (same in verl
    `search_r1_like_qa_em.py` and ATPO `deep_research_em.py`): lowercase -> drop
    `string.punctuation` -> replace the words a/an/the by a space -> collapse whitespace.

    The order matters: punctuation goes before articles, so "A.B.C." -> "abc" (articles first
    would drop the leading "a" and give "bc").
    """
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(pred: str, golds: Golds) -> float:
    """1.0 if the normalised prediction equals any normalised golden answer, else 0.0
    (Search-R1 `em_check`, ATPO `get_em_score`). Empty normalised strings match nothing: EM 1
    implies F1 1."""
    p = normalize_answer(pred)
    return float(p in _matchable(golds))


def substring_match(pred: str, golds: Golds) -> float:
    """1.0 if any normalised golden answer is a substring of the normalised prediction, else 0.0
    (Search-R1 `subem_check`). An empty normalised golden answer is in every string, so it
    matches nothing here too."""
    p = normalize_answer(pred)
    return float(any(g in p for g in _matchable(golds)))


def f1_score(pred: str, golds: Golds) -> float:
    """Bag-of-tokens F1 after normalisation, max over golden answers (ATPO `get_f1_score`).

    Token overlap counts multiplicity (Counter intersection), as in the SQuAD script. As in ATPO
    (which keeps the HotpotQA evaluation rule), a prediction or gold of "yes", "no" or
    "noanswer" only scores when the two are equal, so "no" vs "no way" is 0, not 2/3. An empty
    normalised string scores 0.
    """
    p = normalize_answer(pred)
    p_tokens = p.split()
    best = 0.0
    for g in _matchable(golds):
        if p != g and ({p, g} & {"yes", "no", "noanswer"}):
            continue
        g_tokens = g.split()
        common = sum((Counter(p_tokens) & Counter(g_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(p_tokens), common / len(g_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ---------------------------------------------------------------------------------------------
# What is read: the answer turn, and observations made inert
# ---------------------------------------------------------------------------------------------

def inert(observation: str) -> str:
    """An observation as the format checks read it: the tool's envelope (an opening `<result>`
    or `<information>` at its start, the closing tag at its end) is kept, and every protocol tag
    between them becomes plain text (`<answer>` -> `[answer]`, which normalises to the same
    words), so retrieved text can neither add, open nor close a block."""
    m = _ENVELOPE.match(observation)
    head, body, tail = (m.group(1), m.group(2), m.group(3) or "") if m else ("", observation, "")
    return head + _PROTOCOL_TAG.sub(r"[\1\2]", body) + tail


@dataclass(frozen=True)
class Response:
    """A trajectory's response as the scorer reads it: per turn, the policy's own text (its
    sampled tokens, decoded) and the observation appended after it ("" when none).

    The functions below also take a plain string: one policy turn without observations (a
    hand-written response, or a text scored the sources' way).
    """

    turns: tuple[tuple[str, str], ...]

    @property
    def answer_turn(self) -> str:
        """The policy's text of the last turn: the only text an answer is read from."""
        return self.turns[-1][0] if self.turns else ""

    @property
    def text(self) -> str:
        """Every turn's policy text and inert observation, in order: what format checks read."""
        return "".join(action + inert(obs) for action, obs in self.turns)


def _response(response: Response | str) -> Response:
    return response if isinstance(response, Response) else Response(((response, ""),))


# ---------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------

def extract_boxed(text: str) -> str | None:
    """The A2TGPO/AT2PO answer: the last `\\boxed{...}` inside the first `<answer>...</answer>`
    (ATPO `extract_answer` + `last_boxed_only_string` + `remove_boxed`).

    - Only the first `<answer>` block is read (ATPO uses `re.search`); the training format check
      allows exactly one, so this matters only when the format is not checked.
    - The box is brace-matched: `\\boxed{a {b} c}` -> "a {b} c"; unbalanced -> None.
    - The last `\\boxed` occurrence is the one read; if it is not followed by `{`, there is no
      answer (ATPO's assertion in `remove_boxed` fails, and `\\fbox` fails the same way).
    - ATPO also accepts `\\boxed answer` (a space, no braces): anywhere in the block it takes
      precedence, and the answer runs from the last `\\boxed ` to the next `$`.
    """
    block = _ANSWER.search(text)
    if block is None:
        return None
    answer = block.group(1)
    if "\\boxed " in answer:
        return answer.split("\\boxed ")[-1].split("$")[0]
    start = answer.rfind("\\boxed")
    if start < 0 or not answer.startswith("\\boxed{", start):
        return None
    open_brace = start + len("\\boxed")
    depth = 0
    for i in range(open_brace, len(answer)):
        depth += {"{": 1, "}": -1}.get(answer[i], 0)
        if depth == 0:
            return answer[open_brace + 1:i]
    return None


def extract_answer_tag(text: str, min_matches: int = 1) -> str | None:
    """The Search-R1 answer: the stripped content of the last `<answer>...</answer>`, or None
    when there are fewer than `min_matches` blocks (Search-R1 `extract_solution`).

    Search-R1 requires 2 because its scored string starts with the prompt, whose instructions
    contain `<answer>` examples (algorithms.md §13.3). We score the response only, so the default
    is 1; pass 2 to reproduce Search-R1 on a prompt+response string.
    """
    matches = _ANSWER.findall(text)
    if not matches or len(matches) < min_matches:
        return None
    return matches[-1].strip()


# ---------------------------------------------------------------------------------------------
# Format checks
# ---------------------------------------------------------------------------------------------

def _calls_answered(text: str, open_tag: str, close_tag: str) -> bool:
    """Every `open_tag` is followed by `close_tag`, then `<result>`, then `</result>`, in that
    order; the next call is looked for after that `</result>` (ATPO `validate_format` loop)."""
    pos = 0
    while (call := text.find(open_tag, pos)) != -1:
        call_end = text.find(close_tag, call)
        result = text.find("<result>", call)
        if call_end == -1 or result == -1 or result < call_end:
            return False
        result_end = text.find("</result>", result)
        if result_end == -1:
            return False
        pos = result_end
    return True


def a2tgpo_format_ok(response: str) -> bool:
    """The A2TGPO/AT2PO training format check (ATPO `deep_research_em.py: validate_format`).

    - `<think>` count == `</think>` count >= 1 (order is not checked, as in ATPO);
    - exactly one `<answer>` and one `</answer>`, the opening one first;
    - every `<search>` has its `</search>`, `<result>`, `</result>` after it, in this order. A
      last `<search>...</search>` without a result therefore fails: ATPO has no exception for it
      (such episodes, cut by the call limit or length, have no answer and get -1 anyway);
    - the same rule for `<python>` ... `</python>`: ATPO checks it although this agent has no
      python tool, so an invented `<python>` call is a format failure here too;
    - `\\boxed{` and a `}` inside the answer block.
    """
    if response.count("<think>") != response.count("</think>") or "<think>" not in response:
        return False
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return False
    if not (_calls_answered(response, "<search>", "</search>")
            and _calls_answered(response, "<python>", "</python>")):
        return False
    # A reversed pair (`</answer>` first) leaves an empty block, so it fails here (ATPO checks
    # the order separately, with the same result).
    block = response[response.find("<answer>"):response.find("</answer>")]
    return "\\boxed{" in block and "}" in block


# Search-R1's valid sequence: (think, (search, information, think)*, answer), whitespace only
# between blocks and nothing after </answer>. A state is left only by the listed tag.
_SEARCH_R1_NEXT: dict[tuple[str, str], str] = {
    ("start", "<think>"): "in_think",
    ("after_information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "after_information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}


def search_r1_format_ok(response: str) -> bool:
    """Search-R1's format check (`qa_em_format.py: is_valid_sequence`), on the response only.

    Split on the tags think/search/information/answer; free text is allowed only inside a
    block; every tag must be the allowed next one; the response must end right after
    `</answer>` (trailing whitespace aside). Search-R1 first checks that each tag's opening and
    closing counts match; that check is implied here, since a block can only be left by its own
    closing tag and the sequence must end in `end`.
    """
    state = "start"
    for part in _SEARCH_R1_TAG.split(response):
        if not part.strip():
            continue
        if _SEARCH_R1_TAG.fullmatch(part):
            state = _SEARCH_R1_NEXT.get((state, part), "invalid")
            if state == "invalid":
                return False
        elif not state.startswith("in_"):
            return False
    return state == "end"


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

def a2tgpo_reward(response: Response | str, golds: Golds, *, check_format: bool = True
                  ) -> float:
    """A2TGPO/AT2PO outcome reward in {-1, 0, 1} (ATPO `deep_research_em.py: compute_score`;
    algorithms.md §10.2).

    - Format failure -> -1, only with `check_format` (training; ATPO skips it at validation).
    - No readable boxed answer in the answer turn -> -1 with `check_format`, else 0 (see the
      module docstring).
    - Otherwise EM if F1 > 0, else 0: a partial overlap earns nothing. Since empty normalised
      strings match nothing, this is EM.
    """
    r = _response(response)
    if check_format and not a2tgpo_format_ok(r.text):
        return -1.0
    answer = extract_boxed(r.answer_turn)
    if answer is None:
        return -1.0 if check_format else 0.0
    return exact_match(answer, golds) if f1_score(answer, golds) > 0 else 0.0


def search_r1_reward(response: Response | str, golds: Golds, *, min_matches: int = 1) -> float:
    """Search-R1's plain reward (`qa_em.py: compute_score_em`, format_score 0): EM of the last
    `<answer>` block of the answer turn, 0 when there is none."""
    answer = extract_answer_tag(_response(response).answer_turn, min_matches)
    return 0.0 if answer is None else exact_match(answer, golds)


def search_r1_format_reward(response: Response | str, golds: Golds, *, structure: float = 0.2,
                            final_format: float = 0.1, retrieval: float = 0.0,
                            min_matches: int = 1) -> float:
    """Search-R1 v0.3 reward (`qa_em_format.py: compute_score_em`; defaults are the scripts'
    structure_format_score 0.2, final_format_score 0.1, retrieval_score 0).

    | answer  | valid format                  | invalid format         |
    |---------|-------------------------------|------------------------|
    | correct | 1                             | 1 - structure (0.8)    |
    | wrong   | structure (+ retrieval) (0.2) | final_format (0.1)     |
    | none    | structure (+ retrieval) (0.2) | 0                      |

    The retrieval bonus is paid when a normalised golden answer is a substring of a normalised
    `<information>` block (`is_retrieval_correct`: the gold, not the predicted answer; the
    passages are read here, since this asks what was retrieved). With response-only scoring
    and `min_matches=1` a valid format implies an answer, so the "none + valid" row is reachable
    only with `min_matches=2`.
    """
    r = _response(response)
    valid = search_r1_format_ok(r.text)
    answer = extract_answer_tag(r.answer_turn, min_matches)
    if answer is not None and exact_match(answer, golds):
        return 1.0 if valid else 1.0 - structure
    if not valid:
        return 0.0 if answer is None else final_format
    blocks = [normalize_answer(b) for b in _INFORMATION.findall(r.text)]
    retrieved = any(g in b for b in blocks for g in _matchable(golds))
    return structure + (retrieval if retrieved else 0.0)


# ---------------------------------------------------------------------------------------------
# The one entry point for training and evaluation
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    """What training and evaluation record for one response.

    `reward` is the style's training reward when scored with `training=True`, else the
    format-free reward; `em`, `f1` and `subem` are the metrics of the extracted `answer`
    (0 when there is none), whatever the format; `format_ok` is the style's format check.
    """

    reward: float
    em: float
    f1: float
    subem: float
    answer: str | None
    format_ok: bool


def score_response(response: Response | str, golds: Golds,
                   style: Literal["a2tgpo", "search_r1"], *, training: bool) -> Score:
    """Score one response (decoded without special tokens, prompt excluded): the answer from
    its answer turn, the format from its policy text and inert observations (module docstring).

    `training=True` applies the style's format rules: A2TGPO's check (-1 on failure) or
    Search-R1's v0.3 format reward. `training=False` (evaluation, validation) gives the
    format-free reward: A2TGPO's EM-if-F1>0 or Search-R1's plain EM.
    """
    r = _response(response)
    if style == "a2tgpo":
        answer = extract_boxed(r.answer_turn)
        format_ok = a2tgpo_format_ok(r.text)
        reward = a2tgpo_reward(r, golds, check_format=training)
    elif style == "search_r1":
        answer = extract_answer_tag(r.answer_turn)
        format_ok = search_r1_format_ok(r.text)
        reward = (search_r1_format_reward(r, golds) if training
                  else search_r1_reward(r, golds))
    else:
        raise ValueError(f"unknown prompt style {style!r}; expected 'a2tgpo' or 'search_r1'")
    if answer is None:
        return Score(reward, 0.0, 0.0, 0.0, None, format_ok)
    return Score(reward, exact_match(answer, golds), f1_score(answer, golds),
                 substring_match(answer, golds), answer, format_ok)
