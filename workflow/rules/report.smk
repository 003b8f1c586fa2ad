# Tables and plots over the cells of the default sets (results/<study>/tables, plots), and for
# each other set over the default cells plus its own, or its own only for a set trained under a
# regime (results/<study>/tables/<set>/, results/<study>/set_plots/<set>/). Each rule also logs
# its outputs into the study's MLflow run (a set's: a run of its own), tagged kind=study
# (--study-run: a2tgpo/report/study_run.py; best effort, links in results/<study>/mlflow/).


TABLES = ["main", "ablation_a2tgpo", "ablation_at2po", "credit_at2po", "beta", "paired"]


rule tables:
    input:
        cells=cell_outputs(DEFAULT_CELLS),
        cfg=f"{R}/configs/report.yaml",
    output:
        [
            (
                report(f"{R}/tables/{t}.md", caption=f"../report/table_{t}.rst", category="Tables")
                if ext == "md"
                else f"{R}/tables/{t}.{ext}"
            )
            for t in TABLES
            for ext in ("md", "tex", "csv")
        ],
    log:
        f"{R}/logs/tables.log",
    localrule: True
    params:
        cells=[run_dir(c.path) for c in DEFAULT_CELLS],
    shell:
        "a2tgpo tables --cells {params.cells:q} --config {input.cfg:q} --out {R:q}/tables "
        "--study-run > {log:q} 2>&1"


rule plots:
    input:
        cells=cell_outputs(DEFAULT_CELLS),
        cfg=f"{R}/configs/report.yaml",
    output:
        plots=report(
            directory(f"{R}/plots"),
            patterns=["{panel}/{kind}.png"],
            caption="../report/plots.rst",
            category="Plots",
            subcategory="{panel}",
            labels={"panel": "{panel}", "plot": "{kind}"},
        ),
    log:
        f"{R}/logs/plots.log",
    localrule: True
    params:
        cells=[run_dir(c.path) for c in DEFAULT_CELLS],
    shell:
        "a2tgpo plots --cells {params.cells:q} --config {input.cfg:q} --out {R:q}/plots "
        "--study-run > {log:q} 2>&1"


rule set_tables:
    """Tables of one extra set (`snakemake <set>`), next to the default ones."""
    input:
        cells=lambda wc: cell_outputs(set_cells(wc.set)),
        cfg=f"{R}/configs/report.yaml",
    output:
        [f"{R}/tables/{{set}}/{t}.{ext}" for t in TABLES for ext in ("md", "tex", "csv")],
    log:
        f"{R}/logs/tables-{{set}}.log",
    localrule: True
    params:
        cells=lambda wc: [run_dir(c.path) for c in set_cells(wc.set)],
    shell:
        "a2tgpo tables --cells {params.cells:q} --config {input.cfg:q} "
        "--out {R:q}/tables/{wildcards.set} --study-run --set {wildcards.set:q} > {log:q} 2>&1"


rule set_plots:
    """Plots of one extra set (`snakemake <set>`), over the cells its tables cover."""
    input:
        cells=lambda wc: cell_outputs(set_cells(wc.set)),
        cfg=f"{R}/configs/report.yaml",
    output:
        directory(f"{R}/set_plots/{{set}}"),
    log:
        f"{R}/logs/plots-{{set}}.log",
    localrule: True
    params:
        cells=lambda wc: [run_dir(c.path) for c in set_cells(wc.set)],
    shell:
        "a2tgpo plots --cells {params.cells:q} --config {input.cfg:q} --out {output:q} "
        "--study-run --set {wildcards.set:q} > {log:q} 2>&1"


wildcard_constraints:
    set="|".join(sorted(STUDY.grid.sets)),


# `snakemake <set>` runs one set's cells and writes its tables and plots
for _name in STUDY.grid.sets:

    rule:
        name:
            _name
        input:
            f"{R}/tables/{_name}/main.md",
            f"{R}/set_plots/{_name}",
