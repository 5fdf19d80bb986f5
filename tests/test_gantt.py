"""Gantt charts of simulated timelines, read back from the SVG that plot_timeline writes."""

import re

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
