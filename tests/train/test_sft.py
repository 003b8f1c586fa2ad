"""The SFT warm start: oracle demonstrations on a small world with a real MiniLM/faiss index,
the action-only loss, training, determinism and the saved output."""

import dataclasses
import random

import pytest
import torch

from a2tgpo.algo.rewards import score_response
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.rollout.agent import AgentConfig, SearchTool
from a2tgpo.rollout.trajectory import collate
from a2tgpo.train.sft import (
    OracleQuestion,
    SftConfig,
    action_token_loss,
    assign_kinds,
    demo_loss,
    demo_stats,
    find_fact,
    length_batches,
    load_oracle_questions,
    main,
    oracle,
    shared_prefix_length,
    train_sft,
    write_demonstrations,
)

PAIRS = [("s", "train"), ("m", "train")]
AGENT = AgentConfig()
SEARCH = RetrievalConfig()  # passages per search and their length


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A small world (single, bridge, composition and comparison questions), the toy backbone
    and a dense MiniLM index over the world's corpus."""
    from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig
    from a2tgpo.retrieval.index import IndexConfig, build_index, encode_shard

    root = tmp_path_factory.mktemp("sft")
    write_world(WorldConfig(
        countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10,
        qa_sets=(QASetSpec("s", "single_hop", {"train": 16}, {"single": 1.0}),
                 QASetSpec("m", "multi_hop", {"train": 24, "dev": 4},
                           {"bridge": 0.5, "composition": 0.25, "comparison": 0.25}))),
        root / "world")
    write_toy_backbone(ToyBackboneConfig(), root / "world", root / "backbone")
    docs = DocStore(root / "world" / "corpus.jsonl")
    encoder = Encoder(EncoderConfig(batch_size=32))
    encode_shard(docs, encoder, 0, 1, root / "emb.npy", 1000)
    build_index([root / "emb.npy"], IndexConfig(num_shards=1), len(docs), root / "dense.faiss",
                {})
    return root, encoder, docs


@pytest.fixture(scope="module")
def tokenizer(toy):
    from a2tgpo.model.backbone import BackboneConfig, load_tokenizer

    return load_tokenizer(BackboneConfig(id="toy", path=str(toy[0] / "backbone")))


@pytest.fixture(scope="module")
def retriever(toy):
    from a2tgpo.retrieval.index import IndexConfig, load_index
    from a2tgpo.retrieval.retriever import DenseRetriever

    root, encoder, docs = toy
    return DenseRetriever(encoder, load_index(root / "dense.faiss", IndexConfig(), len(docs)),
                          docs)


@pytest.fixture(scope="module")
def questions(toy):
    return load_oracle_questions(toy[0] / "world", PAIRS)


@pytest.fixture(scope="module")
def demos(questions, retriever, tokenizer):
    tool = SearchTool(retriever, tokenizer, AGENT, SEARCH)
    return write_demonstrations(questions, tool, AGENT, imperfect_fraction=0.25, seed=0)


def fresh_model(toy):
    from a2tgpo.model.backbone import BackboneConfig, load_model

    return load_model(BackboneConfig(id="toy", path=str(toy[0] / "backbone"), dtype="float32"))


def test_questions_carry_lookups(questions):
    assert len(questions) == 40
    assert questions[0].id == "s/train_0"
    for q in questions:
        # the first lookup is named verbatim in the question: the oracle's first query
        assert q.lookups and q.lookups[0] in q.question
    assert {q.hop_type for q in questions} == {"single", "bridge", "composition", "comparison"}


