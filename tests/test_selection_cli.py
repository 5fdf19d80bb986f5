"""Plan selection, explain() rendering and the command line, on real graphs and clusters."""

import json
import re
import os

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import StrategyError
from autodist_keras.estimator import simulator
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies import selection
from autodist_keras.strategies.explain import explanation
from autodist_keras.strategies.explain import render_text
from autodist_keras.strategies.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HETERO = os.path.join(ROOT, "examples", "clusters", "hetero_testbed.yaml")

torch_only = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="backend-independent (its CLI processes set their own backend); run under torch only",
)


def _cnn():
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


@pytest.fixture(scope="module")
def graph():
    return ModelGraph.from_keras(_cnn())


@pytest.fixture(scope="module")
def hetero():
    return Cluster.from_yaml(HETERO)


def test_choose_plan_picks_fastest_feasible_and_records_alternatives(graph, hetero, tmp_path):
    plan, candidates = selection.choose_plan(graph, hetero, 256, cache_dir=tmp_path)
    scored = [c for c in candidates if c.feasible]
    assert plan.prediction.step_time_s == min(c.step_time_s for c in scored)
    assert {"single_device", "data_parallel_even", "proportional"} <= set(
        plan.prediction.baselines
    )
    assert plan.validate(graph, hetero) == []
    assert any(n.startswith("auto: chosen:") for n in plan.notes)


def test_plan_cache_is_reused(graph, hetero, tmp_path):
    first, candidates = selection.choose_plan(graph, hetero, 128, cache_dir=tmp_path)
    assert candidates
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    second, again = selection.choose_plan(graph, hetero, 128, cache_dir=tmp_path)
    assert again == []  # nothing planned: read from the cache
    assert second.groups == first.groups and second.buckets == first.buckets
    assert any(n.startswith("cache: reused") for n in second.notes)
    # another batch size is another key
    selection.choose_plan(graph, hetero, 64, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_plan_cache_key_includes_the_backend(graph, hetero, tmp_path):
    """A plan searched for one backend's costs is not reused for another's.

    The backend sets the cost model's host times and Disco's op-fusion rule;
    `choose_plan` called without `backend` takes the active one, and that must
    be part of the key (a TensorFlow plan was reused under PyTorch).
    """
    active = keras.backend.backend()
    other = "torch" if active == "tensorflow" else "tensorflow"
    _, planned = selection.choose_plan(graph, hetero, 128, cache_dir=tmp_path,
                                       estimator="simulator")
    assert planned
    _, again = selection.choose_plan(graph, hetero, 128, cache_dir=tmp_path,
                                     estimator="simulator", backend=active)
    assert again == []  # the active backend is the default: the same key
    _, replanned = selection.choose_plan(graph, hetero, 128, cache_dir=tmp_path,
                                         estimator="simulator", backend=other)
    assert replanned  # planned again, not read from the cache
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_search_for_another_backend_prices_its_plans_for_that_backend(tmp_path):
    """`choose_plan(..., backend=...)` labels and caches its plan for that backend, so it
    must price it for that backend too: PyTorch pays eager host time per layer on GPUs.
    Until session 31 a TensorFlow process planning for torch (or the reverse) got the
    active backend's figures: the zoo MLP on 2xV100, 0.080 ms against 4.752 ms."""
    from autodist_keras.estimator.cost_model import AnalyticCostModel
    from autodist_keras.graph import zoo

    active = keras.backend.backend()
    other = "torch" if active == "tensorflow" else "tensorflow"
    graph = ModelGraph.from_keras(zoo.mlp(16, (32,), name="mlp"))
    cluster = Cluster.from_string("2xV100")
    plan, candidates = selection.choose_plan(graph, cluster, 64, families=[],
                                             cache_dir=tmp_path, estimator="simulator",
                                             backend=other)
    assert plan.provenance.backend == other and candidates
    for c in candidates:
        if c.plan is None:
            continue
        theirs = simulator.simulate(graph, cluster, c.plan,
                                    cost_model=AnalyticCostModel(cluster, framework=other))
        ours = simulator.simulate(graph, cluster, c.plan)
        assert c.step_time_s == pytest.approx(theirs.step_time_s, rel=1e-12), c.name
        assert c.step_time_s != pytest.approx(ours.step_time_s, rel=0.1), c.name


def test_an_unwritable_cache_warns_and_the_plan_is_used(graph, hetero, tmp_path, monkeypatch):
    """The cache only saves planning time: a cache directory that is a file (or read-only)
    must not fail auto at the end of planning."""
    blocker = tmp_path / "cache_is_a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AUTODIST_KERAS_CACHE", str(blocker))
    with pytest.warns(UserWarning) as record:
        plan, _ = selection.choose_plan(graph, hetero, 256, cache_dir=str(blocker))
    assert plan.prediction is not None and blocker.read_text() == "not a directory"
    message = next(str(w.message) for w in record if "could not cache" in str(w.message))
    assert "AUTODIST_KERAS_CACHE (or cache_dir=)" in message
    assert message.count("Received:") == 1 and str(blocker) in message


