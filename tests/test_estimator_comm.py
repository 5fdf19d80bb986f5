"""Communication models: alpha-beta closed forms on real cluster topologies."""

import math

import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator import comm
from autodist_keras.estimator.comm import CommModel

MB = 2**20


def _model(cluster):
    return CommModel(cluster.topology, {d.name: d.node for d in cluster.devices})


def test_ring_closed_form_on_one_node():
    cluster = Cluster.from_string("4xV100")
    topo = cluster.topology
    a, b = cluster.names[0], cluster.names[1]
    bw, lat = topo.bandwidth(a, b), topo.latency(a, b)
    size = 100 * MB
    expected = 2 * 3 / 4 * size / bw + 2 * 3 * lat
    assert comm.ring_allreduce_time(size, 4, bw, lat) == pytest.approx(expected, rel=1e-12)
    assert _model(cluster).allreduce_time(size, cluster.names, "ring") == pytest.approx(
        expected, rel=1e-12
    )
    # The ring runs at the pace of its slowest link.
    mixed = Cluster.from_string("node0:2xV100;node1:2xV100@10")
    t = _model(mixed).allreduce_time(size, mixed.names, "ring")
    nic = mixed.topology.bandwidth("node0/gpu0", "node1/gpu0")
    nic_lat = mixed.topology.latency("node0/gpu0", "node1/gpu0")
    assert nic == pytest.approx(10e9 / 8)
    assert t == pytest.approx(2 * 3 / 4 * size / nic + 2 * 3 * nic_lat, rel=1e-12)


def test_tree_and_hierarchical_closed_forms():
    cluster = Cluster.from_string("node0:4xV100;node1:4xV100@25")
    topo = cluster.topology
    model = _model(cluster)
    size = 64 * MB
    intra_bw, intra_lat = topo.bandwidth("node0/gpu0", "node0/gpu1"), topo.latency(
        "node0/gpu0", "node0/gpu1"
    )
    nic_bw, nic_lat = topo.bandwidth("node0/gpu0", "node1/gpu0"), topo.latency(
        "node0/gpu0", "node1/gpu0"
    )
    # Hierarchical: reduce in each node of 4, ring between the 2 leaders, broadcast.
    intra = 3 / 4 * size / intra_bw + 3 * intra_lat
    inter = 2 * 1 / 2 * size / nic_bw + 2 * 1 * nic_lat
    hier = model.allreduce_time(size, cluster.names, "hierarchical")
    assert hier == pytest.approx(2 * intra + inter, rel=1e-12)
    # Tree: 2 ceil(log2 8) = 6 steps over the slowest tree link (a NIC here).
    tree = model.allreduce_time(size, cluster.names, "tree")
    assert tree == pytest.approx(6 * (nic_lat + size / nic_bw), rel=1e-12)
    ring = model.allreduce_time(size, cluster.names, "ring")
    # Across a slow network the hierarchical scheme moves fewer bytes over NICs.
    assert hier < ring < tree
    # One device per node: hierarchical is the leaders' ring.
    two = Cluster.from_string("node0:1xV100;node1:1xV100@25")
    assert _model(two).allreduce_time(size, two.names, "hierarchical") == pytest.approx(
        _model(two).allreduce_time(size, two.names, "ring"), rel=1e-12
    )


def test_p2p_ps_and_degenerate_cases():
    cluster = Cluster.from_string("2xV100")
    model = _model(cluster)
    a, b = cluster.names
    lat, bw = model.link(a, b)
    assert model.transfer_time(10 * MB, a, b) == pytest.approx(lat + 10 * MB / bw)
    assert model.transfer_time(10 * MB, a, a) == 0.0
    assert model.transfer_time(0, a, b) == 0.0
    assert model.allreduce_time(10 * MB, [a], "ring") == 0.0
    # PS: every push and pull crosses the server's link, one after another.
    assert comm.ps_time(MB, 3, 1e9, 1e-5) == pytest.approx(2 * 3 * (1e-5 + MB / 1e9))
    assert comm.ps_time(MB, 4, 1e9, 1e-5) > comm.ps_time(MB, 3, 1e9, 1e-5)
    assert comm.ps_time(MB, 0, 1e9, 1e-5) == 0.0
    # Tree of n=5 rounds log2 up: 2 * 3 steps.
    assert comm.tree_allreduce_time(MB, 5, 1e9, 0.0) == pytest.approx(6 * MB / 1e9)


def test_errors_name_the_value():
    cluster = Cluster.from_string("2xV100")
    model = _model(cluster)
    with pytest.raises(EstimatorError, match="Received: 'butterfly'"):
        model.allreduce_time(MB, cluster.names, "butterfly")
    with pytest.raises(EstimatorError, match="Received"):
        comm.p2p_time(-1, 1e9, 0.0)
    with pytest.raises(EstimatorError, match="bandwidth"):
        comm.ring_allreduce_time(MB, 2, 0.0, 0.0)
    with pytest.raises(EstimatorError, match="latency"):
        comm.p2p_time(MB, 1e9, math.nan)
    with pytest.raises(EstimatorError, match="node9/gpu0"):
        model.transfer_time(MB, "node0/gpu0", "node9/gpu0")
