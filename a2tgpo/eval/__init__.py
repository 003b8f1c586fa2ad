"""Checkpoint selection and test-set evaluation of a grid cell.

    a2tgpo select <cell> [--criterion dev_em|test_avg]      -> <cell>/best.json
    a2tgpo evaluate <cell>/config.yaml --best <cell>/best.json --test <parquet>... --out <cell>/eval
    a2tgpo evaluate <cell>/config.yaml --all-checkpoints --test ... --out <cell>/eval_all

`select` (a2tgpo.eval.select) picks a checkpoint by dev EM (default) or, the papers' protocol,
by the best test average over every checkpoint; `evaluate` (a2tgpo.eval.evaluate) rolls out
greedily with training's validation code and writes per-dataset EM/F1, predictions and
sample-weighted group averages. File formats are in each module's docstring.
"""
