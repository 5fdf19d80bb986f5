"""The Plan: what to run where, as plain versioned data.

A `Plan` is written by a planner (a baseline builder, FastT, HeteroG or Disco)
and read by a backend adapter. It is JSON-serialisable, so a plan made on a
laptop for a cluster it has never seen can be saved and run there unchanged.

Structure (HeteroG's per-op encoding, generalised):

- `groups`: layer groups. Each lists its layers and its replicas, each replica a
  device and the number of samples of the global batch it processes. A
  data-parallel plan is one group holding every layer, with one replica per
  device; a model-parallel group has one replica with the whole batch; a FastT
  split op is a group of one layer with several replicas.
- `order`: per device, the execution priority of `(layer, phase)` entries.
- `sync`: per trainable variable, `allreduce` (ring, tree or hierarchical) or
  `ps` with its server device.
- `buckets`: tensor fusion: ordered lists of variable names reduced together as
  one flat buffer, in launch order.
- `op_fusion`: groups of layers compiled together.
- `prediction`: the simulator's predicted step time and its breakdown. Every
  figure in it is a prediction, never a measurement.
- `provenance`: planner, options, planning time, graph and cluster fingerprints.

Example:

```python
plan = Plan.from_json("plan.json")
plan.validate(graph, cluster)
print(plan.summary())
```
"""

import dataclasses
import errno
import json
import math
import os
import tempfile
from typing import Optional

from autodist_keras import strict_json
from autodist_keras.errors import OutputError
from autodist_keras.errors import PlanError

# Version 2 (session 19) added `Prediction.plan_digest` and `Provenance.layer_order`;
# version 1 files are still read.
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
PHASES = ("forward", "backward")
# Notes starting with this say the plan was read from the plan cache
# (`selection.auto_select`); they describe that run only, not a file saved from it.
CACHE_NOTE_PREFIX = "cache:"
SYNC_METHODS = ("allreduce", "ps")
ALLREDUCE_ALGORITHMS = ("ring", "tree", "hierarchical")


@dataclasses.dataclass
class Replica:
    """One copy of a layer group on a device.

    Args:
        device: Device name, e.g. `"node0/gpu1"`.
        batch_share: Samples of the global batch this replica processes.
    """

    device: str
    batch_share: int


@dataclasses.dataclass
class LayerGroup:
    """Layers that share one parallel configuration.

    Args:
        name: Group name, unique in the plan.
        layers: Names of the graph nodes in this group.
        replicas: Where the group runs and with what batch shares.
    """

    name: str
    layers: list
    replicas: list

    @property
    def devices(self):
        return [r.device for r in self.replicas]

    @property
    def shares(self):
        return [r.batch_share for r in self.replicas]


@dataclasses.dataclass
class SyncSpec:
    """How one trainable variable's gradient is synchronised.

    Args:
        method: `"allreduce"` or `"ps"`.
        algorithm: For all-reduce: `"ring"`, `"tree"` or `"hierarchical"`.
        server: For PS: the device that aggregates and applies the update.
    """

    method: str = "allreduce"
    algorithm: Optional[str] = "ring"
    server: Optional[str] = None


@dataclasses.dataclass
class Prediction:
    """Simulator output attached to a plan. Every number here is predicted.

    Args:
        step_time_s: Predicted time of one training step, in seconds.
        compute_s: Predicted compute time on the critical device.
        exposed_comm_s: Predicted communication time not hidden by compute.
        idle_s: Predicted idle time on the critical device.
        peak_memory_bytes: Predicted peak memory per device.
        feasible: False when the plan does not fit in some device's memory.
        infeasible_reason: Which device is short and by how much.
        per_device: Per-device busy/idle/exposed-communication breakdown.
        baselines: The same figures for baseline plans, by name.
        source: Where the step time comes from (e.g. `"simulator (predicted)"`
            or `"learned estimator (gnn, torch; predicted)"`).
        simulated_step_time_s: The simulator's step time when `step_time_s`
            comes from another predictor (the breakdown is the simulator's).
        plan_digest: Digest of the plan these figures describe, written with
            the plan (`Plan.structure_digest`); a plan file edited afterwards
            no longer matches it (`Plan.prediction_matches`).
    """

    step_time_s: float
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    idle_s: float = 0.0
    peak_memory_bytes: dict = dataclasses.field(default_factory=dict)
    feasible: bool = True
    infeasible_reason: Optional[str] = None
    per_device: dict = dataclasses.field(default_factory=dict)
    baselines: dict = dataclasses.field(default_factory=dict)
    source: str = "simulator (predicted)"
    simulated_step_time_s: Optional[float] = None
    plan_digest: Optional[str] = None


@dataclasses.dataclass
class Provenance:
    """Who made the plan, how, and for what.

    Args:
        planner: Name of the planner or baseline builder.
        options: Options the planner was called with (JSON-serialisable).
        planning_time_s: Wall time spent planning, measured.
        graph_fingerprint: `ModelGraph.fingerprint()` of the planned model.
        cluster_fingerprint: `Cluster.fingerprint()` of the planned cluster.
        layer_order: The planned model's layer (graph node) names in the
            graph's order, which the fingerprint covers by index: the same
            model numbered differently by Keras maps onto it (`renamed_for`).
        backend: The Keras backend the plan was made and predicted for
            (`"tensorflow"` or `"torch"`; None in files written before
            session 20): predictions differ between backends.
    """

    planner: str
    options: dict = dataclasses.field(default_factory=dict)
    planning_time_s: float = 0.0
    graph_fingerprint: Optional[str] = None
    cluster_fingerprint: Optional[str] = None
    layer_order: Optional[list] = None
    backend: Optional[str] = None

    @property
    def candidate(self):
        """The candidate's name where `auto` chose it (e.g. `data_parallel_even_ps`,
        whose planner is `data_parallel_even`), else the planner's."""
        return (self.options or {}).get("auto_chosen") or self.planner


