"""The MLflow UI as a user would use it: a real server on loopback, the REST API, a screenshot."""

import mlflow
import pytest
from PIL import Image

from eagle3.core import tracking
from eagle3.tools import ui


def make_sweep(cfg, tmp_path):
    """A parent run with two child runs and a plot, as a bench sweep leaves them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tracking.stage_run(cfg, "bench-sweep", run_name="sweep") as parent:
        fig, ax = plt.subplots()
        ax.plot([10, 16], [120.0, 150.0], marker="o")
        mlflow.log_figure(fig, "plots/tokens_per_s.png")
    children = []
    for depth, tps in [(10, 120.0), (16, 150.0)]:
        with tracking.stage_run(
            cfg, "bench", run_name=f"d{depth}", parent_run_id=parent.info.run_id
        ) as child:
            mlflow.log_param("job.spec", f"d{depth}")
            mlflow.log_metrics(
                {"tokens_per_s": tps, "accept_length": depth / 4, "speedup": tps / 100}
            )
            children.append(child.info.run_id)
    return parent.info.run_id, children, parent.info.experiment_id


@pytest.mark.slow
def test_mlflow_ui_rest_and_screenshot(make_cfg, tmp_path):
    cfg = make_cfg("target=tiny-llama")
    parent, children, experiment = make_sweep(cfg, tmp_path)
    with ui.mlflow_server(
        cfg.tracking.uri, cfg.tracking.artifact_location, tmp_path / "ui.log"
    ) as url:
        runs = {r["info"]["run_id"]: r for r in ui.search_runs(url, [experiment])}
        assert set(runs) == {parent, *children}
        for child in children:
            tags = {t["key"]: t["value"] for t in runs[child]["data"]["tags"]}
            assert tags["mlflow.parentRunId"] == parent
        metrics = {
            runs[c]["info"]["run_name"]: {m["key"]: m["value"] for m in runs[c]["data"]["metrics"]}
            for c in children
        }
        assert metrics["d16"]["tokens_per_s"] == 150.0 and metrics["d10"]["accept_length"] == 2.5
        assert ui.list_artifacts(url, parent, "plots") == ["plots/tokens_per_s.png"]
        shot = ui.screenshot(ui.compare_url(url, experiment, children), tmp_path / "compare.png")
        # typed in as a user would: job.spec against tok/s, tau and speedup (waits for the plot)
        chart = ui.comparison_screenshot(url, experiment, children, tmp_path / "chart.png")
        assert sorted(ui.newest_sweep(url, experiment)) == sorted(children)
    for path in (shot, chart):
        image = Image.open(path).convert("RGB")
        assert image.size == (1600, 1000)
        colours = image.getcolors(maxcolors=1_000_000)
        assert colours is not None and len(colours) > 50  # a rendered page, not a blank canvas
    kind = mlflow.MlflowClient(cfg.tracking.uri).get_experiment(experiment).tags
    assert kind["mlflow.experimentKind"] == "custom_model_development"  # opens in the runs view