def test_demonstrations_are_well_formed(demos, questions, tokenizer):
    assert [d.question_id for d in demos] == [q.id for q in questions]
    kinds = [d.extra["kind"] for d in demos]
    assert sum(k != "perfect" for k in kinds) == round(0.25 * len(demos))  # exactly the share
    for d, q in zip(demos, questions, strict=True):
        s = score_response(tokenizer.decode(d.response_ids(), skip_special_tokens=True),
                           q.golden_answers, "a2tgpo", training=True)
        assert s.format_ok, tokenizer.decode(d.response_ids(), skip_special_tokens=True)
        assert d.extra["em"] == s.em and d.reward == s.reward
        assert [t.stop for t in d.turns] == ["search"] * (len(d.turns) - 1) + ["answer"]
        assert all(lp == 0.0 for t in d.turns for lp in t.action_logprobs)
        if d.extra["kind"] == "perfect":
            assert s.em == 1.0, tokenizer.decode(d.response_ids(), skip_special_tokens=True)
            # one search per lookup: the exact names, in order
            assert [t.query for t in d.turns[:-1]] == list(q.lookups)
        if d.extra["kind"] == "guess":
            assert len(d.turns) == 1
        if d.extra["kind"] == "early_answer":
            assert d.num_tool_calls == 1 and len(q.lookups) > 1
    stats = demo_stats(demos)
    assert stats["demos"] == 40 and stats["format_ok"] == 1.0
    assert 0.6 <= stats["correct"] < 1.0  # the imperfect ones get some answers wrong
    assert stats["kinds"]["perfect"] == {"n": 30, "correct": 1.0}


def test_observations_are_the_search_tools_ids(demos, retriever, tokenizer):
    tool = SearchTool(retriever, tokenizer, AGENT, SEARCH)
    turns = [t for d in demos for t in d.turns if t.stop == "search"]
    assert turns
    fresh = tool.observe([t.query for t in turns])
    assert [list(t.obs_ids) for t in turns] == fresh
    for d in demos:  # actions are the oracle's text tokenised once, turn after turn
        text = tokenizer.decode(d.token_ids()[len(d.prompt_ids):])
        assert text.startswith("<think> ") and text.endswith("</answer>")


def test_oracle_retries_a_missed_page_then_answers_with_what_it_has():
    q = OracleQuestion("x/1", "In which country is Foo Labs headquartered?", ("Zedia",),
                       "bridge", ("Foo Labs", "Barton"))
    hit = " <result>\nPage 1: \"{t}\"\n{t} is headquartered in Barton.\n</result>"
    for seed in range(20):  # a seed whose slightly wrong query is the first one
        agent = oracle(q, "wrong_query", random.Random(seed))
        _, query = next(agent)
        if query != "Foo Labs":
            break
    # the misspelt query missed: it searches again with the exact name
    text, query = agent.send(hit.format(t="Other Labs"))
    assert query == "Foo Labs" and "do not mention Foo Labs" in text
    text, query = agent.send(hit.format(t="Foo Labs"))
    assert query == "Barton" and "Foo Labs is headquartered in Barton." in text
    # Barton's page never comes back: it answers with the bridge entity it has
    text, query = agent.send(" <result>\nNo search results found.\n</result>")
    assert query is None and "\\boxed{ Barton}" in text and "could not find Barton" in text


def test_a_planned_first_thought_counts_the_searches_of_multi_hop_questions():
    bridge = OracleQuestion("x/1", "In which country is Foo Labs headquartered?", ("Zedia",),
                            "bridge", ("Foo Labs", "Barton"))
    single = OracleQuestion("x/2", "Where is Foo Labs headquartered?", ("Barton",), "single",
                            ("Foo Labs",))
    # two lookups: two searches, said before the first one
    text, query = next(oracle(bridge, "perfect", random.Random(0), plan=True))
    assert text == ("<think> I need to find Foo Labs. The question takes 2 searches. </think> "
                    "<search> Foo Labs </search>") and query == "Foo Labs"
    # a single-hop question and the default (no plan) keep the plain first thought
    for q, plan in ((single, True), (bridge, False)):
        text, _ = next(oracle(q, "perfect", random.Random(0), plan=plan))
        assert text == "<think> I need to find Foo Labs. </think> <search> Foo Labs </search>"


