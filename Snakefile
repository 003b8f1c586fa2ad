# a2tgpo: the experiment DAG. `snakemake` runs the toy study (config/config.yaml) locally with
# profiles/default; `snakemake --profile profiles/slurm --configfile config/paper.yaml` runs the
# papers' grid on a cluster. Rules only call the `a2tgpo` CLI (see workflow/rules/).

from snakemake.utils import min_version

min_version("9.0")


# the toy study unless --configfile names another study config, which then stands alone
# (merging config/paper.yaml over the toy file would leak toy settings into the paper grid)
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/index.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/sweep.smk"


rule all:
    default_target: True
    input:
        all_targets(),


# every rule is defined now: a set-resources / set-threads rule name must name one of them
check_rule_settings()