def test_damaged_cache_entry_is_replanned(graph, hetero, tmp_path):
    selection.choose_plan(graph, hetero, 96, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{broken")
    plan, candidates = selection.choose_plan(graph, hetero, 96, cache_dir=tmp_path)
    assert candidates and Plan.from_json(path).global_batch_size == 96


def test_executable_predicate_excludes_plans(graph, hetero, tmp_path):
    def only_even(plan):
        ok = plan.provenance.planner == "data_parallel_even"
        return ok, None if ok else "this test's backend only runs even plans"

    plan, candidates = selection.choose_plan(
        graph, hetero, 256, use_cache=False, executable=only_even
    )
    assert plan.provenance.planner == "data_parallel_even"
    with pytest.raises(StrategyError, match="No plan that fits can run"):
        selection.pick([c for c in candidates if c.name == "single_device"])


def _two_groups(plan, devices):
    """`plan` (data parallel) cut into two layer groups placed on `devices`."""
    import copy

    from autodist_keras.strategies.plan import LayerGroup
    from autodist_keras.strategies.plan import Replica

    placed = copy.deepcopy(plan)
    layers = list(placed.groups[0].layers)
    half = len(layers) // 2
    batch = placed.global_batch_size
    placed.groups = [LayerGroup(f"g{i}", part, [Replica(d, batch)])
                     for i, (part, d) in enumerate(zip((layers[:half], layers[half:]), devices))]
    return placed


def test_no_runtime_runs_a_placement_plan_spanning_nodes(graph, hetero):
    """A placement/hybrid plan across nodes is listed but never chosen by auto, and the
    CLI's JSON says so; data parallelism across nodes and placement in one node run."""
    from autodist_keras.strategies import baselines

    dp = baselines.data_parallel_even(graph, hetero, 16)
    assert selection.runnable_anywhere(dp, hetero) == (True, "")  # 4 nodes, one group
    one_node = _two_groups(dp, ["node0/gpu0", "node0/gpu1"])
    assert selection.runnable_anywhere(one_node, hetero) == (True, "")
    ok, why = selection.runnable_anywhere(_two_groups(dp, ["node0/gpu0", "node1/gpu0"]), hetero)
    assert not ok and "spans nodes ['node0', 'node1']; no runtime can run it yet" in why

    # HeteroG isolates a large token embedding on one node: a hybrid plan across the
    # four nodes, predicted fastest, listed with its reason, and not chosen.
    from autodist_keras.graph import zoo

    encoder = ModelGraph.from_keras(zoo.transformer_encoder(num_layers=2, d_model=256,
                                                            vocab=30000, seq_len=64))
    # (At 64 samples HeteroG now keeps the whole model on node0's two V100s, which runs.)
    candidates = selection.build_candidates(encoder, hetero, 256, families=["heterog"])
    hybrid = candidates[-1]
    assert hybrid.name == "heterog" and len(hybrid.plan.groups) > 1
    assert hybrid.executable is False and "no runtime can run it yet" in hybrid.reason
    assert any("auto does not choose it" in n for n in hybrid.plan.notes)
    chosen = selection.pick(candidates)
    assert chosen.name != "heterog" and chosen.plan.is_data_parallel
    if keras.backend.backend() == "tensorflow":
        # Predicted fastest here (under PyTorch the cost model adds eager Keras's
        # host time on GPUs, and it is not): skipped all the same.
        assert hybrid.step_time_s < chosen.step_time_s


def test_when_only_plans_spanning_nodes_fit_the_error_names_them():
    """Eight 0.25 GB GPUs on two nodes: only FastT's placement fits ResNet50, and no
    runtime runs it across nodes. The error said "cannot be executed by this backend
    on this machine", also when planning for a cluster that is not here."""
    cluster = Cluster.from_dict({"nodes": [
        # 0.25 GiB usable each: a GPU keeps 512 MiB + 5% for the CUDA context.
        {"name": n, "gpus": [{"name": "Tiny", "memory_gb": (
            0.25 * 2**30 + simulator.GPU_MEMORY_RESERVE_BYTES)
            / (1 - simulator.GPU_MEMORY_RESERVE_FRACTION) / 2**30, "fp32_tflops": 8,
                              "bandwidth_gbps": 300, "count": 4}]} for n in ("t0", "t1")]})
    graph = ModelGraph.from_keras(keras.applications.ResNet50(weights=None))
    with pytest.raises(StrategyError) as info:
        selection.choose_plan(graph, cluster, 8, use_cache=False, estimator="simulator")
    message = str(info.value)
    assert message.startswith("No plan that fits can run: fastt fit (predicted), but this "
                              "placement/hybrid plan"), message
    assert "spans nodes ['t0', 't1']" in message and "on one node" in message
    assert "this machine" not in message


def test_explain_labels_predictions(graph, hetero):
    plan, _ = selection.choose_plan(graph, hetero, 256, use_cache=False)
    data = explanation(plan, hetero, measured={"step_time_s": 0.01, "steps": 30})
    assert data["predicted"]["source"] == "simulator (predicted)"
    assert len(data["devices"]) == len(plan.devices)
    assert data["speedup_vs_even_predicted"] >= 1.0 - 1e-9
    json.dumps(data)
    plain = render_text(data, use_rich=False)
    assert "predicted step time" in plain and "measured step time: 10.000 ms" in plain
    fancy = render_text(data, use_rich=True)
    assert "Candidates (predicted)" in fancy
    # The speedup over even data parallelism was shown twice: as the search's "why"
    # note (1.14x) and as its own line (1.145x); the text dropped the note by a regex,
    # the JSON kept it. Now no note gives it: once, as speedup_vs_even_predicted.
    assert not [n for n in plan.notes if "speedup over" in n and "no speedup" not in n]
    assert not any("speedup" in w for w in data["why"]), data["why"]
    for text in (plain, fancy):
        assert text.count("predicted speedup over") == 1, text
        assert f"predicted speedup over even data parallelism: " \
               f"{data['speedup_vs_even_predicted']}x" in text
    assert data["predicted"]["breakdown_source"] == "simulator"


def test_explain_of_a_one_device_plan_lists_no_gradient_sync(graph, hetero):
    from autodist_keras.strategies import baselines

    plan = baselines.single_device(graph, hetero, 64)
    data = explanation(plan, hetero)
    assert data["sync"] == {}
    assert "sync: none (one device)" in render_text(data, use_rich=False)


def test_explain_compares_measured_with_predicted(graph, hetero):
    plan, _ = selection.choose_plan(graph, hetero, 256, use_cache=False)
    predicted = plan.prediction.step_time_s
    slow = explanation(plan, hetero, measured={"step_time_s": 4 * predicted, "steps": 30})
    assert slow["measured_vs_predicted"] == pytest.approx(4.0, rel=1e-3)
    text = render_text(slow, use_rich=False)
    assert "measured / predicted: 4.0x (the prediction was 75% low)" in text
    assert "hint: the simulator prices each layer" in text  # a simulator prediction
    close = explanation(plan, hetero, measured={"step_time_s": 0.9 * predicted, "steps": 30})
    text = render_text(close, use_rich=False)
    assert "(the prediction was 11% high)" in text and "hint:" not in text
    assert explanation(plan, hetero)["measured_vs_predicted"] is None
    # Steps of another batch size are shown, not compared.
    other = explanation(plan, hetero, measured={"step_time_s": 4 * predicted, "steps": 30,
                                                "batch_size": 64})
    assert other["measured_vs_predicted"] is None
    text = render_text(other, use_rich=False)
    assert "batches of 64 rows)" in text and "measured / predicted" not in text
    assert "not compared with the prediction: the fit ran batches of 64 rows, the plan and " \
           "its prediction are for 256 rows" in text
    same = explanation(plan, hetero, measured={"step_time_s": 4 * predicted, "batch_size": 256})
    assert same["measured_vs_predicted"] == pytest.approx(4.0, rel=1e-3)
    # A rescaled simulator prediction gets the hint too; a learned one does not.
    source = plan.prediction.source
    try:
        plan.prediction.source = "simulator x 1.12 calibration of the learned estimator; predicted"
        text = render_text(explanation(plan, hetero, measured={"step_time_s": 4 * predicted}),
                           use_rich=False)
        assert "hint: the simulator prices each layer" in text
        plan.prediction.source = "learned estimator (ensemble, tensorflow); predicted"
        text = render_text(explanation(plan, hetero, measured={"step_time_s": 4 * predicted}),
                           use_rich=False)
        assert "hint:" not in text
    finally:
        plan.prediction.source = source


def test_explain_counts_the_candidates_it_lists_and_labels_heterogs_internal_seeds(graph, hetero):
    """HeteroG records figures from inside its own search (its multi-node seed
    proportional_hierarchical, its search result heterog_search): they are not
    candidates, so the table lists exactly the "of N" candidates and shows the
    others apart, labelled, in the text and in the JSON."""
    plan, candidates = selection.choose_plan(graph, hetero, 256, families=["heterog"],
                                             use_cache=False, estimator="simulator")
    assert plan.provenance.planner == "heterog"
    data = explanation(plan, hetero)
    (why,) = [w for w in data["why"] if w.startswith("chosen:")]
    count = int(re.search(r"feasible plan of (\d+);", why).group(1))
    assert count == len(candidates) == len(data["candidates"])
    assert [c["name"] for c in data["candidates"]] == [c.name for c in candidates]
    internal = {r["name"]: r for r in data["planner_internal"]}
    assert set(internal) == {"proportional_hierarchical", "heterog_search"}
    assert not set(internal) & {c.name for c in candidates}
    assert internal["proportional_hierarchical"]["role"] == (
        "HeteroG's internal search seed (not a candidate)")
    assert internal["heterog_search"]["recorded_by"] == "heterog"
    json.dumps(data)
    for text in (render_text(data, use_rich=False), render_text(data, use_rich=True)):
        table, _, rest = text.partition("Not candidates: figures heterog recorded inside its "
                                        f"own search (simulator, predicted; not among the "
                                        f"{count} candidate(s) above):")
        assert rest, text
        assert "proportional_hierarchical" not in table and "heterog_search" not in table
        assert "proportional_hierarchical: " in rest and "HeteroG's internal search seed" in rest
    plain = render_text(data, use_rich=False)
    rows = [line.split()[0] for line in plain.split("\n\n")[2].splitlines()[1:]]
    assert rows == [c.name for c in candidates]


def _assert_columns_line_up(lines, titles):
    header, rows = lines[0], lines[1:]
    for title in titles:
        start = header.index(title)
        for row in rows:
            # Each cell starts where its title starts, after a blank.
            assert row[start - 1:start] in ("", " ") and row[start] != " ", (title, row, header)


def test_plain_tables_size_columns_from_their_widest_cell(graph, hetero):
    from autodist_keras.strategies.explain import CANDIDATE_COLUMNS
    from autodist_keras.strategies.explain import DEVICE_COLUMNS

    plan, _ = selection.choose_plan(graph, hetero, 256, families=["heterog"],
                                    use_cache=False, estimator="simulator")
    data = explanation(plan, hetero)
    # Device models longer than the title (V100-PCIE-16GB), and a candidate name
    # longer than any built-in one.
    assert max(len(d["model"]) for d in data["devices"]) > len("model") + 5
    data["candidates"][-1]["name"] = "heterog_with_a_much_longer_candidate_name"
    blocks = render_text(data, use_rich=False).split("\n\n")
    devices, candidates = blocks[1].splitlines(), blocks[2].splitlines()
    assert devices[0].startswith("device") and candidates[0].startswith("candidate")
    assert len(devices) == len(plan.devices) + 1
    _assert_columns_line_up(devices, [t for _, t in DEVICE_COLUMNS])
    _assert_columns_line_up(candidates, [t for _, t in CANDIDATE_COLUMNS])


def test_rich_tables_show_names_with_brackets_as_written():
    """A GPU named in a YAML spec and a Keras layer name may hold `[...]`: rich read them
    as markup, so `[bold]Y` lost its tag, and `X[/]` stopped explain() and
    `Cluster.summary()` with rich's MarkupError (session 31's sweep)."""
    from autodist_keras.estimator import simulate
    from autodist_keras.strategies import baselines

    gpu = {"memory_gb": 16, "fp32_tflops": 10, "bandwidth_gbps": 500}
    cluster = Cluster.from_dict({"nodes": [{"name": "n0", "gpus": [
        dict(gpu, name="X[/]"), dict(gpu, name="[bold]Y")]}]})
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="[bold]hidden")(inputs)
    graph = ModelGraph.from_keras(
        keras.Model(inputs, keras.layers.Dense(2, name="head[x]")(hidden)))
    plan = baselines.data_parallel_even(graph, cluster, 8)
    plan.prediction = simulate(graph, cluster, plan).to_prediction()
    text = render_text(explanation(plan, cluster), use_rich=True)
    summary = cluster.summary(rich=True)
    for shown in (text, summary):
        assert "X[/]" in shown and "[bold]Y" in shown
    assert "[bold]hidden" in graph.summary() and "head[x]" in graph.summary()


def test_cli_plan_json_keeps_heterogs_internal_seeds_out_of_the_baselines(cli):
    run = cli("plan", "--model", "small_cnn", "--cluster", HETERO, "--strategy", "heterog",
              "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    internal = {r["name"]: r for r in data["planner_internal"]}
    assert {"proportional_hierarchical", "heterog_search"} <= set(internal)
    assert not set(internal) & set(data["baselines"])
    assert all("not a candidate" in r["role"] for r in internal.values())


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """Runs the real CLI entry point in this process (no framework re-import)."""
    from autodist_keras import cli as cli_module

    monkeypatch.setenv("AUTODIST_KERAS_CACHE", str(tmp_path / "cache"))

    def run(*args):
        capsys.readouterr()
        code = cli_module.main(list(args))
        captured = capsys.readouterr()
        return _Run(code, captured.out, captured.err)

    return run


def test_cli_plan_and_simulate_round_trip(cli, tmp_path):
    out = tmp_path / "plan.json"
    trace = tmp_path / "trace.json"
    run = cli("plan", "--model", "mlp", "--cluster", HETERO, "--json", "--out", str(out))
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    for key in ("strategy", "predicted_step_time_s", "baselines", "speedup_vs_even",
                "planning_time_s", "feasible", "memory_per_device"):
        assert key in data
    assert {"data_parallel_even", "proportional"} <= set(data["baselines"])
    # Memory, feasibility and speedup are predicted too; the label said "step times" only.
    assert all(f"`{key}`" in data["predicted"]
               for key in ("memory_per_device", "feasible", "speedup_vs_even"))
    assert data["runnable"] is True and data["not_runnable_reason"] is None
    assert all(b["runnable"] in (True, None) for b in data["baselines"].values())
    rows = data["per_device"]
    assert {r["device"] for r in rows} == set(data["memory_per_device"])
    if data["strategy"] != "fastt":  # data parallel: the shares add up to the batch
        assert sum(r["batch_share"] for r in rows) == data["batch_size"]
    run = cli("simulate", "--model", "mlp", "--cluster", HETERO, "--plan", str(out),
               "--trace", str(trace), "--json")
    assert run.returncode == 0, run.stderr
    sim = json.loads(run.stdout)
    assert sim["predicted_step_time_s"] == pytest.approx(data["predicted_step_time_s"])
    assert sim["plan_file_prediction"]["step_time_s"] == data["predicted_step_time_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)


def test_cli_devices_graph_and_errors(cli):
    run = cli("devices", "--cluster", "2xV100,4x1080Ti", "--json")
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["devices"]) == 6
    run = cli("graph", "--model", "mlp", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    for key in ("nodes", "edges", "forward_flops", "params", "param_bytes", "warnings"):
        assert key in data
    run = cli("devices", "--cluster", "3xV1OO")
    assert run.returncode == 2 and "error" in run.stderr and "Traceback" not in run.stderr
    run = cli("plan", "--model", "mlp", "--cluster", HETERO, "--strategy", "magic")
    assert run.returncode == 2 and "Received" in run.stderr


def test_cli_launch_starts_ranks_with_torchrun_variables(cli, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "out = sys.argv[1]\n"
        "with open(os.path.join(out, os.environ['RANK']), 'w') as f:\n"
        "    f.write(os.environ['WORLD_SIZE'] + ' ' + os.environ['MASTER_PORT'])\n"
    )
    run = cli("launch", "--nprocs", "2", "--timeout-s", "120", str(script), str(tmp_path))
    assert run.returncode == 0, run.stderr
    texts = [(tmp_path / r).read_text().split() for r in ("0", "1")]
    assert texts[0][0] == texts[1][0] == "2" and texts[0][1] == texts[1][1]
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    run = cli("launch", "--nprocs", "2", "--timeout-s", "120", str(script))
    assert run.returncode == 1
    assert "rank 1 failed first" in run.stderr and "rank 1: 3" in run.stderr
    for bad in ("0", "-5", "nan", "soon"):  # started the ranks and killed them at once
        with pytest.raises(SystemExit) as info:
            cli("launch", "--nprocs", "2", "--timeout-s", bad, str(script))
        assert info.value.code == 2


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="writing the plan file and the memory check of a forced plan do not "
                           "depend on the backend (CLI planning under TensorFlow: "
                           "test_cli_plan_and_simulate_round_trip); run under torch only")
def test_cli_file_errors_modes_and_infeasible_plans(cli, tmp_path):
    # An output path that cannot be written is a one-line error, not a traceback.
    run = cli("plan", "--model", "mlp", "--cluster", HETERO, "--out", str(tmp_path))
    assert run.returncode == 2, run.stdout
    assert "it is a directory. Give a file name" in run.stderr
    assert "Traceback" not in run.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    # Written files get the umask's permissions, like any other write.
    old = os.umask(0o022)
    try:
        out = tmp_path / "plan.json"
        assert cli("plan", "--model", "mlp", "--cluster", HETERO, "--out", str(out)).returncode == 0
        assert (os.stat(out).st_mode & 0o777) == 0o644
    finally:
        os.umask(old)
    # A symbolic link is written through: the link stays, its target gets the plan.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "plan.json").write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(shared / "plan.json")
    assert cli("plan", "--model", "mlp", "--cluster", HETERO, "--out", str(link)).returncode == 0
    assert link.is_symlink() and json.loads((shared / "plan.json").read_text())["groups"]
    # Links that loop are refused (an ordinary write would fail), not replaced.
    loop_a, loop_b = tmp_path / "loop_a.json", tmp_path / "loop_b.json"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    run = cli("plan", "--model", "mlp", "--cluster", HETERO, "--out", str(loop_a))
    assert run.returncode == 2 and "form a loop" in run.stderr and loop_a.is_symlink()
    # A pipe (as a device) is never replaced by a file; the error comes before planning.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    run = cli("plan", "--model", "mlp", "--cluster", HETERO, "--out", str(fifo))
    assert run.returncode == 2 and "is not a regular file" in run.stderr
    assert not os.path.isfile(fifo) and "planning time" not in run.stdout
    # A forced plan that does not fit says so in the text output.
    run = cli("plan", "--model", "ResNet50", "--cluster", HETERO, "--strategy",
              "single_device", "--batch-size", "256")
    assert run.returncode == 0, run.stderr
    assert "INFEASIBLE (predicted): " in run.stdout


def test_cli_refuses_output_paths_that_name_no_file_before_planning(cli, tmp_path):
    # `--out ""` planned, wrote nothing and exited 0; a path under a file failed only
    # after the planning, with "File exists".
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    # A link to a folder that is gone was called "a file"; a file in a folder that takes
    # no new file (/proc; root passes the access check) failed after the planning.
    (tmp_path / "gone").symlink_to(tmp_path / "no_such_folder")
    cases = [("", "The output path is empty"),
             (str(tmp_path / "notes.txt" / "plan.json"), "is a file, not a directory"),
             (str(tmp_path / "gone" / "plan.json"),
              f"is a symbolic link to a missing target ({str(tmp_path / 'no_such_folder')!r})")]
    if os.path.isfile("/proc/version"):
        cases.append(("/proc/version", "no file can be created in '/proc'" if os.geteuid() == 0
                      else "is not writable by this user"))
    if os.geteuid() != 0:  # (root writes in a folder whatever its mode)
        (tmp_path / "locked").mkdir(mode=0o555)
        cases.append((str(tmp_path / "locked" / "plan.json"), "is not writable by this user"))
    for out, says in cases:
        run = cli("plan", "--model", "mlp", "--cluster", "2xV100", "--out", out)
        assert run.returncode == 2 and says in run.stderr, run.stderr
        assert "planning time" not in run.stdout and "planning:" not in run.stderr
    os.unlink(tmp_path / "gone")
    if os.geteuid() != 0:
        os.rmdir(tmp_path / "locked")
    plan_file = tmp_path / "plan.json"
    assert cli("plan", "--model", "mlp", "--cluster", "2xV100", "--json", "--out",
               str(plan_file)).returncode == 0
    run = cli("simulate", "--model", "mlp", "--cluster", "2xV100", "--plan", str(plan_file),
              "--trace", "")
    assert run.returncode == 2 and "The output path is empty" in run.stderr, run.stderr
    assert {p for p in os.listdir(tmp_path) if p != "cache"} == {"notes.txt", "plan.json"}
    # A strategy in another case or with a dash says which name was meant.
    run = cli("plan", "--model", "mlp", "--cluster", "2xV100", "--strategy", "Data-Parallel")
    assert run.returncode == 2, run.stderr
    assert "Did you mean 'data_parallel'?" in run.stderr and "Received" in run.stderr


def test_a_model_whose_one_sample_does_not_fit_is_not_said_to_be_too_big_alone():
    """0.02 GiB usable per GPU: the weights fit, one 512x512 sample's activations do
    not. The hint said "the weights, gradients and optimizer slots alone exceed a
    device's memory", which was untrue (and a smaller model would not help)."""
    usable = 0.02 * 2**30
    cluster = Cluster.from_dict({"nodes": [{"gpus": [{"name": "Tiny", "memory_gb": (
        usable + simulator.GPU_MEMORY_RESERVE_BYTES) / (1 - simulator.GPU_MEMORY_RESERVE_FRACTION)
        / 2**30, "fp32_tflops": 8, "bandwidth_gbps": 300, "count": 2}]}]})
    inputs = keras.Input((512, 512, 3))
    x = keras.layers.Conv2D(32, 3, padding="same")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    graph = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(2)(x)))
    with pytest.raises(StrategyError) as info:
        selection.choose_plan(graph, cluster, 4, use_cache=False, estimator="simulator")
    message = str(info.value)
    assert "fits no sample on these devices (predicted): beside the weights" in message, message
    assert "one sample's activations" in message and "alone" not in message