def test_demonstrations_carry_the_plan_when_asked(questions, retriever, tokenizer):
    tool = SearchTool(retriever, tokenizer, AGENT, SEARCH)
    planned = write_demonstrations(questions, tool, AGENT, imperfect_fraction=0.25, seed=0,
                                   plan=True)
    for d, q in zip(planned, questions, strict=True):
        first = tokenizer.decode(d.turns[0].action_ids)
        assert ("The question takes" in first) == (len(q.lookups) > 1), first
        if len(q.lookups) > 1:
            assert f"takes {len(q.lookups)} searches." in first


def test_boxed_answer_has_the_passages_tokens(demos, tokenizer):
    """The answer in the box is tokenised exactly as the name after a space in a passage, so
    answering is copying ids, not re-tokenising (see `_answer`)."""
    checked = 0
    for d in demos:
        if d.extra["kind"] != "perfect" or not d.extra["em"]:
            continue
        action = d.turns[-1].action_ids
        text = tokenizer.decode(action)
        answer = text.split("\\boxed{")[1].split("}")[0]
        ids = tokenizer.encode(answer, add_special_tokens=False)
        assert answer.startswith(" ") and ids == tokenizer.encode(
            " " + answer.strip(), add_special_tokens=False)
        # the answer's very ids occur in the observations the demo read
        obs = [i for t in d.turns for i in t.obs_ids]
        assert any(obs[k:k + len(ids)] == ids for k in range(len(obs))), text
        # and in the action itself, right after the id of "{"
        k = next(k for k in range(len(action)) if tokenizer.decode(action[:k]).endswith("{"))
        assert list(action[k:k + len(ids)]) == ids
        checked += 1
    assert checked >= 10


def test_find_fact_reads_the_entitys_own_page():
    obs = (' <result>\nPage 1: "Kim Lee"\nKim Lee is a person. Kim Lee was born in the year '
           '1950.\nPage 2: "Ray Ono"\nRay Ono and Kim Lee attended X in the year 1990.\n'
           '</result>')
    assert find_fact(obs, "Kim Lee", "1950") == "Kim Lee was born in the year 1950."
    assert find_fact(obs, "Ray Ono", "1950") is None
    assert find_fact(obs, "Nobody", "x") is None
    assert find_fact(obs, "Kim Lee", "195") is None  # names match as whole words