@dataclasses.dataclass
class Plan:
    """A deployment plan for one model on one cluster.

    Args:
        global_batch_size: The batch size the shares add up to. When `fit`
            is called with another batch size, shares are rescaled in
            proportion (see `shares_for`).
        groups: List of `LayerGroup`.
        sync: Dict from variable name to `SyncSpec`.
        buckets: Ordered list of lists of variable names (tensor fusion).
        order: Dict from device name to a list of `[layer, phase]` pairs.
        op_fusion: List of lists of layer names compiled together.
        prediction: The simulator's `Prediction`, or None.
        provenance: `Provenance`.
        notes: Human-readable flags, e.g. parts an adapter cannot execute yet.
        schema_version: JSON schema version.
    """

    global_batch_size: int
    groups: list
    sync: dict
    buckets: list = dataclasses.field(default_factory=list)
    order: dict = dataclasses.field(default_factory=dict)
    op_fusion: list = dataclasses.field(default_factory=list)
    prediction: Optional[Prediction] = None
    provenance: Provenance = dataclasses.field(
        default_factory=lambda: Provenance(planner="manual")
    )
    notes: list = dataclasses.field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    # The file the plan was read from (`from_json`), for error messages; None for a
    # plan made in this process or read from a dict. A class attribute, not a
    # dataclass field: it is not part of the plan's data and is never serialised.
    read_from = None

    # ------------------------------------------------------------------ views
    @property
    def devices(self):
        """Device names used by any group, in first-use order."""
        seen = []
        for group in self.groups:
            for replica in group.replicas:
                if replica.device not in seen:
                    seen.append(replica.device)
        return seen

    def nodes(self, cluster):
        """Sorted names of the `cluster` nodes the plan uses: its replicas' devices'
        and its parameter servers' (names the cluster lacks are left out)."""
        names = set(self.devices) | {
            s.server for s in self.sync.values() if s.method == "ps" and s.server}
        return sorted({cluster.device(n).node for n in names if n in cluster.names})

    @property
    def is_data_parallel(self):
        """True when the plan is one group replicated over its devices."""
        return len(self.groups) == 1

    @property
    def replicas(self):
        """Replicas of the data-parallel group.

        Raises:
            PlanError: If the plan has several groups.
        """
        if not self.is_data_parallel:
            raise PlanError(
                "This plan has several layer groups (a placement or hybrid plan); "
                "it has no single list of data-parallel replicas. "
                f"Received: {len(self.groups)} groups."
            )
        return list(self.groups[0].replicas)

    def shares_for(self, batch_size):
        """Split `batch_size` samples over the data-parallel replicas.

        Shares are proportional to the planned ones and are whole samples
        (largest-remainder rounding), so the last, smaller batch of an epoch
        is split in the same proportions.

        Args:
            batch_size: Number of samples in the batch to split.

        Returns:
            A list of ints, one per replica, summing to `batch_size`.
        """
        return split_batch([r.batch_share for r in self.replicas], batch_size)

    # ------------------------------------------------------------ validation
    def check_structure(self):
        """Checks what needs neither the model nor the cluster: the plan has
        groups, each group names its layers as a list of strings and has at
        least one replica.

        Raises:
            PlanError: Naming the first group that is malformed.
        """
        if not self.groups:
            raise PlanError(
                "The plan has no layer groups; every layer of the model belongs to one. "
                "Re-create the plan (`autodist-keras plan ... --out`, Plan.to_json()). "
                "Received: groups=[]")
        for gi, group in enumerate(self.groups):
            where = f"groups[{gi}] ({group.name!r})"
            if not isinstance(group.layers, (list, tuple)) or not all(
                    isinstance(layer, str) for layer in group.layers):
                raise PlanError(
                    f"{where}: 'layers' must be a list of layer names. "
                    f"Received: {group.layers!r}")
            if not group.replicas:
                raise PlanError(f"{where}: a group needs at least one replica. Received: []")

    def validate(self, graph, cluster):
        """Check the plan against a model graph and a cluster.

        Args:
            graph: The `ModelGraph` the plan is for.
            cluster: The `Cluster` the plan will run on.

        Returns:
            A list of warning strings (e.g. fingerprint mismatches); empty when
            everything matches.

        Raises:
            PlanError: If shares do not add up to the batch, a device or layer
                is unknown, a variable has no sync method, or the buckets miss
                or repeat a variable.
        """
        if self.schema_version not in READABLE_SCHEMA_VERSIONS:
            raise PlanError(
                f"Plan schema version {self.schema_version} is not supported; "
                f"this autodist_keras reads versions {READABLE_SCHEMA_VERSIONS} (a newer "
                "release wrote it, or it is damaged). Re-create the plan with this version. "
                f"Received: {self.schema_version}"
            )
        _check_positive_int(self.global_batch_size, "global_batch_size")
        device_names = set(cluster.names)
        layer_names = list(graph.nodes)
        layer_set = set(layer_names)
        self.check_structure()
        group_names = set()
        placed = {}
        for gi, group in enumerate(self.groups):
            where = f"groups[{gi}] ({group.name!r})"
            if group.name in group_names:
                raise PlanError(f"{where}: duplicate group name. Received: {group.name!r}")
            group_names.add(group.name)
            for layer in group.layers:
                if layer not in layer_set:
                    raise PlanError(
                        f"{where}: unknown layer {layer!r}; the model's layers are "
                        f"{_preview(layer_names)}. Received: {layer!r}"
                    )
                if layer in placed:
                    raise PlanError(
                        f"{where}: layer {layer!r} is already in group {placed[layer]!r}; "
                        f"each layer belongs to exactly one group. Received: {layer!r}"
                    )
                placed[layer] = group.name
            seen_devices = set()
            for ri, replica in enumerate(group.replicas):
                if replica.device not in device_names:
                    raise PlanError(
                        f"{where}.replicas[{ri}]: unknown device {replica.device!r}; the "
                        f"cluster has {_preview(sorted(device_names))}. "
                        f"Received: {replica.device!r}"
                    )
                if replica.device in seen_devices:
                    raise PlanError(
                        f"{where}.replicas[{ri}]: device {replica.device!r} appears twice; "
                        "give it one replica with the summed batch share. "
                        f"Received: {replica.device!r}"
                    )
                seen_devices.add(replica.device)
                if not isinstance(replica.batch_share, int) or isinstance(
                    replica.batch_share, bool
                ) or replica.batch_share < 1:
                    raise PlanError(
                        f"{where}.replicas[{ri}].batch_share must be a positive integer "
                        "number of samples (a device with no samples has no replica: leave "
                        f"it out of the group). Received: {replica.batch_share!r}"
                    )
            total = sum(group.shares)
            if total != self.global_batch_size:
                raise PlanError(
                    f"{where}: batch shares add up to {total}, not to the global batch "
                    f"size {self.global_batch_size}. Make the shares sum to the batch. "
                    f"Received: {group.shares}"
                )
        missing = [name for name in layer_names if name not in placed]
        if missing:
            raise PlanError(
                f"Layers {_preview(missing)} are in no group; every layer of the model "
                f"must belong to one group. Received: groups {[g.name for g in self.groups]}"
            )

        for device, entries in self.order.items():
            if device not in device_names:
                raise PlanError(
                    f"order: unknown device {device!r}; the cluster has "
                    f"{_preview(sorted(device_names))}. Received: {device!r}"
                )
            for entry in entries:
                if len(entry) != 2 or entry[0] not in layer_set or entry[1] not in PHASES:
                    raise PlanError(
                        f"order[{device!r}]: each entry must be [layer, phase] with a "
                        f"known layer and a phase in {PHASES}. Received: {entry!r}"
                    )

        variable_names = [v.name for v in graph.variables]
        variable_set = set(variable_names)
        for name, spec in self.sync.items():
            if name not in variable_set:
                raise PlanError(
                    f"sync: unknown variable {name!r}; the model's trainable variables "
                    f"are {_preview(variable_names)}. Received: {name!r}"
                )
            if spec.method not in SYNC_METHODS:
                raise PlanError(
                    f"sync[{name!r}].method must be one of {SYNC_METHODS}. "
                    f"Received: {spec.method!r}"
                )
            if spec.method == "allreduce" and spec.algorithm not in ALLREDUCE_ALGORITHMS:
                raise PlanError(
                    f"sync[{name!r}].algorithm must be one of {ALLREDUCE_ALGORITHMS}. "
                    f"Received: {spec.algorithm!r}"
                )
            if spec.method == "ps" and spec.server not in device_names:
                raise PlanError(
                    f"sync[{name!r}]: PS server must be a device of the cluster "
                    f"({_preview(sorted(device_names))}). Received: {spec.server!r}"
                )
        unsynced = [name for name in variable_names if name not in self.sync]
        if unsynced:
            raise PlanError(
                f"Variables {_preview(unsynced)} have no sync method; give each "
                "trainable variable an `allreduce` or `ps` entry in `sync`. "
                f"Received: sync for {len(self.sync)} of {len(variable_names)} variables"
            )

        counts = {}
        for bi, bucket in enumerate(self.buckets):
            if not bucket:
                raise PlanError(f"buckets[{bi}] is empty. Received: []")
            for name in bucket:
                if name not in variable_set:
                    raise PlanError(
                        f"buckets[{bi}]: unknown variable {name!r}. Received: {name!r}"
                    )
                counts[name] = counts.get(name, 0) + 1
        repeated = sorted(name for name, count in counts.items() if count > 1)
        if repeated:
            raise PlanError(
                f"Variables {_preview(repeated)} appear in more than one bucket; each "
                "variable is reduced in exactly one bucket. "
                f"Received: {len(self.buckets)} buckets"
            )
        if variable_names and self.buckets:
            unbucketed = [name for name in variable_names if name not in counts]
            if unbucketed:
                raise PlanError(
                    f"Variables {_preview(unbucketed)} are in no bucket; the buckets must "
                    "cover every trainable variable (use one bucket per variable for no "
                    "tensor fusion). "
                    f"Received: {len(self.buckets)} buckets"
                )
        elif variable_names:
            raise PlanError(
                "The plan has no gradient buckets; list every trainable variable in "
                "`buckets` (one bucket per variable means no tensor fusion). Received: []"
            )

        from autodist_keras.fusion.op_fusion import check_regions

        check_regions(graph, self.op_fusion)

        warnings = []
        fp = getattr(graph, "fingerprint", None)
        if self.provenance.graph_fingerprint and fp is not None:
            if fp() != self.provenance.graph_fingerprint:
                warnings.append(
                    "The plan was made for a different model graph (fingerprint "
                    f"{self.provenance.graph_fingerprint[:12]} vs {fp()[:12]})."
                )
        cfp = getattr(cluster, "fingerprint", None)
        if self.provenance.cluster_fingerprint and cfp is not None:
            if cfp() != self.provenance.cluster_fingerprint:
                warnings.append(
                    "The plan was made for a different cluster description (fingerprint "
                    f"{self.provenance.cluster_fingerprint[:12]} vs {cfp()[:12]}); its "
                    "predictions may not hold here."
                )
        return warnings

    # ---------------------------------------------------------------- JSON
    def structure_digest(self):
        """A digest of what the plan prescribes (batch, groups, sync, buckets, order,
        op fusion), not of its prediction, notes or provenance."""
        import hashlib

        what = {
            "global_batch_size": self.global_batch_size,
            "groups": [dataclasses.asdict(g) for g in self.groups],
            "sync": {k: dataclasses.asdict(v) for k, v in sorted(self.sync.items())},
            "buckets": self.buckets,
            "order": {d: [list(e) for e in es] for d, es in sorted(self.order.items())},
            "op_fusion": self.op_fusion,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def prediction_matches(self):
        """False when the plan was changed after its prediction was written with it
        (a hand-edited plan file): the recorded figures describe another plan."""
        if self.prediction is None or self.prediction.plan_digest is None:
            return True
        return self.prediction.plan_digest == self.structure_digest()

    def to_dict(self):
        """Returns the plan as a JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["order"] = {d: [list(e) for e in entries] for d, entries in self.order.items()}
        if data.get("prediction") is not None and data["prediction"].get("plan_digest") is None:
            # A prediction made in this process describes the plan as it is; one read
            # from a file keeps the digest it was written with, so that an edit made
            # since (in the file, or through this object) still shows.
            data["prediction"]["plan_digest"] = self.structure_digest()
        return data

    @classmethod
    def from_dict(cls, data, source="<dict>"):
        """Builds a plan from `to_dict()` output.

        The dict's shape is checked field by field before anything is built:
        each field must have its JSON type (a list of strings where a list of
        names belongs, an object where an object belongs, numbers, booleans,
        null where allowed), the prediction's times must be finite and not
        negative, and a field the format does not have (a misspelt name, at
        any level) is refused rather than ignored. What needs the model or
        the cluster (layer and device names, batch shares adding up) is
        checked by `validate`.

        Args:
            data: The dict.
            source: Where it came from, for error messages.

        Raises:
            PlanError: If the dict is not a plan of a supported schema version,
                or a field is missing, unknown or of the wrong type (the
                error names the field's path, e.g. `groups[0].replicas[1]`).
        """
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan must be a JSON object. Received: {type(data).__name__}")
        version = data.get("schema_version")
        if version is None and "predicted_step_time_s" in data and "baselines" in data:
            hint = (f"; this one names its plan file: {data['plan_file']!r}"
                    if data.get("plan_file") else "")
            raise PlanError(
                f"{source} is the report `autodist-keras plan --json` prints, not a plan. "
                "Write the plan itself with `autodist-keras plan ... --out plan.json` (or "
                f"Plan.to_json()) and pass that file{hint}. Received: a report with keys "
                f"{sorted(data)[:6]}..."
            )
        if version is None and "groups" not in data:
            raise PlanError(
                f"{source} is not a plan: a plan is a JSON object with 'schema_version', "
                "'groups', 'sync' and 'global_batch_size', as Plan.to_json() writes it. "
                f"Received: an object with keys {sorted(data)[:8]}"
            )
        if version not in READABLE_SCHEMA_VERSIONS:
            raise PlanError(
                f"{source}: plan schema version must be one of {READABLE_SCHEMA_VERSIONS} "
                "(a newer autodist_keras wrote it, or it is damaged); re-create the plan with "
                f"this version. Received: {version!r}"
            )
        _check_shape(data, source)
        try:
            groups = [
                LayerGroup(
                    name=g["name"],
                    # (anything but a list is kept as is, for check_structure to name)
                    layers=(list(g["layers"]) if isinstance(g["layers"], (list, tuple))
                            else g["layers"]),
                    replicas=[Replica(r["device"], r["batch_share"]) for r in g["replicas"]],
                )
                for g in data["groups"]
            ]
            sync = {name: SyncSpec(**spec) for name, spec in data["sync"].items()}
            prediction = data.get("prediction")
            prediction = Prediction(**prediction) if prediction is not None else None
            provenance = Provenance(**data.get("provenance") or {"planner": "manual"})
            plan = cls(
                global_batch_size=data["global_batch_size"],
                groups=groups,
                sync=sync,
                buckets=[list(b) for b in data.get("buckets", [])],
                order={d: [tuple(e) for e in es] for d, es in data.get("order", {}).items()},
                op_fusion=[list(r) for r in data.get("op_fusion", [])],
                prediction=prediction,
                provenance=provenance,
                notes=list(data.get("notes", [])),
                schema_version=SCHEMA_VERSION,  # (read as this version: new fields empty)
            )
        except PlanError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PlanError(
                f"{source}: malformed plan ({type(e).__name__}: {e}). Write plans with "
                f"Plan.to_json(). Received: an object with keys {sorted(data)}"
            ) from None
        try:
            plan.check_structure()
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None
        return plan

    def to_json(self, path=None, indent=2):
        """Serialises the plan to JSON.

        Args:
            path: If given, the file to write (atomically: no partial file is
                left on error).
            indent: JSON indentation.

        Returns:
            The JSON text: standard JSON, which strict readers (JavaScript's
            `JSON.parse`, `jq`) accept.

        Raises:
            PlanError: If the plan holds a NaN or infinite number (the
                field is named; nothing is written).
            OutputError: If `path` cannot be written.
        """
        text = strict_json.dumps(self.to_dict(), "the plan" if path is None else os.fspath(path),
                                 PlanError, indent=indent, sort_keys=False)
        if path is not None:
            write_text_atomic(path, text)
        return text

    @classmethod
    def from_json(cls, text_or_path):
        """Reads a plan from JSON text or from a `.json` file path.

        A plan read from a file remembers its path in `read_from` (not part
        of the plan's data: `to_dict` and `to_json` leave it out), so that
        errors found later, when the plan meets a model, can name the file.

        Raises:
            PlanError: If the file is missing, the JSON is malformed, or the
                content is not a plan.
        """
        source = "<json>"
        text = text_or_path
        if isinstance(text_or_path, os.PathLike) or (
            isinstance(text_or_path, str) and not text_or_path.lstrip().startswith("{")
        ):
            source = os.fspath(text_or_path)
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise PlanError(
                    f"Cannot read plan file {source}: {e.strerror}. Pass the path of a plan "
                    "written by Plan.to_json() or `autodist-keras plan --out`. "
                    f"Received: {source!r}"
                ) from None
            except UnicodeDecodeError as e:
                raise PlanError(
                    f"{source} is not a plan: it is not UTF-8 text (byte {e.start} cannot be "
                    "decoded). Plans are JSON written by Plan.to_json() or `autodist-keras "
                    f"plan --out`; write it again. Received: {source!r}"
                ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            where = "the file ends early (truncated?)" if _cut_short(text, e) else (
                f"line {e.lineno}, column {e.colno}")
            raise PlanError(
                f"{source} is not valid JSON: {e.msg} at {where}. Write plans with "
                "Plan.to_json() or `autodist-keras plan --out`. "
                f"Received: {len(text)} characters from {source}"
            ) from None
        plan = cls.from_dict(data, source=source)
        if source != "<json>":
            plan.read_from = source
        return plan

    # ------------------------------------------------------------- display
    def renamed_for(self, graph):
        """This plan with Keras's per-process layer numbering matched to `graph`.

        Keras numbers unnamed layers per process (`input_layer` in one
        process is `input_layer_1` in another that built a model first), so
        a plan file names layers the same model may not have here. When the
        plan was made for a graph of the same structure (`graph_fingerprint`,
        which covers the layers by their index in the graph) and recorded
        its layer names in that order (`provenance.layer_order`), each layer
        is mapped to the one at the same index here, and the plan's layer
        lists, execution order, sync, buckets and op-fusion regions are
        renamed. Variable paths also hold the names of the models they sit
        in (a Sequential's own name, a nested model's), numbered too: each
        variable is paired with the one here whose path has the same layers
        and leaf, one to one. For a plan made for another model (another
        structure), layers keep their names and only those model names are
        paired, so a Sequential whose layers are named takes a plan file
        written by a process that numbered the Sequential differently.

        Args:
            graph: The `ModelGraph` of the model here.

        Returns:
            `(plan, renames)`: a renamed copy and the `{old: new}` layer (and
            model) names that changed, or `(None, {})` when the names match
            already or cannot be matched (variables that do not pair one to
            one; for another structure, or a plan without `layer_order` as
            written before session 19, variables whose layers are not named
            alike here).
        """
        import copy

        order = self.provenance.layer_order
        here = list(graph.nodes)
        same_structure = bool(
            order and len(order) == len(here) and self.provenance.graph_fingerprint
            and self.provenance.graph_fingerprint == graph.fingerprint())
        if same_structure:
            renames = {old: new for old, new in zip(order, here) if old != new}
        else:
            # Another model (or a plan without `layer_order`): layers cannot be paired
            # by index, so they keep their names (named layers match, others do not);
            # only the numbered model names in the variable paths are paired below,
            # so that a Sequential with named layers, built after another model in
            # this process (`sequential_1/hidden/kernel`), takes its plan file
            # (`sequential/hidden/kernel`) as the same model would.
            order = list(dict.fromkeys(n for group in self.groups for n in group.layers))
            renames = {}
        # Variable paths hold layer names, and also other segments that Keras
        # may number: the models they sit in (`sequential/dense/kernel`,
        # `outer/inner/dense/kernel`) and a layer's own sublayers
        # (`bidirectional/forward_lstm_1/...`; MultiHeadAttention's `query`,
        # `key`, ...). Each variable of the plan is paired with the one here
        # whose path has the same layers (renamed), the same leaf, and other
        # segments equal but for Keras's `_N` suffix; every pairing must be one
        # to one. A variable with no unique match is tried again without the
        # segments before its path's first layer name (the outer models'): a
        # Sequential loaded with `load_model` builds its layers outside its own
        # name scope, so `sequential/dense/kernel` becomes `dense/kernel`.
        old_layers, here_layers = set(order), set(here)

        def skeleton(name, layers, rename, trim=False):
            parts = name.split("/")
            first = next((j for j, p in enumerate(parts[:-1]) if p in layers), 0) if trim else 0
            last = len(parts) - 1
            return tuple(rename.get(p, p) if p in layers
                         else (p if j == last else ("~", _unnumbered(p)))
                         for j, p in enumerate(parts) if j >= first)

        here_by_skeleton, here_by_trimmed = {}, {}
        for v in graph.variables:
            here_by_skeleton.setdefault(skeleton(v.name, here_layers, {}), []).append(v.name)
            here_by_trimmed.setdefault(skeleton(v.name, here_layers, {}, True), []).append(v.name)
        old_vars = list(dict.fromkeys(
            list(self.sync) + [v for bucket in self.buckets for v in bucket]))
        variables, models = {}, {}
        for name in old_vars:
            match = here_by_skeleton.get(skeleton(name, old_layers, renames), [])
            if len(match) != 1:
                match = here_by_trimmed.get(skeleton(name, old_layers, renames, True), [])
            if len(match) != 1:
                return None, {}  # no variable, or several, fit: not matched
            variables[name] = match[0]
            for a, b in zip(reversed(name.split("/")), reversed(match[0].split("/"))):
                if a not in old_layers and a != b and models.setdefault(a, b) != b:
                    return None, {}
        if len(set(variables.values())) != len(variables):
            return None, {}
        if not renames and all(a == b for a, b in variables.items()):
            return None, {}
        renames = dict(renames, **models)
        matched = self.prediction_matches()
        plan = copy.deepcopy(self)
        layer_renames = {k: v for k, v in renames.items() if k in old_layers}
        for group in plan.groups:
            group.layers = [layer_renames.get(n, n) for n in group.layers]
        plan.order = {d: [(layer_renames.get(layer, layer), phase) for layer, phase in entries]
                      for d, entries in plan.order.items()}
        plan.sync = {variables[k]: v for k, v in plan.sync.items()}
        plan.buckets = [[variables[v] for v in bucket] for bucket in plan.buckets]
        plan.op_fusion = [[layer_renames.get(n, n) for n in region]
                          for region in plan.op_fusion]
        if same_structure:
            plan.provenance.layer_order = here
        if matched and plan.prediction is not None:
            # Renaming changes no figure: the prediction still describes this plan.
            plan.prediction.plan_digest = plan.structure_digest()
        return plan, renames

    def without_variables(self, names):
        """A copy of the plan whose sync and gradient buckets leave out `names`.

        For variables that no longer train (a layer frozen between fits): the
        placement and shares stay as they are. Buckets left empty are dropped.
        The copy has no prediction (it describes another plan).

        Args:
            names: Variable names (paths) to leave out.

        Returns:
            A new `Plan`.
        """
        import copy

        names = set(names)
        plan = copy.deepcopy(self)
        plan.sync = {k: v for k, v in plan.sync.items() if k not in names}
        plan.buckets = [kept for kept in ([n for n in bucket if n not in names]
                                          for bucket in plan.buckets) if kept]
        plan.prediction = None
        return plan

    def summary(self):
        """Returns a short plain-text description of the plan."""
        lines = [
            f"Plan by {self.provenance.planner}: {len(self.groups)} group(s), "
            f"global batch {self.global_batch_size}, {len(self.buckets)} gradient bucket(s)"
        ]
        for group in self.groups:
            shares = ", ".join(f"{r.device}={r.batch_share}" for r in group.replicas)
            lines.append(f"  group {group.name}: {len(group.layers)} layer(s) on [{shares}]")
        methods = {}
        for spec in self.sync.values():
            key = spec.method if spec.method == "allreduce" else f"ps@{spec.server}"
            if spec.method == "allreduce":
                key = f"allreduce/{spec.algorithm}"
            methods[key] = methods.get(key, 0) + 1
        if methods:
            lines.append(
                "  sync: " + ", ".join(f"{k} x{v}" for k, v in sorted(methods.items()))
            )
        if self.prediction is not None:
            lines.append(
                f"  predicted step time: {self.prediction.step_time_s * 1e3:.2f} ms "
                f"({self.prediction.source})"
            )
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def _unnumbered(name):
    """A name without Keras's per-process `_N` suffix (`sequential_3` -> `sequential`)."""
    stem, _, number = name.rpartition("_")
    return stem if stem and number.isdigit() else name


def split_batch(weights, batch_size):
    """Splits `batch_size` samples in proportion to `weights`.

    Uses largest-remainder rounding so the parts are whole samples, add up to
    `batch_size` exactly, and ties go to the earlier entries.

    Args:
        weights: Non-negative numbers, not all zero.
        batch_size: Non-negative int.

    Returns:
        A list of ints summing to `batch_size`.

    Example:

    >>> split_batch([2, 1, 1], 10)
    [5, 3, 2]
    """
    weights = [float(w) for w in weights]
    if not weights or any(w < 0 or math.isnan(w) for w in weights) or sum(weights) <= 0:
        raise PlanError(
            "Batch weights must be non-negative and not all zero. "
            f"Received: {weights}"
        )
    total = sum(weights)
    exact = [batch_size * w / total for w in weights]
    parts = [int(math.floor(x)) for x in exact]
    remainder = batch_size - sum(parts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[:remainder]:
        parts[i] += 1
    return parts


def _file_mode(path):
    """The mode `path` should get: an existing file's own, else 0o666 minus the umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _cut_short(text, error):
    """Whether a `json.JSONDecodeError` is the text ending early: a string left open,
    or nothing but the start of one literal (`nu` of null, `tr` of true, a number's
    digits) after the error's position."""
    import re

    if error.msg.startswith("Unterminated string"):  # no closing quote up to the end
        return True
    tail = text[error.pos:].strip()
    return not tail or re.fullmatch(r"-?[0-9.eE+-]*|n(u(ll?)?)?|t(r(ue?)?)?|f(a(l(se?)?)?)?",
                                    tail) is not None


def write_text_atomic(path, text):
    """Writes `text` to `path` through a temporary file and a rename.

    The file gets the permissions an ordinary write would give it (an
    existing file's mode, else the umask's), not the temporary file's 0600.
    Missing parent directories are created.

    Raises:
        OutputError: If `path` is a directory, or the file or its directory
            cannot be written (nothing is left behind).
    """
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), suffix=".json")


def refuse_directory(path, example_name):
    """Raises `OutputError` if `path` cannot name a file: not a path, empty, a directory
    (an existing one, or a path ending with a separator).

    A directory gets a file in it suggested. (An empty path wrote nothing from the
    command line, with status 0, and `plot("")` a hidden `.png` file.)

    Args:
        path: The path to be written (a string or path-like).
        example_name: A file name to suggest.
    """
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise OutputError(f"The output path must be a string or path-like, such as "
                          f"{example_name!r}. Received: {short_repr(path, 80)} of type "
                          f"{type(path).__name__}")
    text = os.fspath(path)
    if not text.strip():
        raise OutputError(f"The output path is empty: give the file to write, such as "
                          f"{example_name!r}. Received: {text!r}")
    if "\0" in text:  # (passed every check, then the write raised "embedded null byte")
        raise OutputError(f"The output path holds a NUL character ('\\x00'), which no file "
                          f"name can hold: give the file to write, such as {example_name!r}. "
                          f"Received: {text!r}")
    if os.path.isdir(path):
        raise OutputError(f"Cannot write {path!r}: it is a directory. Give a file name, such "
                          f"as {os.path.join(path, example_name)!r}. Received: {path!r}")
    if text.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        # ("pics/" wrote a hidden "pics/.png"; `--out plans/` failed after the planning.)
        raise OutputError(f"Cannot write {text!r}: it ends with a path separator, "
                          "so it names a directory, not a file. Give a file name, such as "
                          f"{os.path.join(text, example_name)!r}. Received: {text!r}")


def output_target(path, example_name):
    """The file that writing `path` replaces; raises `OutputError` if it must not be.

    A symbolic link is written through (its target gets the new content, the
    link stays); a directory, device, pipe or socket is refused (a rename
    would replace a device with a file). Call it before long work whose
    result goes to `path`, so a bad path fails first.

    Args:
        path: The path to be written.
        example_name: A file name to suggest inside a directory.

    Returns:
        The path of the file to replace.

    Raises:
        OutputError: If `path` is not a path, is empty, a directory, a device,
            pipe or socket, or lies under a file, under a symbolic link to a
            missing target, or in a directory where this user cannot create
            a file (checked by creating and removing one).

    Example:

    ```python
    target = output_target("runs/plan.json", "plan.json")  # before the planning
    plan = ...  # long work
    plan.to_json("runs/plan.json")
    ```
    """
    target, parent = _checked_target(path, example_name)
    # The output is a new file in that folder, renamed over the target: a folder that
    # takes no new file (/proc, a read-only mount; root passes the access check above
    # whatever the mode) failed only at the write, after the work.
    fd, probe = _create_temp(path, parent)
    try:
        os.close(fd)
    finally:  # (removed whatever happens; an append-only folder keeps it: said there)
        _remove_temp(path, parent, probe, "test file")
    return target


def _checked_target(path, example_name):
    """`output_target`'s checks but the probe: returns `(target, parent)`, the file
    to replace and the nearest folder of it that exists (where the probe goes)."""
    refuse_directory(path, example_name)
    path = os.fspath(path)  # (isdir, like exists below, follows links)
    target = path
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OutputError(f"Cannot write {path!r}: its symbolic links form a loop. "
                                  "Remove the link or give another path. "
                                  f"Received: {path!r}") from None
        target = os.path.realpath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise OutputError(f"Cannot write {path!r}: it exists and is not a regular file (a "
                          "device, pipe or socket), which the output would replace. Give the "
                          f"path of a file. Received: {path!r}")
    # The nearest folder that exists must be one, and writable (the missing ones below it
    # are made): checked here, before the work, not found by the write after it ("File
    # exists" for a path under a file, after the whole planning).
    parent = os.path.dirname(os.path.abspath(target))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.islink(parent) and not os.path.exists(parent):
        # (It was called "a file": a link to a folder that is gone, or not made yet.)
        if _link_loops(parent):
            raise OutputError(f"Cannot write {path!r}: {parent!r} is a symbolic link in a "
                              "loop of links, so nothing can be written under it. Remove the "
                              f"link or give another path. Received: {path!r}")
        raise OutputError(f"Cannot write {path!r}: {parent!r} is a symbolic link to a missing "
                          f"target ({os.readlink(parent)!r}), so nothing can be written under "
                          "it. Create the directory it points to, fix the link, or give "
                          f"another path. Received: {path!r}")
    if not os.path.isdir(parent):
        raise OutputError(f"Cannot write {path!r}: {parent!r} is a file, not a directory, so "
                          "nothing can be written under it. Give a path in a directory (or "
                          f"move that file). Received: {path!r}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"Cannot write {path!r}: the directory {parent!r} is not writable "
                          "by this user. Give a path in a writable directory, or change its "
                          f"permissions. Received: {path!r}")
    return target, parent


def _create_temp(path, folder, suffix=""):
    """`tempfile.mkstemp` in `folder` for writing `path`: `(fd, name)`, or an
    `OutputError` saying that no file can be created there."""
    try:
        return tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    except OSError as e:
        raise _cannot_create(path, folder, e) from None


def _cannot_create(path, folder, error):
    return OutputError(f"Cannot write {path!r}: no file can be created in {folder!r} "
                       f"({error.strerror or error}), and the output is written there first. "
                       f"Give a path in a writable directory. Received: {path!r}")


def _remove_temp(path, folder, name, what):
    """Removes the temporary file `name` made in `folder` for writing `path`; an
    `OutputError` naming it (`what`: "test file", "temporary file") if it stays."""
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
    except OSError as e:
        # (It escaped as a PermissionError, and the file stayed unnamed.)
        raise OutputError(
            f"Cannot write {path!r}: a file created in {folder!r} cannot be removed "
            f"there ({e.strerror or e}; an append-only folder?), and the output is "
            f"written there first, then renamed over the target. Give a path in another "
            f"directory, and remove the {what} {name!r} left there. "
            f"Received: {path!r}") from None


def _link_loops(path):
    """Whether resolving the symbolic link `path` runs into a loop of links."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def write_atomic(path, write, suffix=""):
    """Writes a file through a temporary file in its directory and a rename.

    Args:
        path: The file to write; missing parent directories are created.
        write: Callable given the open binary temporary file.
        suffix: Ending of the temporary file's name (some writers, such as
            matplotlib, pick the format from it).

    A symbolic link is written through to its target. The path gets the
    checks of `output_target` but its probe: the temporary file is the
    probe, so a folder is tried once (call `output_target` first only to
    fail before long work).

    Raises:
        OutputError: If `path` is a directory, a device, pipe or socket, or
            the file or its directory cannot be written (nothing is left
            behind, except in a folder where the temporary file cannot be
            removed, such as an append-only one: the message names it).

    Example:

    ```python
    write_atomic("runs/timeline.svg", lambda f: fig.savefig(f, format="svg"), suffix=".svg")
    ```
    """
    # The checks of `output_target` but its probe: the temporary file is the probe.
    target, parent = _checked_target(path, "out" + suffix)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # (said as the probe of `output_target` says it)
        raise _cannot_create(path, parent, e) from None
    mode = _file_mode(target)
    fd, tmp = _create_temp(path, directory, suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise OutputError(f"Cannot write {path!r}: {e.strerror or e}. Check the path and its "
                          f"directory's permissions. Received: {path!r}") from e
    finally:
        if tmp is not None:  # (an append-only folder keeps it: an OutputError naming it)
            _remove_temp(path, directory, tmp, "temporary file")


# ------------------------------------------------------------ JSON shape
# `Plan.from_dict` checks a plan's JSON shape with these before building it. Each
# check is a function `(value, path, source)` that raises a PlanError naming the
# field's path; values whose meaning needs the model or cluster (layer and device
# names, batch shares and their sum, sync methods) are left to `validate`.

_SHAPE_FIX = ("Correct the field in the file (the format is the one Plan.to_json() writes), "
              "or write the plan again with Plan.to_json() or `autodist-keras plan --out`.")


def short_repr(value, limit=120):
    """`repr(value)`, cut to about `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _json_type(value):
    """How JSON names the type of a value read from it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shape_error(source, path, problem, received, fix=_SHAPE_FIX):
    return PlanError(f"{source}: {path or 'top level'}: {problem}. {fix} Received: {received}")


def _wrong_type(source, path, what, value):
    """The `_shape_error` of a field whose value is not `what`."""
    return _shape_error(source, path, f"must be {what}, not {_json_type(value)}", short_repr(value))


def _kind(what, test, nullable=False):
    """A check that `test(value)` holds (or the value is null, where `nullable`),
    `what` saying what the field must be."""
    what = f"{what}, or null" if nullable else what

    def check(value, path, source):
        if not (nullable and value is None) and not test(value):
            raise _wrong_type(source, path, what, value)
    return check


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value):
    return _is_number(value) and math.isfinite(value)


def _seconds(nullable=False):
    """A predicted time: a finite number of seconds, not negative (or null, where
    `nullable`)."""
    what = "a number of seconds" + (", or null" if nullable else "")

    def check(value, path, source):
        if nullable and value is None:
            return
        if not _is_number(value):
            raise _wrong_type(source, path, what, value)
        if not math.isfinite(value) or value < 0:
            raise _shape_error(source, path, "must be a finite number of seconds, not negative",
                               short_repr(value))
    return check


def _list_of(item, what, nullable=False):
    """A list (a string, whose letters would be read as names, is refused)."""
    what = f"{what}, or null" if nullable else what

    def check(value, path, source):
        if nullable and value is None:
            return
        if not isinstance(value, list):
            raise _wrong_type(source, path, what, value)
        for i, entry in enumerate(value):
            item(entry, f"{path}[{i}]", source)
    return check


def _dict_of(item, what):
    def check(value, path, source):
        if not isinstance(value, dict):
            raise _wrong_type(source, path, what, value)
        for key, entry in value.items():
            item(entry, f"{path}[{key!r}]", source)
    return check


def _object(fields, what, required=(), open_fields=False):
    """A JSON object with the given `{name: check}` fields (a check of None takes
    any value); names not in `fields` are refused unless `open_fields`."""
    def check(value, path, source):
        if not isinstance(value, dict):
            raise _wrong_type(source, path, what, value)
        unknown = [k for k in value if k not in fields]
        if unknown and not open_fields:
            raise _shape_error(
                source, path, f"unknown field {unknown[0]!r}; known fields: {', '.join(fields)}",
                f"an object with keys {sorted(value)}",
                fix="Remove it, or correct its name (a misspelt field is refused rather than "
                    "silently ignored).")
        missing = [k for k in required if k not in value]
        if missing:
            raise _shape_error(
                source, path, f"missing field {missing[0]!r} (required: {', '.join(required)})",
                f"an object with keys {sorted(value)}",
                fix="Add it, or write the plan again with Plan.to_json() or `autodist-keras "
                    "plan --out`.")
        for name, field_check in fields.items():
            if field_check is not None and name in value:
                field_check(value[name], f"{path}.{name}" if path else name, source)
    return check