def test_cli_batch_size_must_be_positive_and_the_chosen_candidate_is_named(cli):
    for bad in ("0", "-5", "x"):
        with pytest.raises(SystemExit) as info:
            cli("plan", "--model", "mlp", "--cluster", HETERO, "--batch-size", bad)
        assert info.value.code == 2
    run = cli("plan", "--model", "mlp", "--cluster", "2xV100", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["strategy"] in data["baselines"]  # a candidate's name, e.g. data_parallel_even_ps
    # A forced strategy that cannot be made says why, as the Python API does, with one
    # "Received:" (it said "No data_parallel plan: not built" on one device).
    run = cli("plan", "--model", "mlp", "--cluster", "1xV100", "--strategy", "data_parallel")
    assert run.returncode == 2
    assert "the cluster has one device (node0/gpu0)" in run.stderr, run.stderr
    run = cli("plan", "--model", "mlp", "--cluster", HETERO, "--strategy", "proportional",
              "--batch-size", "4")
    assert run.returncode == 2 and "smaller than the number of devices" in run.stderr
    assert run.stderr.count("Received:") == 1, run.stderr


def test_missing_plan_file_says_what_to_pass(tmp_path):
    from autodist_keras.errors import PlanError

    with pytest.raises(PlanError, match="Pass the path of a plan.*Received:"):
        Plan.from_json(str(tmp_path / "nope.json"))


def test_cli_scores_a_plan_the_same_whatever_the_strategy_and_simulate_flags_a_mismatch(
        cli, tmp_path):
    testbed = os.path.join(ROOT, "examples", "clusters", "cpu_testbed.yaml")
    auto = json.loads(cli("plan", "--model", "mlp", "--cluster", testbed, "--json").stdout)
    forced = json.loads(cli("plan", "--model", "mlp", "--cluster", testbed, "--json",
                            "--strategy", "single_device").stdout)
    # The same scorer. (Not the same figure: each run probes the machine's speed, and
    # under load, e.g. the other pytest worker, one run may rescale learned times 2x.)
    assert forced["scorer"].split(" (")[0] == (
        auto["baselines"]["single_device"]["scorer"].split(" (")[0])
    # ... and it says how its times were scored, as auto does (machine-speed scaling included).
    scored = [n for n in forced["notes"] if n.startswith("scored: ")]
    assert len(scored) == 1 and "scored by the" in scored[0]
    text = cli("plan", "--model", "mlp", "--cluster", testbed, "--strategy", "proportional").stdout
    assert "why: scored by the" in text
    out = tmp_path / "plan.json"
    assert cli("plan", "--model", "mlp", "--cluster", HETERO, "--out", str(out)).returncode == 0
    other = "node0:2xT4;node1:2xT4;node2:2xT4;node3:2xT4"
    run = cli("simulate", "--model", "mlp", "--cluster", other, "--plan", str(out))
    assert "was made for another cluster" in run.stderr


@torch_only
def test_placement_plans_are_not_runnable_when_planning_for_the_torch_backend(graph, hetero,
                                                                             cli):
    """`plan --backend torch` chose a FastT placement and said `runnable: true`,
    while the PyTorch runtime runs data-parallel plans only."""
    from autodist_keras.strategies import baselines

    dp = baselines.data_parallel_even(graph, hetero, 16)
    one_node = _two_groups(dp, ["node0/gpu0", "node0/gpu1"])
    assert selection.runnable_anywhere(one_node, hetero, "tensorflow") == (True, "")
    ok, why = selection.runnable_anywhere(one_node, hetero, "torch")
    assert not ok and "the PyTorch runtime runs one process per device" in why
    assert selection.runnable_anywhere(dp, hetero, "torch") == (True, "")

    # FastT's best plan for this encoder under PyTorch's costs is a placement. (The CLI
    # in this process: it runs under torch only, so `--backend torch` is this process's.)
    made = cli("plan", "--model", "transformer_encoder", "--cluster", "node0:2xA100@100",
               "--batch-size", "64", "--backend", "torch", "--json")
    assert made.returncode == 0, made.stderr
    data = json.loads(made.stdout)
    fastt = data["baselines"]["fastt"]
    assert fastt["runnable"] is False and "cannot place layer groups" in fastt["reason"]
    assert data["runnable"] is True and data["strategy"] != "fastt"


@torch_only
def test_cli_plans_for_the_backend_asked_and_simulate_names_a_mismatch(tmp_path, cli):
    """Predictions depend on the Keras backend (PyTorch's host time on GPUs, op
    fusion): `--backend` picks it in a fresh process whatever KERAS_BACKEND says
    (real CLI processes, each way: the backend is fixed per process), the plan file
    records it, and `simulate` for another backend says so; for the plan's own
    backend (here in this PyTorch process, `--backend` left out) it does not."""
    import subprocess
    import sys

    def run(*args, backend_env):
        env = dict(os.environ, KERAS_BACKEND=backend_env)
        return subprocess.run([sys.executable, "-m", "autodist_keras.cli", *args],
                              capture_output=True, text=True, env=env, timeout=300)

    out = tmp_path / "plan.json"
    made = run("plan", "--model", "mlp", "--cluster", "2xV100", "--backend", "torch",
               "--json", "--out", str(out), backend_env="tensorflow")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["backend"] == "torch"
    assert Plan.from_json(str(out)).provenance.backend == "torch"
    other = run("simulate", "--model", "mlp", "--cluster", "2xV100", "--plan", str(out),
                "--backend", "tensorflow", "--json", backend_env="torch")
    assert other.returncode == 0, other.stderr
    assert "was planned and predicted for the torch backend; this simulation is for " \
           "tensorflow" in other.stderr
    data = json.loads(other.stdout)
    assert data["backend"] == "tensorflow" and data["plan_file_backend"] == "torch"
    same = cli("simulate", "--model", "mlp", "--cluster", "2xV100", "--plan", str(out), "--json")
    assert same.returncode == 0 and "was planned and predicted" not in same.stderr
    assert json.loads(same.stdout)["backend"] == "torch"


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="`devices` and its output do not depend on the backend; run under "
                           "torch only")
