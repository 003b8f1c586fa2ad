"""Every table and plot kind has its caption for `snakemake --report`."""

from pathlib import Path

from a2tgpo.report.plots import PLOT_KINDS
from a2tgpo.report.tables import TABLE_NAMES

REPORT_DIR = Path(__file__).resolve().parents[2] / "workflow" / "report"


def test_captions_exist_and_say_something():
    names = [f"table_{t}.rst" for t in TABLE_NAMES] + [f"plot_{k}.rst" for k in PLOT_KINDS]
    for name in names:
        path = REPORT_DIR / name
        assert path.exists(), f"missing caption {path}"
        assert len(path.read_text().split()) > 25, f"{path}: caption too short"


def test_plots_caption_holds_every_plot_caption():
    # the report shows the plot folder under one caption (workflow/report/plots.rst), which
    # repeats each plot kind's caption; regenerate it when a plot caption changes
    text = (REPORT_DIR / "plots.rst").read_text()
    for kind in PLOT_KINDS:
        assert (REPORT_DIR / f"plot_{kind}.rst").read_text().strip() in text, kind