_STRING = _kind("a string", lambda v: isinstance(v, str))
_OPT_STRING = _kind("a string", lambda v: isinstance(v, str), nullable=True)
_FINITE_OR_NULL = _kind("a finite number", _finite, nullable=True)
_BOOL_OR_NULL = _kind("true or false", lambda v: isinstance(v, bool), nullable=True)

# Integers are typed here; that they are positive (and add up) is `validate`'s.
_INTEGER = _kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))

_REPLICA = _object({"device": _STRING, "batch_share": _INTEGER},
                   "a replica: an object with device and batch_share",
                   required=("device", "batch_share"))
_GROUP = _object(
    # (layers: check_structure, which from_dict runs after building the plan)
    {"name": _STRING, "layers": None,
     "replicas": _list_of(_REPLICA, "a list of replicas (objects with device and batch_share)")},
    "a layer group: an object with name, layers and replicas",
    required=("name", "layers", "replicas"))
_SYNC_SPEC = _object({"method": _STRING, "algorithm": _OPT_STRING, "server": _OPT_STRING},
                     "a sync spec: an object with method, algorithm and server")
_ORDER_ENTRY = _kind("a [layer, phase] pair of strings", lambda v: isinstance(v, list) and len(
    v) == 2 and all(isinstance(x, str) for x in v))
