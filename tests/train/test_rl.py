"""The RL recipe on the toy world: every method id runs 2 optimizer updates after a short
warm-start, with finite losses, and changes every trainable parameter tensor."""

import dataclasses
import json
import math

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.rollout.agent import AgentConfig
from a2tgpo.tracking import TrackingConfig
from a2tgpo.train.config import OptimConfig, ScheduleConfig, TrainConfig

pytestmark = pytest.mark.slow

# one method per estimator / rollout shape runs in the default suite; all of them with -m expensive
REPRESENTATIVE = {"react", "grpo", "dapo", "gspo", "igpo", "a2tgpo", "gigpo", "aepo",
                  "tree_grpo", "at2po"}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """World -> backbone -> index -> prepared data -> a few epochs of warm-start SFT."""
    from a2tgpo.data.qa import DataConfig, DatasetSource, prepare_data
    from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
    from a2tgpo.model.backbone import load_model, load_tokenizer
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig
    from a2tgpo.retrieval.index import IndexConfig, build_index, encode_shard
    from a2tgpo.retrieval.retriever import RetrievalConfig, build_retriever
    from a2tgpo.rollout.agent import SearchTool
    from a2tgpo.train.sft import SftConfig, load_oracle_questions, train_sft, write_demonstrations

    root = tmp_path_factory.mktemp("rl")
    world = WorldConfig(countries=4, cities=8, people=30, films=12, bands=6, companies=8,
                        distractors=10, qa_sets=(
                            QASetSpec("tq", "single_hop", {"train": 40, "dev": 6},
                                      {"single": 1.0}),
                            QASetSpec("tm", "multi_hop", {"train": 20},
                                      {"bridge": 0.8, "comparison": 0.2})))
    write_world(world, root / "world")
    write_toy_backbone(ToyBackboneConfig(hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2), root / "world", root / "base")
    docs = DocStore(root / "world" / "corpus.jsonl")
    encode_shard(docs, Encoder(EncoderConfig()), 0, 1, root / "s.npy", 1000)
    build_index([root / "s.npy"], IndexConfig(num_shards=1), len(docs), root / "i.faiss", {})
    src = lambda name, split: DatasetSource(name=name, loader="flashrag",  # noqa: E731
                                            repo=str(root / "world" / "qa"), subset=name,
                                            split=split, group="mixed")
    prepare_data(DataConfig(train=(src("tq", "train"), src("tm", "train")),
                            test=(src("tq", "dev"),), dev_size=6), root / "data")
    agent = AgentConfig(max_turn_tokens=40, max_response_tokens=400, max_obs_tokens=120)
    retrieval = RetrievalConfig()
    tok = load_tokenizer(BackboneConfig(id="toy", path=str(root / "base")))
    retriever = build_retriever(retrieval, root / "world" / "corpus.jsonl", root / "i.faiss")
    qs = load_oracle_questions(root / "world", [("tq", "train"), ("tm", "train")])
    demos = write_demonstrations(qs, SearchTool(retriever, tok, agent), agent,
                                 imperfect_fraction=0.25, seed=0)
    model = load_model(BackboneConfig(id="toy", path=str(root / "base"), dtype="float32"))
    # enough epochs for the tags and the answer format: rewards must differ within groups
    train_sft(model, demos, SftConfig(epochs=20, lr=5e-3, batch_size=8, max_seq_len=1024),
              tok.pad_token_id, progress=False)
    model.save_pretrained(root / "sft")
    tok.save_pretrained(root / "sft")
    return root, agent, retrieval


def small(method):
    """The same method at a CPU test's size: fewer rollouts, the same code path."""
    r = method.rollout
    shapes = {"chains": dict(n=4), "tree_random": dict(n=4, tree_m=2, tree_n=1, tree_l=1,
                                                       tree_k=2),
              "tree_entropy": dict(n=5, tree_m=3, tree_l=1, tree_k=2),
              "aepo": dict(n=4, aepo_initial=2)}
    # DAPO's overlong buffer (2000 of 6192 in the paper) scaled to this test's 400 tokens
    d = dataclasses.replace(method.dapo, max_num_gen_batches=20,
                            overlong_buffer=min(method.dapo.overlong_buffer, 100))
    return dataclasses.replace(method, rollout=dataclasses.replace(r, **shapes[r.shape]), dapo=d)


@pytest.mark.parametrize("method_id", [
    m if m in REPRESENTATIVE else pytest.param(m, marks=pytest.mark.expensive)
    for m in sorted(METHODS)])
def test_two_updates_change_every_parameter(toy, method_id, tmp_path):
    from a2tgpo.model.backbone import load_model
    from a2tgpo.train.rl import train

    root, agent, retrieval = toy
    backbone = BackboneConfig(id="toy", path=str(root / "sft"), dtype="float32")
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"), results_dir=str(tmp_path), seed=1,
        backbone=backbone, method=small(METHODS[method_id]),
        train_file=str(root / "data" / "train.parquet"),
        dev_file=str(root / "data" / "dev.parquet"),
        corpus=str(root / "world" / "corpus.jsonl"), index=str(root / "i.faiss"),
        retrieval=retrieval, rollout=agent,
        # weight decay 0: a parameter may change only through its gradient
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        schedule=ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1,
                                micro_batch_size=4, eval_every=1, eval_questions=2,
                                save_every=1),
        tracking=TrackingConfig(mlflow=False))
    train(cfg)
    start = load_model(backbone).state_dict()
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    final = load_model(BackboneConfig(id="toy", path=str(ckpts[-1] / "model"),
                                      dtype="float32")).state_dict()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train_rows = [r for r in rows if "loss/total" in r]
    if not METHODS[method_id].train:  # ReAct: evaluation only, the weights stay as they were
        assert not train_rows
        assert all(torch.equal(start[k], final[k]) for k in start)
        return
    assert len(train_rows) == 1 and math.isfinite(train_rows[0]["loss/total"])
    assert train_rows[0]["rollout/trajectories"] >= 2
    unchanged = [k for k in start if torch.equal(start[k], final[k])]
    assert not unchanged, f"{method_id}: parameters not updated: {unchanged}"