def test_cli_output_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`autodist-keras devices --json | head` closes the pipe early: no traceback
    and no 'cannot use the file' error on stderr."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "autodist_keras.cli", "devices", "--cluster", "1024xV100",
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.read(100)
        proc.stdout.close()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert "Traceback" not in err and "cannot use the file" not in err, err[-2000:]
    assert proc.returncode == 1


def test_a_batch_smaller_than_the_devices_is_the_reason_given_for_no_speedup(cli):
    run = cli("plan", "--model", "mlp", "--cluster", "4xV100", "--batch-size", "2", "--json")
    assert run.returncode == 0, run.stderr
    notes = " ".join(json.loads(run.stdout)["notes"])
    assert "no speedup over data_parallel_even is given: batch_size 2 is smaller" in notes, notes
    assert "does not fit in memory" not in notes


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="the memory check and the batch its error suggests do not depend on "
                           "the backend; run under torch only (cheaper)")
def test_a_batch_that_fits_nowhere_gets_a_short_error_naming_one_that_fits(cli):
    run = cli("plan", "--model", "bert_large", "--cluster", "node0:4xV100;node1:4xT4")
    assert run.returncode == 2
    assert "No candidate plan fits" in run.stderr
    match = re.search(r"try batch_size=(\d+) or less", run.stderr)
    assert match, run.stderr[:600]
    assert len(run.stderr.splitlines()[-1]) < 4000
    fits = cli("plan", "--model", "bert_large", "--cluster", "node0:4xV100;node1:4xT4",
               "--batch-size", match.group(1), "--json")
    assert fits.returncode == 0, fits.stderr[-600:]
    assert json.loads(fits.stdout)["feasible"] is True


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="the CLI processes use this process's backend and the import code "
                           "is backend-independent; run under torch only (cheaper)")