# A candidate's figures (`Candidate.to_dict()`) or a planner's own; open: their fields
# vary by planner. Those explain() computes with are typed.
_BASELINE = _object({"predicted_step_time_s": _FINITE_OR_NULL, "step_time_s": _FINITE_OR_NULL,
                     "simulated_step_time_s": _FINITE_OR_NULL,
                     "planning_time_s": _FINITE_OR_NULL, "feasible": _BOOL_OR_NULL},
                    "an object of predicted figures", open_fields=True)
_PREDICTION = _object(
    {"step_time_s": _seconds(), "compute_s": _seconds(), "exposed_comm_s": _seconds(),
     "idle_s": _seconds(),
     "peak_memory_bytes": _dict_of(_kind("a finite number of bytes", _finite),
                                   "an object from device name to bytes"),
     "feasible": _kind("true or false", lambda v: isinstance(v, bool)),
     "infeasible_reason": _OPT_STRING,
     "per_device": _dict_of(_dict_of(_FINITE_OR_NULL, "an object of figures (numbers)"),
                            "an object from device name to its figures"),
     "baselines": _dict_of(_BASELINE, "an object from plan name to its figures"),
     "source": _STRING, "simulated_step_time_s": _seconds(nullable=True),
     "plan_digest": _OPT_STRING},
    "an object of predicted figures (or null)", required=("step_time_s",))