def test_loss_is_on_action_tokens_only(demos, toy):
    model = fresh_model(toy)
    model.train()
    batch = collate(demos[:4], pad_id=0)
    n_actions = sum(len(t.action_ids) for d in demos[:4] for t in d.turns)
    assert int(batch.loss_mask.sum()) == n_actions
    assert 0 < shared_prefix_length(batch) < int(batch.prompt_lengths.min())
    loss, n = action_token_loss(model, batch)
    loss.backward()
    shared = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    assert n == n_actions
    # by hand, one plain forward: position i predicts token i+1; only loss_mask 1 counts
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:],
                                           reduction="none")
    manual = (ce * batch.loss_mask[:, 1:]).sum()
    manual.backward()
    # running the shared prefix once gives the same loss and the same gradients
    assert torch.allclose(loss, manual, rtol=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(shared[k], p.grad, rtol=1e-4, atol=1e-4, msg=k)


def test_sft_lowers_the_demo_loss(demos, toy, tokenizer):
    model = fresh_model(toy)
    sub = demos[:16]
    before = demo_loss(model, sub, tokenizer.pad_token_id)
    cfg = SftConfig(epochs=3, batch_size=4, lr=5e-3, warmup_ratio=0.1)
    history = train_sft(model, sub, cfg, tokenizer.pad_token_id, progress=False)
    after = demo_loss(model, sub, tokenizer.pad_token_id)
    assert history["steps"] == 12 and history["skipped_too_long"] == 0
    assert after < 0.7 * before, (before, after)
    losses = [e["loss"] for e in history["epochs"]]
    assert losses[-1] < losses[0]


def test_same_seed_same_weights_and_long_demos_left_out(demos, toy, tokenizer):
    cfg = SftConfig(epochs=1, batch_size=2, seed=5)
    sub = demos[:4]

    def run(cfg):
        model = fresh_model(toy)
        h = train_sft(model, sub, cfg, tokenizer.pad_token_id, progress=False)
        return model.state_dict(), h

    (a, ha), (b, _) = run(cfg), run(cfg)
    assert ha["steps"] == 2
    assert all(torch.equal(a[k], b[k]) for k in a)
    # sequences over max_seq_len are counted and left out, never cut
    lengths = sorted(len(d.prompt_ids) + d.response_length() for d in sub)
    _, h = run(dataclasses.replace(cfg, max_seq_len=lengths[1]))
    assert h["skipped_too_long"] == 2 and h["sequences"] == 2


def test_epochs_cycle_through_the_redrawn_demonstration_sets(demos, toy, tokenizer):
    cfg = SftConfig(epochs=3, batch_size=2, seed=5)

    def run(redraws):
        model = fresh_model(toy)
        h = train_sft(model, demos[:4], cfg, tokenizer.pad_token_id, progress=False,
                      redraws=redraws)
        return model.state_dict(), h

    # epochs train on sets 0, 1, 0: 4, 2 and 4 sequences in batches of 2
    _, h = run([demos[4:6]])
    assert h["steps"] == 2 + 1 + 2 and [e["epoch"] for e in h["epochs"]] == [1, 2, 3]
    # a redraw equal to the first set trains exactly as no redraw; another set does not
    (a, _), (b, _), (c, _) = run([]), run([demos[:4]]), run([demos[4:8]])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_length_batches_cover_each_sequence_once_per_epoch():
    lengths = [(i * 37) % 800 for i in range(50)]
    a = length_batches(lengths, 4, random.Random(1), pool=4)
    assert sorted(i for b in a for i in b) == list(range(50))
    assert sorted(len(b) for b in a) == [2] + [4] * 12
    assert a == length_batches(lengths, 4, random.Random(1), pool=4)
    assert a != length_batches(lengths, 4, random.Random(2), pool=4)
    # one window over everything: each batch is a run of neighbours in length
    ranked = sorted(range(50), key=lambda i: lengths[i])
    runs = sorted(ranked[s: s + 4] for s in range(0, 50, 4))
    assert sorted(length_batches(lengths, 4, random.Random(1), pool=13)) == runs


def test_main_writes_a_loadable_model(toy, tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from a2tgpo.data.qa import row_schema

    root = toy[0]
    (tmp_path / "c.yaml").write_text(
        "sft:\n  epochs: 1\n  batch_size: 4\n  datasets: [s/train, m/train]\n")
    # a prepared dev file holding two training questions: they are left out
    held = [{"id": i, "question": "q", "golden_answers": ["a"], "source": "s", "split": "train",
             "group": "single_hop", "hop_type": "single", "hops": 1}
            for i in ("s/train_0", "m/train_1")]
    pq.write_table(pa.Table.from_pylist(held, schema=row_schema()), tmp_path / "dev.parquet")
    out = tmp_path / "sft"
    assert main(tmp_path / "c.yaml", ["max_questions=10"], backbone_dir=root / "backbone",
                world_dir=root / "world", corpus=root / "world" / "corpus.jsonl",
                index=root / "dense.faiss", out_dir=out, holdout=tmp_path / "dev.parquet") == 0
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["held_out"] == 2 and summary["demonstrations"]["demos"] == 10
    assert summary["training"]["steps"] == 3 and summary["final_loss"] > 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size >= len(tok) and tok.chat_template  # a backbone again
    assert not list(tmp_path.glob(".sft.*"))  # no temporary directory left behind


def test_early_answer_fraction_is_exact_and_multi_hop_only(questions):
    # the fixture world: 16 single-hop and 24 multi-hop questions
    multi = [i for i, q in enumerate(questions) if len(q.lookups) > 1]
    assert len(multi) == 24
    kinds = assign_kinds(questions, 0.25, 0, early_answer_fraction=0.75)
    early = [i for i, k in enumerate(kinds) if k == "early_answer"]
    # round(0.75 × 24) = 18 drawn first, all multi-hop, then round(0.25 × 22) = 6 (rounded
    # half to even from 5.5) of the 22 others are imperfect, a few of them early_answer again
    first = [i for i in multi if kinds[i] == "early_answer"]
    assert 18 <= len(first) and set(early) <= set(multi)
    assert sum(k != "perfect" for k in kinds) == 18 + 6
    # 0 leaves the one-fraction draw exactly as it was: the draw written out again here
    rng = random.Random(0)
    before = ["perfect"] * len(questions)
    for i in sorted(rng.sample(range(len(questions)), 10)):
        before[i] = rng.choice(("guess", "wrong_query")
                               + (("early_answer",) if len(questions[i].lookups) > 1 else ()))
    assert assign_kinds(questions, 0.25, 0, 0.0) == before
    assert sum(k != "perfect" for k in assign_kinds(questions, 0.25, 0)) == 10  # 0.25 × 40
    # the whole multi-hop share: every multi-hop demonstration stops after its first hop
    all_early = assign_kinds(questions, 0.0, 0, early_answer_fraction=1.0)
    assert [i for i, k in enumerate(all_early) if k == "early_answer"] == multi


def test_guess_fraction_is_exact_and_drawn_first(questions):
    # the fixture world: 40 questions, 24 of them multi-hop
    kinds = assign_kinds(questions, 0.5, 0, early_answer_fraction=0.5, guess_fraction=0.6)
    guesses = [i for i, k in enumerate(kinds) if k == "guess"]
    # round(0.6 × 40) = 24 guesses first; then round(0.5 × m) early answers of the m
    # multi-hop questions left; then half of the rest imperfect (guess among the kinds again)
    first = set(random.Random("0:guess").sample(range(40), 24))
    assert first <= set(guesses)
    multi_left = [i for i, q in enumerate(questions) if len(q.lookups) > 1 and i not in first]
    early = [i for i in multi_left if kinds[i] == "early_answer"]
    assert len(early) >= round(0.5 * len(multi_left))  # the imperfect draw may add some
    # without the imperfect draw both counts are exact, and the rest is perfect
    exact = assign_kinds(questions, 0.0, 0, early_answer_fraction=0.5, guess_fraction=0.6)
    assert {i for i, k in enumerate(exact) if k == "guess"} == first
    assert sum(k == "early_answer" for k in exact) == round(0.5 * len(multi_left))
    assert sum(k == "perfect" for k in exact) == 40 - 24 - round(0.5 * len(multi_left))
    # the guess demonstration answers at once, with a name from the question
    demo = oracle(questions[0], "guess", random.Random(0))
    text, query = next(demo)
    assert query is None and "<answer>" in text and questions[0].lookups[0] in text
    # 0 leaves the draw as it was
    assert assign_kinds(questions, 0.25, 0, 0.5, 0.0) == assign_kinds(questions, 0.25, 0, 0.5)
    assert assign_kinds(questions, 0.0, 0, guess_fraction=1.0) == ["guess"] * 40
    with pytest.raises(ValueError, match="guess_fraction"):
        SftConfig(guess_fraction=1.2)


def test_config_checks():
    with pytest.raises(ValueError, match="imperfect_fraction"):
        SftConfig(imperfect_fraction=1.5)
    with pytest.raises(ValueError, match="early_answer_fraction"):
        SftConfig(early_answer_fraction=-0.1)
    with pytest.raises(ValueError, match="<dataset>/<split>"):
        SftConfig(datasets=("toy_nq",))


def test_only_a2tgpo_style(questions, retriever, tokenizer):
    cfg = AgentConfig(prompt_style="search_r1")
    with pytest.raises(ValueError, match="a2tgpo"):
        write_demonstrations(questions[:1], SearchTool(retriever, tokenizer, cfg, SEARCH), cfg,
                             imperfect_fraction=0.0, seed=0)

