# Optuna sweeps (a2tgpo/sweep.py): one study per config/sweeps/<name>.yaml listed in the study
# config's `sweeps`; trials are DAG jobs. Rules are added here with the sweep module.
