# World, toy backbone, QA data and corpus: everything the index, training and evaluation read.


rule resolve_section:
    """One validated config section, defaults filled in: the file a stage command reads.
    Editing that section in config/config.yaml (a params change) reruns only its consumers."""
    input:
        lambda wc: ENCODER_INPUTS if wc.section.split(".")[0] == "retrieval" else [],
    output:
        f"{R}/configs/{{section}}.yaml",
    localrule: True
    params:
        values=lambda wc: config.get(wc.section.split(".")[0], {}),
    run:
        from a2tgpo.study import section
        from a2tgpo.config import dump_config

        dump_config(section(STUDY, wildcards.section), output[0])


rule world:
    input:
        f"{R}/configs/world.yaml",
    output:
        corpus=f"{R}/world/corpus.jsonl",
        summary=f"{R}/world/summary.json",
    log:
        f"{R}/logs/world.log",
    shell:
        "a2tgpo world {input:q} --out {R:q}/world > {log:q} 2>&1"


rule toy_backbone:
    input:
        cfg=f"{R}/configs/toy_backbone.yaml",
        world=f"{R}/world/summary.json",
    output:
        [f"{cfg.path}/config.json" for cfg in TOY_BACKBONES.values()],
    log:
        f"{R}/logs/toy_backbone.log",
    params:
        out=lambda wc, output: str(Path(output[0]).parent),
    shell:
        "a2tgpo toy-backbone {input.cfg:q} --world {R:q}/world --out {params.out:q} > {log:q} 2>&1"


rule prepare_data:
    input:
        cfg=f"{R}/configs/data.yaml",
        world=[f"{R}/world/summary.json"] if uses_world() else [],
    output:
        train=f"{R}/data/train.parquet",
        dev=f"{R}/data/dev.parquet",
        tests=[f"{R}/data/test/{s.name}.parquet" for s in STUDY.data.test],
        summary=f"{R}/data/summary.json",
    log:
        f"{R}/logs/prepare_data.log",
    shell:
        "a2tgpo prepare-data {input.cfg:q} --out {R:q}/data > {log:q} 2>&1"


rule track_data_config:
    """The data section of one training track: its training and test sources only."""
    output:
        f"{R}/configs/data~{{track}}.yaml",
    localrule: True
    params:
        values=lambda wc: to_dict(STUDY.track_data(wc.track)),
    run:
        from a2tgpo.config import dump_config

        dump_config(STUDY.track_data(wildcards.track), output[0])


rule prepare_track_data:
    """Prepared splits of one track (its own dev holdout from its own training sets)."""
    input:
        cfg=f"{R}/configs/data~{{track}}.yaml",
        world=[f"{R}/world/summary.json"] if uses_world() else [],
    output:
        train=f"{R}/data/{{track}}/train.parquet",
        dev=f"{R}/data/{{track}}/dev.parquet",
        summary=f"{R}/data/{{track}}/summary.json",
    log:
        f"{R}/logs/prepare_data-{{track}}.log",
    shell:
        "a2tgpo prepare-data {input.cfg:q} --out {R:q}/data/{wildcards.track} > {log:q} 2>&1"


rule download_corpus:
    input:
        f"{R}/configs/corpus.download.yaml",
    output:
        [f"{R}/corpus/{STUDY.corpus.download.filename}"]
        + (
            [f"{R}/corpus/{STUDY.corpus.download.index.combined_name}"]
            if STUDY.corpus.download.index.enabled
            else []
        ),
    log:
        f"{R}/logs/download_corpus.log",
    resources:
        runtime=600,
    shell:
        "a2tgpo download-corpus {input:q} --out {R:q}/corpus > {log:q} 2>&1"
