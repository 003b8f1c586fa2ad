# Checkpoint selection and evaluation of every cell: best.json, then eval/ (EM/F1 per test set,
# predictions, group averages), logged into the cell's MLflow run.

EVAL = STUDY.eval
# The engine's memory share and batching change speed, not results: they go into the command,
# not params, so under the cluster profile (whose rerun triggers leave out code) editing them
# does not rerun finished evaluations. The override comes before the options that take lists.
EVAL_ARGS = f"engine_memory_share={EVAL.engine_memory_share} --chunk {EVAL.chunk}" + (
    f" --max-batch {EVAL.max_batch}" if EVAL.max_batch else ""
)


rule evaluate_all:
    """The papers' protocol (train.selection: test_avg): every saved checkpoint on the test
    sets. Finished steps are kept in eval_all/ if the job dies; the marker is the output."""
    input:
        cfg=f"{R}/runs/{{cell}}/config.yaml",
        train=f"{R}/runs/{{cell}}/summary.json",
        data=lambda wc: f"{data_dir(Cell.parse(wc.cell).data)}/summary.json",
    output:
        f"{R}/runs/{{cell}}/eval_all.done",
    log:
        f"{R}/logs/runs/{{cell}}/evaluate_all.log",
    threads: EVAL.threads
    resources:
        gpu=lambda wc: job_gpus(Cell.parse(wc.cell).backbone, EVAL.gpus),
        runtime=eval_all_runtime,
        mem_mb=eval_mem_mb,
        cpus_per_task=EVAL.threads,  # as the train rule's (common.smk, job_cpus_env)
    params:
        tests=lambda wc: track_tests(Cell.parse(wc.cell).data),
    shell:
        "HF_HUB_OFFLINE=1 "
        + job_cpus_env(EVAL.threads)
        + WITH_RETRIEVER
        + "a2tgpo evaluate {input.cfg:q} "
        + EVAL_ARGS
        + " --all-checkpoints "
        "--test {params.tests:q} --out {R:q}/runs/{wildcards.cell}/eval_all > {log:q} 2>&1 "
        "&& touch {output:q}"


rule select:
    """The checkpoint evaluation uses: best dev EM (default) or the papers' best test average
    (train.selection: test_avg; the tables label it so)."""
    input:
        train=f"{R}/runs/{{cell}}/summary.json",
        all=[f"{R}/runs/{{cell}}/eval_all.done"] if TRAIN.selection == "test_avg" else [],
    output:
        f"{R}/runs/{{cell}}/best.json",
    log:
        f"{R}/logs/runs/{{cell}}/select.log",
    localrule: True
    params:
        criterion=TRAIN.selection,
    shell:
        "a2tgpo select {R:q}/runs/{wildcards.cell} --criterion {params.criterion} "
        "--out {output:q} > {log:q} 2>&1"


rule evaluate:
    """Greedy rollouts of the selected checkpoint on every test set: EM/F1 per dataset and
    sample-weighted group averages, logged into the cell's MLflow run."""
    input:
        cfg=f"{R}/runs/{{cell}}/config.yaml",
        best=f"{R}/runs/{{cell}}/best.json",
        data=lambda wc: f"{data_dir(Cell.parse(wc.cell).data)}/summary.json",
    output:
        f"{R}/runs/{{cell}}/eval/summary.json",
    log:
        f"{R}/logs/runs/{{cell}}/evaluate.log",
    threads: EVAL.threads
    resources:
        gpu=lambda wc: job_gpus(Cell.parse(wc.cell).backbone, EVAL.gpus),
        runtime=EVAL.runtime_min,
        mem_mb=eval_mem_mb,
        cpus_per_task=EVAL.threads,  # as the train rule's (common.smk, job_cpus_env)
    params:
        tests=lambda wc: track_tests(Cell.parse(wc.cell).data),
    shell:
        "HF_HUB_OFFLINE=1 "
        + job_cpus_env(EVAL.threads)
        + WITH_RETRIEVER
        + "a2tgpo evaluate {input.cfg:q} "
        + EVAL_ARGS
        + " --best {input.best:q} "
        "--test {params.tests:q} --out {R:q}/runs/{wildcards.cell}/eval > {log:q} 2>&1"
