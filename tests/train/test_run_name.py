"""The MLflow run name of a training job: method, β and seed first; the cell path is a tag."""

from a2tgpo.algo.methods import METHODS
from a2tgpo.train.rl import run_name


def test_grid_cell_and_hand_made_run_names(toy_train_config, tmp_path):
    from a2tgpo.train.config import ScheduleConfig

    method = METHODS["a2tgpo"]  # β 0.3 (A2TGPO §5.1)
    cfg = toy_train_config(tmp_path / "run", method, schedule=ScheduleConfig(steps=1),
                           cell="backbone~toy/method~a2tgpo/beta~0.3/seed~2", seed=2)
    assert run_name(cfg) == "a2tgpo β=0.3 seed 2 · toy"
    # outside the grid (no cell path): the same fields from the config itself
    cfg = toy_train_config(tmp_path / "run", method, schedule=ScheduleConfig(steps=1), seed=3)
    assert run_name(cfg) == "a2tgpo β=0.3 seed 3 · toy"
