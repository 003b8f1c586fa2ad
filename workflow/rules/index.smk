# Dense index: encode the corpus in shards (one job each, resumable), build one faiss index,
# or check a prebuilt one; measure first-hop recall on the toy world.

RET = STUDY.retrieval
NSHARDS = RET.index.num_shards


rule encode_shard:
    input:
        cfg=f"{R}/configs/retrieval.yaml",
        corpus=corpus_file(),
    output:
        f"{R}/index/emb/shard-{{shard}}-of-{NSHARDS}.npy",
    log:
        f"{R}/logs/encode_shard-{{shard}}.log",
    resources:
        # the encoder runs on a GPU when one is there (the local profile caps gpu at 0)
        gpu=0 if RET.encoder.device == "cpu" else 1,
        runtime=720,
    shell:
        "a2tgpo encode-corpus {input.cfg:q} --corpus {input.corpus:q} --shard {wildcards.shard} "
        "--out {output:q} > {log:q} 2>&1"


rule build_index:
    input:
        cfg=f"{R}/configs/retrieval.yaml",
        corpus=corpus_file(),
        shards=[f"{R}/index/emb/shard-{i}-of-{NSHARDS}.npy" for i in range(NSHARDS)],
    output:
        index=f"{R}/index/dense.faiss",
        meta=f"{R}/index/dense.faiss.json",
    log:
        f"{R}/logs/build_index.log",
    resources:
        runtime=720,
    shell:
        "a2tgpo build-index {input.cfg:q} --corpus {input.corpus:q} --shards {input.shards:q} "
        "--out {output.index:q} > {log:q} 2>&1"


rule check_index:
    """The index (a prebuilt one, e.g. Search-R1's e5_Flat.index, or ours) must hold one vector
    per passage, row for row: a sample of passages is re-encoded with the configured encoder."""
    input:
        cfg=f"{R}/configs/retrieval.yaml",
        corpus=corpus_file(),
        index=index_file(),
        encoder=ENCODER_INPUTS,
    output:
        f"{R}/index/check.json",
    log:
        f"{R}/logs/check_index.log",
    shell:
        "a2tgpo check-index {input.cfg:q} --corpus {input.corpus:q} --index {input.index:q} "
        "--out {output:q} > {log:q} 2>&1"


rule retrieval_eval:
    input:
        cfg=f"{R}/configs/retrieval.yaml",
        corpus=corpus_file(),
        index=index_file(),
        world=f"{R}/world/summary.json",
    output:
        f"{R}/retrieval/recall.json",
    log:
        f"{R}/logs/retrieval_eval.log",
    shell:
        "a2tgpo retrieval-eval {input.cfg:q} --corpus {input.corpus:q} --index {input.index:q} "
        "--world {R:q}/world --out {output:q} > {log:q} 2>&1"


rule sft:
    """Warm-start of the built (toy) backbone: the policy every toy method starts from."""
    input:
        cfg=f"{R}/configs/sft.yaml",
        backbone=[f"{cfg.path}/config.json" for cfg in TOY_BACKBONES.values()],
        world=f"{R}/world/summary.json",
        data=f"{R}/data/summary.json",
        index=index_file(),
        corpus=corpus_file(),
        retrieval=f"{R}/configs/retrieval.yaml",
    output:
        f"{R}/sft/config.json",
    log:
        f"{R}/logs/sft.log",
    resources:
        gpu=1,
        runtime=120,
    params:
        backbone=lambda wc, input: str(Path(input.backbone[0]).parent),
    shell:
        "a2tgpo sft {input.cfg:q} --backbone {params.backbone:q} --world {R:q}/world "
        "--corpus {input.corpus:q} --index {input.index:q} --retrieval {input.retrieval:q} "
        "--holdout {R:q}/data/dev.parquet --out {R:q}/sft > {log:q} 2>&1"