def test_cli_import_registers_the_custom_layers_of_a_keras_file(tmp_path, cli, monkeypatch):
    import subprocess
    import sys
    import textwrap

    (tmp_path / "my_layers.py").write_text(textwrap.dedent("""
        import keras

        @keras.saving.register_keras_serializable(package="cli_test")
        class Doubler(keras.layers.Layer):
            def call(self, inputs):
                return inputs * 2.0
    """))

    # The same layer, saved here: only its registered name goes in the file.
    @keras.saving.register_keras_serializable(package="cli_test")
    class Doubler(keras.layers.Layer):
        def call(self, inputs):
            return inputs * 2.0

    try:
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(4)(Doubler()(keras.layers.Dense(16)(inputs)))
        keras.Model(inputs, outputs).save(str(tmp_path / "custom.keras"))
    finally:
        keras.saving.get_custom_objects().pop("cli_test>Doubler", None)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get(
        "PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="3")

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=240)

    # A fresh process, where only --import can register the layer.
    with_import = run("-m", "autodist_keras.cli", "graph", "--model", "custom.keras",
                      "--import", "my_layers", "--json")
    assert with_import.returncode == 0, with_import.stderr
    assert json.loads(with_import.stdout)["params"] == 8 * 16 + 16 + 16 * 4 + 4
    # The errors, in this process (the layer is unregistered here again, see above).
    monkeypatch.chdir(tmp_path)
    without = cli("graph", "--model", "custom.keras")
    assert without.returncode == 2
    assert "--import MODULE" in without.stderr and "Traceback" not in without.stderr
    missing = cli("graph", "--model", "custom.keras", "--import", "no_such_module_here")
    assert missing.returncode == 2 and "Cannot import module 'no_such_module_here'" in missing.stderr