_PROVENANCE = _object(
    {"planner": _OPT_STRING,
     "options": _kind("an object", lambda v: isinstance(v, dict), nullable=True),
     "planning_time_s": _seconds(), "graph_fingerprint": _OPT_STRING,
     "cluster_fingerprint": _OPT_STRING,
     "layer_order": _list_of(_STRING, "a list of layer names", nullable=True),
     "backend": _OPT_STRING},
    "an object saying who made the plan (or null)", required=("planner",))
_PLAN = _object(
    {"global_batch_size": _INTEGER,
     "groups": _list_of(_GROUP, "a list of layer groups (objects with name, layers and "
                                "replicas)"),
     "sync": _dict_of(_SYNC_SPEC, "an object from variable name to its sync spec"),
     "buckets": _list_of(_list_of(_STRING, "a bucket: a list of variable names"),
                         "a list of buckets, each a list of variable names"),
     "order": _dict_of(_list_of(_ORDER_ENTRY, "a list of [layer, phase] pairs"),
                       "an object from device name to a list of [layer, phase] pairs"),
     "op_fusion": _list_of(_list_of(_STRING, "a region: a list of layer names"),
                           "a list of op-fusion regions, each a list of layer names"),
     "prediction": None, "provenance": None,  # (below: null, or {} for provenance, allowed)
     "notes": _list_of(_STRING, "a list of notes (strings)"),
     "schema_version": None},  # (checked first)
    "a plan", required=("global_batch_size", "groups", "sync"))


def _check_shape(data, source):
    """Checks a plan dict's JSON shape, field by field (see `Plan.from_dict`).

    Raises:
        PlanError: Naming the first field that is missing, unknown or of the
            wrong type, by its path (`groups[0].replicas[1].device`).
    """
    _PLAN(data, "", source)
    if data.get("prediction") is not None:
        _PREDICTION(data["prediction"], "prediction", source)
    if data.get("provenance") not in (None, {}):
        _PROVENANCE(data["provenance"], "provenance", source)


def _check_positive_int(value, field):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"{field} must be a positive integer. Received: {value!r}")


def _preview(names, limit=6):
    names = list(names)
    if len(names) <= limit:
        return str(names)
    return str(names[:limit])[:-1] + f", ... ({len(names)} in all)]"
