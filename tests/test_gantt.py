"""Gantt charts of simulated timelines, read back from the SVG that plot_timeline writes."""

import json
import os
import re
import subprocess
import sys

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.estimator import simulate
from autodist_keras.graph import ModelGraph
from autodist_keras.graph import zoo
from autodist_keras.strategies import baselines

pytest.importorskip("matplotlib")


def _numbers(path_d):
    return [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path_d)]


def _box(svg, group_id):
    """x and y extent of the first path inside the SVG group `group_id`."""
    match = re.search(rf'<g id="{group_id}">\s*(?:<g id="patch_\d+">\s*)?<path d="([^"]+)"', svg)
    assert match, group_id
    values = _numbers(match.group(1))
    xs, ys = values[0::2], values[1::2]
    return min(xs), max(xs), min(ys), max(ys)


@pytest.fixture(scope="module")
def twelve_gpu_timeline():
    cluster = Cluster.from_string("12xV100")
    graph = ModelGraph.from_keras(zoo.mlp(input_dim=64, hidden=(128, 128), name="gantt_mlp"))
    plan = baselines.data_parallel_even(graph, cluster, 96)
    return simulate(graph, cluster, plan)


def test_lanes_follow_devices_in_natural_order_and_the_legend_hides_none(
        twelve_gpu_timeline, tmp_path):
    from autodist_keras.strategies.gantt import plot_timeline

    svg = plot_timeline(twelve_gpu_timeline, tmp_path / "timeline.svg").read_text()
    labels = re.findall(r"<!-- (node\d+/gpu\d+) (comm|compute) -->", svg)
    devices = list(dict.fromkeys(d for d, _ in labels))
    # gpu2 comes before gpu10, as in the cluster, not as strings sort.
    assert devices == [f"node0/gpu{i}" for i in range(12)]
    # The legend's frame lies right of the axes' frame: it covers no lane's end.
    _, axes_right, _, _ = _box(svg, "patch_2")
    legend_left, _, _, _ = _box(svg, "legend_1")
    assert legend_left > axes_right, (legend_left, axes_right)


def test_plot_and_trace_refuse_paths_that_name_no_file(twelve_gpu_timeline, tmp_path,
                                                       monkeypatch):
    """`plot("")` wrote a hidden `.png`, `export_trace(None)` raised a bare TypeError, and
    a path under a file failed at the write with "File exists"."""
    from autodist_keras.errors import OutputError
    from autodist_keras.strategies.gantt import plot_timeline

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    (tmp_path / "gone").symlink_to(tmp_path / "no_such_folder")
    cases = [("", "The output path is empty"), ("  ", "The output path is empty"),
             (None, "must be a string or path-like"),
             (7, "must be a string or path-like"),
             ("notes.txt/deeper/out.svg", "is a file, not a directory"),
             ("pics/", "ends with a path separator"),
             ("out\x00.svg", "holds a NUL character"),  # (raw ValueError at the write)
             # (was "is a file, not a directory")
             ("gone/out.svg", "is a symbolic link to a missing target")]
    if os.path.isdir("/proc"):  # (failed at the write, after the drawing: "No such file")
        cases.append(("/proc/out.svg", "no file can be created in '/proc'"
                      if os.geteuid() == 0 else "is not writable by this user"))
    for write in (lambda p: plot_timeline(twelve_gpu_timeline, p),
                  twelve_gpu_timeline.export_trace):
        for bad, says in cases:
            with pytest.raises(OutputError, match=says + ".*Received"):
                write(bad)
    assert sorted(os.listdir(tmp_path)) == ["gone", "notes.txt"]


PLOT_KEEPS_BACKEND = '''
import json
import sys

import matplotlib

matplotlib.use("svg")  # the backend a notebook or script chose for itself
import matplotlib.pyplot as plt

import keras

from autodist_keras import AutoStrategy
from autodist_keras.devices import Cluster

if __name__ == "__main__":
    mine = plt.figure()  # the user's open figure
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    strategy.plan_for(model, 24)
    strategy.plot(sys.argv[1] + "/timeline.png")
    strategy.plot(sys.argv[1] + "/timeline.svg")
    report = {"backend": matplotlib.get_backend(), "figures": plt.get_fignums(),
              "mine": mine.number}
    print("REPORT " + json.dumps(report))
'''


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="plot() draws without the Keras backend; run under tensorflow only "
                           "(cheaper)")
def test_plot_leaves_the_users_matplotlib_backend_and_figures_alone(tmp_path):
    """plot() draws without pyplot: a script's backend and open figures stay as they were."""
    script = tmp_path / "plot_keeps_backend.py"
    script.write_text(PLOT_KEEPS_BACKEND)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["backend"] == "svg"
    assert report["figures"] == [report["mine"]]  # the charts never joined pyplot's figures
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "timeline.svg").read_text().lstrip().startswith("<?xml")
