"""Shared fixtures of the training tests."""

import pytest

from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.rollout.agent import AgentConfig
from a2tgpo.tracking import TrackingConfig
from a2tgpo.train.config import OptimConfig, ScheduleConfig, TrainConfig


@pytest.fixture(scope="session")
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
    demos = write_demonstrations(qs, SearchTool(retriever, tok, agent, retrieval), agent,
                                 imperfect_fraction=0.25, seed=0)
    model = load_model(BackboneConfig(id="toy", path=str(root / "base"), dtype="float32"))
    # enough epochs for the tags and the answer format: rewards must differ within groups
    train_sft(model, demos, SftConfig(epochs=20, lr=5e-3, batch_size=8, max_seq_len=1024),
              tok.pad_token_id, progress=False)
    model.save_pretrained(root / "sft")
    tok.save_pretrained(root / "sft")
    return root, agent, retrieval



@pytest.fixture(scope="session")
def toy_train_config(toy):
    """make(run_dir, method, schedule=..., lr=..., **TrainConfig keys): a TrainConfig on the
    `toy` world, starting from its warm-started model."""
    return lambda *a, **kw: _toy_train_config(toy, *a, **kw)


def _toy_train_config(toy, run_dir, method, *, schedule: ScheduleConfig, lr=1e-3, **kw):
    root, agent, retrieval = toy
    return TrainConfig(
        run_dir=str(run_dir), results_dir=str(run_dir.parent), seed=kw.pop("seed", 1),
        backbone=BackboneConfig(id="toy", path=str(root / "sft"), dtype="float32"),
        method=method, train_file=str(root / "data" / "train.parquet"),
        dev_file=str(root / "data" / "dev.parquet"),
        corpus=str(root / "world" / "corpus.jsonl"), index=str(root / "i.faiss"),
        retrieval=retrieval, rollout=agent,
        # weight decay 0: a parameter may change only through its gradient
        optim=OptimConfig(lr=lr, weight_decay=0.0), schedule=schedule,
        tracking=kw.pop("tracking", TrackingConfig(mlflow=False)), device="cpu", **kw)
