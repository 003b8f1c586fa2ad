# Optuna sweeps of β/γ (a2tgpo/sweep.py): one Optuna study per sweep config listed in the
# study config's `sweeps`, stored in <R>/sweeps/<name>/journal.log. Each trial is a job of its
# own (ask -> train -> dev EM -> tell), so Snakemake runs as many at once as cores/resources
# allow; `snakemake sweep_<name>` runs one sweep (not part of the default target).
# A trial's run folder is a param, not an output: a killed trial's rerun resumes it.
# The sweep files are loaded and checked against the study in common.smk (SWEEPS).

import json

from a2tgpo.config import NAME, to_dict


wildcard_constraints:
    sweep=NAME.pattern,
    trial=r"[0-9]+",


rule sweep_base_config:
    """The base cell's resolved config; its params are the resolved values, so editing the
    study config reruns the sweep's trials."""
    output:
        f"{R}/sweeps/{{sweep}}/base.yaml",
    localrule: True
    params:
        resolved=lambda wc: json.dumps(to_dict(sweep_base(wc.sweep)), sort_keys=True),
    run:
        from a2tgpo.config import dump_config

        dump_config(sweep_base(wildcards.sweep), output[0])


rule sweep_trial:
    """Trial i: ask (or retry the params of a trial a killed job left RUNNING), train, tell
    the best dev EM. The sweep file is a param by path: raising n_trials adds trial jobs;
    other edits are refused by the trial (the journal records the sweep's settings)."""
    input:
        base=f"{R}/sweeps/{{sweep}}/base.yaml",
        data=lambda wc: f"{data_dir(SWEEPS[wc.sweep][1].base.track)}/summary.json",
        index=f"{R}/index/check.json",
        policy=lambda wc: policy_inputs(SWEEPS[wc.sweep][1].base.backbone),
        encoder=ENCODER_INPUTS,
        mlflow=[ancient(f"{R}/mlflow/experiment.json")] if STUDY.tracking.mlflow else [],
    output:
        f"{R}/sweeps/{{sweep}}/trials/{{trial}}/result.json",
    log:
        f"{R}/logs/sweeps/{{sweep}}/trial_{{trial}}.log",
    threads: TRAIN.threads
    resources:
        gpu=lambda wc: job_gpus(SWEEPS[wc.sweep][1].base.backbone),
        runtime=TRAIN.runtime_min,
        mem_mb=train_mem_mb,
        cpus_per_task=TRAIN.threads,  # as the train rule's (common.smk, job_cpus_env)
    params:
        sweep=lambda wc: SWEEPS[wc.sweep][0],
        # a trial's own retrieval server (retrieval.http.serve: job), as a training job's
        retriever=lambda wc, input: with_retriever(
            input.base, f"{R}/sweeps/{wc.sweep}/trials/{wc.trial}/retriever"
        ),
    shell:
        "HF_HUB_OFFLINE=1 "
        + job_cpus_env(TRAIN.threads)
        + "exec {params.retriever}a2tgpo sweep-trial {params.sweep:q} --index {wildcards.trial} "
        "--base {input.base:q} --out {output:q} --log {log:q}"


rule sweep_summary:
    """Best params and value, every trial, and best.png; the table is printed too."""
    input:
        lambda wc: [
            f"{R}/sweeps/{wc.sweep}/trials/{i}/result.json"
            for i in range(SWEEPS[wc.sweep][1].n_trials)
        ],
    output:
        summary=f"{R}/sweeps/{{sweep}}/summary.json",
        plot=f"{R}/sweeps/{{sweep}}/best.png",
    log:
        f"{R}/logs/sweeps/{{sweep}}/summary.log",
    localrule: True
    params:
        sweep=lambda wc: SWEEPS[wc.sweep][0],
    shell:
        "a2tgpo sweep-summary {params.sweep:q} --dir {R:q}/sweeps/{wildcards.sweep} 2>&1 | tee {log:q}"


for _name in SWEEPS:

    rule:
        name:
            f"sweep_{_name}"
        input:
            f"{R}/sweeps/{_name}/summary.json",
        localrule: True