def test_a_speedup_over_even_from_two_scorers_says_so(graph, hetero):
    """A plan outside the learned estimator's domain is scored by the simulator,
    rescaled, while even data parallelism may be scored by the estimator: the speedup
    then mixes two scorers (2.64x against the planner's own 1.21x in a FastT case)."""
    plan, _ = selection.choose_plan(graph, hetero, 256, use_cache=False)
    candidates = dict(plan.prediction.baselines)
    data = explanation(plan, hetero, candidates=candidates)
    assert data["speedup_vs_even_scorers"]["even"] == candidates["data_parallel_even"]["scorer"]
    assert "compare with care" not in render_text(data, use_rich=False)  # one scorer here
    candidates["data_parallel_even"] = dict(
        candidates["data_parallel_even"], scorer="learned estimator (ensemble, tensorflow; "
        "predicted)")
    text = render_text(explanation(plan, hetero, candidates=candidates), use_rich=False)
    assert ("(scored differently, so compare with care: this plan by the simulator, even data "
            "parallelism by the learned (ensemble))") in text


def test_a_tilde_or_relative_cache_variable_means_the_same_place_as_for_profiles(
        graph, hetero, tmp_path, monkeypatch):
    """AUTODIST_KERAS_CACHE='~/x' put plans in a directory named `~` below the current
    one (profiles went to $HOME/x), and a relative value moved with the current directory."""
    from autodist_keras.estimator import profiler

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setenv("AUTODIST_KERAS_CACHE", "~/x")
    assert selection.default_cache_dir() == str(home / "x" / "plans")
    assert selection.default_cache_dir() == os.path.join(profiler.default_cache_dir(), "plans")
    selection.choose_plan(graph, hetero, 64)
    assert len(list((home / "x" / "plans").glob("*.json"))) == 1
    assert os.listdir(work) == []
    monkeypatch.setenv("AUTODIST_KERAS_CACHE", "relative")
    assert selection.default_cache_dir() == str(work / "relative" / "plans")
    assert selection.default_cache_dir() == os.path.join(profiler.default_cache_dir(), "plans")
