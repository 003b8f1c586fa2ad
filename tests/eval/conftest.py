"""A tiny evaluable grid cell: toy world, tiny model, index, prepared test sets, checkpoints.

The model is not warm-started on the oracle demonstrations (too slow for these tests); instead
it is fitted to ONE fixed script on the test questions' own prompts: search for `SCRIPT_QUERY`,
then answer `\\boxed{<ANSWER>}` where ANSWER is the gold answer of the first test question.
Greedy decoding then repeats the script, so evaluation goes through a real search call, a real
answer extraction and a known, non-trivial EM (the questions whose golds match ANSWER).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

SCRIPT_QUERY = "capital city"
TEST_SETS = {"ts": ("single_hop", 5), "tm": ("multi_hop", 3)}  # name: (group, questions)


def _script(answer: str) -> tuple[str, str]:
    # the two actions, written like the warm-start demonstrations (a2tgpo/train/sft.py)
    return (f"<think> look it up </think> <search> {SCRIPT_QUERY} </search>",
            (f" <think> found </think> <answer> The final answer is \\[ \\boxed{{{answer}}} \\] "
             "</answer>"))


@pytest.fixture(scope="session")
def toy_cell(tmp_path_factory):
    """The cell: root, cell (directory), cfg, answer (what the script answers), query (what
    it searches), tests ({name: parquet path}), sets ({name: (group, questions)})."""
    import torch

    from a2tgpo.algo.methods import METHODS
    from a2tgpo.config import dump_config
    from a2tgpo.data.qa import DataConfig, DatasetSource, load_split, prepare_data
    from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
    from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig
    from a2tgpo.retrieval.index import IndexConfig, build_index, encode_shard
    from a2tgpo.retrieval.retriever import RetrievalConfig, build_retriever
    from a2tgpo.rollout.agent import AgentConfig, SearchTool, prompt_ids
    from a2tgpo.rollout.trajectory import TrajectoryBuilder, Turn
    from a2tgpo.tracking import TrackingConfig
    from a2tgpo.train.checkpoint import save_checkpoint
    from a2tgpo.train.config import ScheduleConfig, TrainConfig
    from a2tgpo.train.sft import SftConfig, train_sft

    root = tmp_path_factory.mktemp("evalcell")
    sets = tuple(QASetSpec(name, group, {"train": 4, "test": n} if name == "ts" else {"test": n},
                           {"single": 1.0} if group == "single_hop" else {"bridge": 1.0})
                 for name, (group, n) in TEST_SETS.items())
    write_world(WorldConfig(countries=3, cities=6, people=12, films=6, bands=3, companies=4,
                            distractors=4, qa_sets=sets), root / "world")
    write_toy_backbone(ToyBackboneConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16),
                       root / "world", root / "base")
    docs = DocStore(root / "world" / "corpus.jsonl")
    encode_shard(docs, Encoder(EncoderConfig()), 0, 1, root / "s.npy", 1000)
    build_index([root / "s.npy"], IndexConfig(num_shards=1), len(docs), root / "i.faiss", {})

    def src(name, split, group):
        return DatasetSource(name=name, loader="flashrag", repo=str(root / "world" / "qa"),
                             subset=name, split=split, group=group)

    prepare_data(DataConfig(train=(src("ts", "train", "single_hop"),),
                            test=tuple(src(n, "test", g) for n, (g, _) in TEST_SETS.items()),
                            dev_size=2), root / "data")
    tests = {n: root / "data" / "test" / f"{n}.parquet" for n in TEST_SETS}
    rows = [r for n in TEST_SETS for r in load_split(tests[n])]
    answer = rows[0]["golden_answers"][0]

    # fit the script on every test prompt (the observation is the real search result)
    agent = AgentConfig(max_turn_tokens=48, max_response_tokens=400, max_obs_tokens=60)
    retrieval = RetrievalConfig()
    backbone = BackboneConfig(id="toy", path=str(root / "base"), dtype="float32")
    tok = load_tokenizer(backbone)
    retriever = build_retriever(retrieval, root / "world" / "corpus.jsonl", root / "i.faiss")
    tool = SearchTool(retriever, tok, agent, retrieval)
    search, final = _script(answer)
    (obs,) = tool.observe([SCRIPT_QUERY])
    retriever.close()
    demos = []
    for r in rows:
        b = TrajectoryBuilder(prompt_ids(tok, r["question"], agent.prompt_style),
                              question_id=r["id"], group_id=r["id"])
        for text, o, stop in ((search, obs, "search"), (final, [], "answer")):
            ids = tok.encode(text, add_special_tokens=False)
            b.add_turn(Turn(tuple(ids), (0.0,) * len(ids), tuple(o), stop), b.ids)
        demos.append(b.build())
    model = load_model(backbone)
    train_sft(model, demos, SftConfig(epochs=60, lr=1e-2, batch_size=8, warmup_ratio=0.0,
                                      max_seq_len=1024), tok.pad_token_id, progress=False)

    cell = root / "runs" / "backbone~toy" / "method~grpo" / "beta~0" / "seed~1"
    cfg = TrainConfig(
        run_dir=str(cell), results_dir=str(root / "results"), seed=1, backbone=backbone,
        method=METHODS["grpo"], train_file=str(root / "data" / "train.parquet"),
        dev_file=str(root / "data" / "dev.parquet"),
        corpus=str(root / "world" / "corpus.jsonl"), index=str(root / "i.faiss"),
        retrieval=retrieval, rollout=agent,
        schedule=ScheduleConfig(steps=2, prompts_per_step=2, mini_batch_prompts=1),
        tracking=TrackingConfig(mlflow=False))
    cell.mkdir(parents=True)
    dump_config(cfg, cell / "config.yaml")
    opt = torch.optim.AdamW(model.parameters())
    for step in (0, 2):  # two checkpoints with the same weights
        save_checkpoint(cell, step, model=model, tokenizer=tok, optimizer=opt,
                        trainer_state={"step": step}, keep_last=5)
    return SimpleNamespace(root=root, cell=cell, cfg=cfg, answer=answer, query=SCRIPT_QUERY,
                           tests=tests, sets=dict(TEST_SETS))


@pytest.fixture
def own_cell(toy_cell, tmp_path):
    """(cell dir, cfg): a copy of the toy cell for a test that writes into it, its config
    pointing at the copy."""
    import shutil

    from a2tgpo.config import dump_config

    dest = tmp_path / "backbone~toy" / "method~grpo" / "beta~0" / "seed~1"
    shutil.copytree(toy_cell.cell, dest)
    cfg = dataclasses.replace(toy_cell.cfg, run_dir=str(dest))
    dump_config(cfg, dest / "config.yaml")
    return dest, cfg
