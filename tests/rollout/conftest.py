"""Shared rollout test fixtures: a toy tokenizer, a scripted engine and a fixed retriever."""

from __future__ import annotations

import pytest

from a2tgpo.retrieval.base import Hit
from a2tgpo.rollout.engine import Generation, SamplingParams


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """A small toy world and its backbone (tokenizer + random tiny Qwen3)."""
    from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone

    root = tmp_path_factory.mktemp("toy")
    write_world(WorldConfig(countries=4, cities=8, people=30, films=12, bands=6, companies=8,
                            distractors=10,
                            qa_sets=(QASetSpec("s", "single_hop", {"test": 10},
                                               {"single": 1.0}),)), root / "world")
    write_toy_backbone(ToyBackboneConfig(), root / "world", root / "backbone")
    return root


@pytest.fixture(scope="session")
def toy_tokenizer(toy_dir):
    from a2tgpo.model.backbone import BackboneConfig, load_tokenizer

    return load_tokenizer(BackboneConfig(id="toy", path=str(toy_dir / "backbone")))


class ScriptedEngine:
    """An engine whose "model" is a script: the action for turn k of the question in the
    prompt. It still honours the Engine contract (ids in, ids + logprobs + stop reason out,
    stop strings kept, max_tokens), so the agent loop cannot tell it from a model.

    script(question_text, turn_index, seed) -> action text; the text is tokenised once here,
    which stands for sampling. Logprobs are −(1 + seed % 7)/10 per token, so tree tests get
    distinct entropies per branch.
    """

    def __init__(self, tokenizer, script, eos_id: int):
        self.tok, self.script, self.eos_id = tokenizer, script, eos_id
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, params: SamplingParams, seeds=None):
        self.calls.append([list(p) for p in prompts])
        seeds = seeds or [0] * len(prompts)
        out = []
        for p, seed in zip(prompts, seeds, strict=True):
            text = self.tok.decode(p)
            user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            turn = text.split("<|im_start|>assistant\n", 1)[1].count("</result>") \
                + text.split("<|im_start|>assistant\n", 1)[1].count("</information>") \
                + text.count("tool call limit")
            action = self.script(user, turn, seed)
            eos = action.endswith("<EOS>")
            action = action.removesuffix("<EOS>")
            stop_string = None
            for s in params.stop:
                at = action.find(s)
                if at >= 0 and (stop_string is None or at < action.find(stop_string)):
                    stop_string = s
            if stop_string is not None:
                action = action[: action.find(stop_string) + len(stop_string)]
            ids = self.tok.encode(action, add_special_tokens=False)
            reason = "stop" if stop_string else "length"
            if eos and stop_string is None:
                ids, reason = ids + [self.eos_id], "eos"
            if len(ids) > params.max_tokens:
                ids, reason, stop_string = ids[: params.max_tokens], "length", None
            lp = -(1 + seed % 7) / 10
            out.append(Generation(tuple(ids), tuple([lp] * len(ids)), reason, stop_string))
        return out

    def update_weights(self, state_dict):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass


class FixedRetriever:
    """Returns passages that name the query, so observations are predictable."""

    def __init__(self):
        self.batches: list[list[str]] = []

    def search(self, queries, topk):
        self.batches.append(list(queries))
        return [[Hit(str(i), f'"{q}"\n{q} is a thing {i}.', 1.0 - i / 10) for i in range(topk)]
                for q in queries]

    def close(self):
        pass


@pytest.fixture
def scripted(toy_tokenizer):
    def make(script):
        return ScriptedEngine(toy_tokenizer, script, toy_tokenizer.eos_token_id)
    return make
