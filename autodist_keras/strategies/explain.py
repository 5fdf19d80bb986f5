"""explain(): what was chosen, why, and what the alternatives would cost.

Every predicted figure is labelled "predicted" and names its scorer (the
simulator, the learned estimator, or the simulator scaled by the learned
estimator's calibration); step times measured during `fit` appear beside
them as "measured".
"""

import io
import sys


# explain() adds a hint when the measured step exceeds the simulator's
# prediction by more than this factor.
MISS_FACTOR = 1.5


def _ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 3)


def _mib(nbytes):
    return None if nbytes is None else round(nbytes / 2**20, 1)


def _same_shapes(measured):
    """False when the fit's inputs had other per-sample shapes than those planned for."""
    shapes, planned = measured.get("input_shapes"), measured.get("planned_input_shapes")
    return shapes is None or planned is None or (
        [list(s) for s in shapes] == [list(s) for s in planned])


def explanation(plan, cluster, candidates=None, measured=None, strategy_name="auto",
                fixed=False):
    """Builds the machine-readable explanation of a plan.

    Args:
        plan: The `Plan` in force (with its `prediction`).
        cluster: The `Cluster`.
        candidates: Candidate dicts by name (default: `plan.prediction.baselines`).
            Entries without a `"family"` key are figures the chosen plan's
            planner recorded inside its own search (HeteroG's seeds and search
            result, Disco's fusion baselines): they go to `"planner_internal"`,
            not to `"candidates"`.
        measured: Dict of measured figures (e.g. `step_time_s`, `steps`).
        strategy_name: The strategy name the user asked for.
        fixed: Whether the plan was given with `plan=` (no planning ran).

    Returns:
        A JSON-ready dict. Its `from_cache` is True when the plan was read
        from the plan cache by this run's search (never for a plan given with
        `plan=`, whose file may carry the note of the run it was saved from).
    """
    from autodist_keras.strategies.plan import CACHE_NOTE_PREFIX

    prediction = plan.prediction
    if candidates is None:
        candidates = dict(prediction.baselines) if prediction is not None else {}
    internal = planner_internal(plan, candidates)
    candidates = {name: c for name, c in candidates.items() if _is_candidate(c)}
    device_rows = []
    layers_on = {}
    shares_on = {}
    for group in plan.groups:
        for replica in group.replicas:
            layers_on.setdefault(replica.device, 0)
            layers_on[replica.device] += len(group.layers)
            shares_on.setdefault(replica.device, []).append(replica.batch_share)
    for name in plan.devices:
        device = cluster.device(name)
        per = (prediction.per_device.get(name, {}) if prediction is not None else {})
        step = None
        if prediction is not None:
            # Busy time is the simulator's: divide by the simulator's step.
            step = getattr(prediction, "simulated_step_time_s", None) or prediction.step_time_s
        busy = per.get("busy_s")
        device_rows.append(
            {
                "device": name,
                "model": device.model,
                "batch_share": shares_on[name][0] if plan.is_data_parallel else None,
                "layers": layers_on[name],
                "predicted_busy_ms": _ms(busy),
                "predicted_utilisation": (round(busy / step, 3) if busy and step else None),
                "predicted_peak_memory_mib": _mib(per.get("peak_memory_bytes")),
                "memory_mib": _mib(device.memory_bytes),
            }
        )
    sync = {}
    one_device = len({r.device for g in plan.groups for r in g.replicas}) == 1
    for spec in ([] if one_device else plan.sync.values()):  # one device reduces nothing
        key = f"ps@{spec.server}" if spec.method == "ps" else f"allreduce/{spec.algorithm}"
        sync[key] = sync.get(key, 0) + 1
    even = candidates.get("data_parallel_even") or candidates.get("single_device")
    if even and even.get("feasible") is False:
        even = None  # a speedup over a plan that does not fit means nothing
    speedup = speedup_scorers = None
    if (prediction is not None and prediction.step_time_s and even
            and even.get("predicted_step_time_s")):
        speedup = round(even["predicted_step_time_s"] / prediction.step_time_s, 3)
        # A plan outside the learned estimator's domain is scored by the simulator
        # (rescaled) while the baseline may be scored by the estimator itself.
        speedup_scorers = {"plan": prediction.source, "even": even.get("scorer")}
    measured_vs_predicted = None
    # Steps of another batch size, or of inputs of other shapes where the model
    # leaves some unknown (a sequence length), are no measure of this prediction.
    same_batch = measured and measured.get("batch_size") in (None, plan.global_batch_size)
    same_batch = same_batch and _same_shapes(measured)
    if (same_batch and measured.get("step_time_s") and prediction is not None
            and prediction.step_time_s):
        measured_vs_predicted = round(measured["step_time_s"] / prediction.step_time_s, 3)
    chosen = plan.provenance.candidate
    # Options that shaped a forced strategy's plan (sync="ps", speeds, ...): the plan
    # is the candidate of its name with these options, and the candidates were built
    # without them.
    shaped = (plan.provenance.options or {}).get("shaped_by") or None
    same_as = (plan.provenance.options or {}).get("same_as") if shaped else None
    if same_as not in candidates:
        same_as = None
    candidates_note = None
    if shaped and candidates and same_as:
        candidates_note = (
            f"the baselines as a search builds them; this plan, {chosen} with "
            f"{options_label(shaped)}, is the {same_as} row (all are scored the same way)")
    elif shaped and candidates:
        candidates_note = (
            f"the baselines as a search builds them, without {options_label(shaped)} (the "
            f"{chosen} row is not this plan, which is {chosen} with those options; all "
            "are scored the same way)")
    why = [n[len("auto: "):] for n in plan.notes if n.startswith("auto: ")]
    if fixed:
        why = [f"the plan given with plan= (a {plan.provenance.planner or 'hand-made'} plan) "
               "runs as it is; no planning ran"
               + (f" and strategy={strategy_name!r} was not used"
                  if strategy_name != "auto" else "")]
        if prediction is not None:
            why.append(f"its predicted step time is from the {prediction.source}, as recorded "
                       "in the plan")
    elif not why:
        why = [f"{plan.provenance.planner} plan requested with strategy={strategy_name!r}"
               + (f" and {options_label(shaped)}" if shaped else "")]
        if prediction is not None:
            why.append(f"its predicted step time is from the {prediction.source}")
        why += [n[len("scored: "):] for n in plan.notes if n.startswith("scored: ")]
    notes = [n for n in plan.notes if not n.startswith(("auto: ", "scored: "))]
    if fixed:
        # No cache was read for a plan given with plan=; a note saying so came with the
        # file, from the run it was saved from.
        notes = [n for n in notes if not n.startswith(CACHE_NOTE_PREFIX)]
    from_cache = any(n.startswith(CACHE_NOTE_PREFIX) for n in notes)
    # (the row of a shaped plan's name is another plan: its "scored: " note says instead)
    entry = candidates.get(same_as) if shaped else candidates.get(chosen)
    scorer_why = entry.get("scorer_why") if isinstance(entry, dict) else None
    if scorer_why and not any(scorer_why in line for line in why):
        # (a search the learned estimator scored none of says why once, in its summary)
        why.append(f"the learned estimator did not score it: {scorer_why}")
    return {
        "strategy": strategy_name,
        "chosen": chosen,
        # The options that shaped the chosen plan (None: it is the candidate `chosen`).
        "chosen_options": dict(shaped) if shaped else None,
        # Set when the candidates are not the chosen plan's own search (see above).
        "candidates_note": candidates_note,
        "fixed_plan": bool(fixed),
        # Whether this run's search reused a cached plan (its note names the cache file).
        "from_cache": from_cache,
        "why": why,
        "notes": notes,
        "global_batch_size": plan.global_batch_size,
        "predicted": None if prediction is None else {
            "step_time_ms": _ms(prediction.step_time_s),
            "compute_ms": _ms(prediction.compute_s),
            "exposed_comm_ms": _ms(prediction.exposed_comm_s),
            "idle_ms": _ms(prediction.idle_s),
            "feasible": prediction.feasible,
            "infeasible_reason": prediction.infeasible_reason,
            "source": prediction.source,
            # The Keras backend the prediction is for (None in plan files before session 20).
            "backend": plan.provenance.backend,
            "simulated_step_time_ms": _ms(getattr(prediction, "simulated_step_time_s", None)),
            # compute / exposed comm / idle come from the simulator whatever `source` is.
            "breakdown_source": "simulator",
        },
        "measured": dict(measured or {}),
        "measured_vs_predicted": measured_vs_predicted,
        "speedup_vs_even_predicted": speedup,
        "speedup_vs_even_scorers": speedup_scorers,
        "devices": device_rows,
        # Where each layer runs: one entry per layer group, with its replicas.
        "data_parallel": plan.is_data_parallel,
        "groups": [
            {"name": group.name, "layers": list(group.layers),
             "replicas": [{"device": r.device, "batch_share": r.batch_share}
                          for r in group.replicas]}
            for group in plan.groups
        ],
        "sync": sync,
        "buckets": {
            "count": len(plan.buckets),
            "sizes": [len(b) for b in plan.buckets],
        },
        "op_fusion_regions": len(plan.op_fusion),
        "candidates": [
            {
                "name": name,
                "predicted_step_time_s": c.get("predicted_step_time_s", c.get("step_time_s")),
                "feasible": c.get("feasible"),
                # Figures a planner recorded from its own search are the simulator's.
                "scorer": c.get("scorer") or "simulator (in the planner's search)",
                "executable": c.get("executable"),
                "planning_time_s": c.get("planning_time_s"),
                "reason": c.get("reason"),
            }
            for name, c in candidates.items()
        ],
        "planner_internal": internal,
        "planning_time_s": round(plan.provenance.planning_time_s, 4),
    }


def options_label(options, width=60):
    """`{"sync": "ps", "ps_server": "node0/cpu1"}` -> `"sync='ps', ps_server='node0/cpu1'"`,
    each value's repr cut to `width` characters."""
    parts = []
    for name, value in options.items():
        text = repr(value)
        parts.append(f"{name}={text if len(text) <= width else text[:width - 3] + '...'}")
    return ", ".join(parts)


def _is_candidate(entry):
    """Whether a `prediction.baselines` entry is a candidate of the search
    (`Candidate.to_dict()`), not a figure from inside a planner's own search."""
    return isinstance(entry, dict) and "family" in entry


def _internal_role(planner, name):
    if planner == "heterog":
        if name == "heterog_search":
            return "HeteroG's search result, before comparing it with its seeds"
        return "HeteroG's internal search seed"
    if planner == "disco" and name.startswith("overlapped_bound"):
        return "Disco's fully-overlapped bound (a lower bound, not a plan)"
    if planner == "disco":
        return "Disco's fusion baseline"
    if planner == "fastt":
        return "FastT's comparison baseline"
    return f"{planner or 'the planner'}'s own figure"


def planner_internal(plan, figures=None):
    """Figures the chosen plan's planner recorded inside its own search.

    HeteroG records its seeds (e.g. `proportional_hierarchical`) and its
    search result (`heterog_search`), Disco its fusion baselines and bound.
    They are not candidates of the auto search: they are not counted in its
    "of N" and the auto search did not score them. Those with a candidate's
    name are the candidate's figures (`selection.record_candidates`).

    Args:
        plan: The `Plan` (with its `prediction`).
        figures: Dict by name (default: `plan.prediction.baselines`).

    Returns:
        A list of dicts: `name`, `predicted_step_time_s`, `feasible`,
        `recorded_by` (the planner), `role` and `scorer`.
    """
    if figures is None:
        figures = plan.prediction.baselines if plan.prediction is not None else {}
    planner = plan.provenance.planner
    return [
        {
            "name": name,
            "predicted_step_time_s": f.get("predicted_step_time_s", f.get("step_time_s")),
            "feasible": f.get("feasible"),
            "recorded_by": planner,
            "role": _internal_role(planner, name) + " (not a candidate)",
            "scorer": f"simulator (inside {planner}'s own search)",
        }
        for name, f in figures.items()
        if isinstance(f, dict) and not _is_candidate(f)
    ]


def render_text(data, use_rich=None):
    """Renders `explanation()` output as text: rich tables in a terminal, plain otherwise.

    Args:
        data: The dict from `explanation()`.
        use_rich: Force rich (True) or plain (False); default: rich when
            stdout is a terminal.

    Returns:
        A string.
    """
    if use_rich is None:
        use_rich = sys.stdout.isatty()
    if use_rich:
        return _render_rich(data)
    return _render_plain(data)


def _fmt(value, suffix=""):
    return "-" if value is None else f"{value}{suffix}"


def _header_lines(data):
    shaped = data.get("chosen_options")
    chosen = data["chosen"] + (f" with {options_label(shaped)}" if shaped else "")
    if data.get("fixed_plan"):
        lines = [f"AutoStrategy(plan=...): runs the given {chosen} plan"]
    else:
        lines = [f"AutoStrategy({data['strategy']!r}): chose {chosen}"]
    lines += [f"  why: {w}" for w in data["why"]]
    unattached = data.get("unattached_model")
    if unattached:
        lines.append(
            f"  note: model {unattached!r} was planned with plan_for but not compiled inside "
            "this strategy's scope, so its fit runs plain Keras, not this plan (compile it "
            "inside strategy.scope() to train with it)")
    p = data["predicted"]
    if p is not None and p.get("feasible") is False:
        lines.append(f"  INFEASIBLE (predicted): {p.get('infeasible_reason') or 'out of memory'}")
    for_backend = f", for the {p['backend']} backend" if p is not None and p.get("backend") else ""
    if p is not None and p.get("simulated_step_time_ms") is not None:
        lines.append(f"  predicted step time: {p['step_time_ms']} ms ({p['source']}{for_backend})")
        lines.append(
            f"  simulator's breakdown of its {p['simulated_step_time_ms']} ms step (predicted): "
            f"compute {p['compute_ms']} ms, exposed communication {p['exposed_comm_ms']} ms, "
            f"idle {p['idle_ms']} ms"
        )
    elif p is not None:
        lines.append(
            f"  predicted step time: {p['step_time_ms']} ms (compute {p['compute_ms']} ms, "
            f"exposed communication {p['exposed_comm_ms']} ms, idle {p['idle_ms']} ms; "
            f"{p['source']}{for_backend})"
        )
    m = data["measured"]
    if m.get("step_time_s") is not None:
        rows = m.get("batch_size")
        lines.append(
            f"  measured step time: {m['step_time_s'] * 1e3:.3f} ms "
            f"(median of {m.get('steps', '?')} steps after warm-up"
            + (f", batches of {rows} rows" if rows is not None else "") + ")"
        )
        if rows is not None and rows != data["global_batch_size"]:
            lines.append(
                f"  not compared with the prediction: the fit ran batches of {rows} rows, the "
                f"plan and its prediction are for {data['global_batch_size']} rows"
            )
        elif not _same_shapes(m):
            shapes, planned = ([tuple(s) for s in m[k]]
                               for k in ("input_shapes", "planned_input_shapes"))
            lines.append(
                f"  not compared with the prediction: the fit's inputs had per-sample shapes "
                f"{shapes}, the plan and its prediction are for {planned}"
            )
    if m.get("note"):
        lines.append(f"  about the measurement: {m['note']}")
    ratio = data.get("measured_vs_predicted")
    if ratio:
        off = (f"{(1 - 1 / ratio) * 100:.0f}% low" if ratio >= 1
               else f"{(1 / ratio - 1) * 100:.0f}% high")
        lines.append(f"  measured / predicted: {ratio}x (the prediction was {off})")
        source = (p or {}).get("source") or ""
        # Plain or rescaled simulator predictions (the learned estimator was
        # fitted to measured steps and misses for other reasons).
        if ratio > MISS_FACTOR and source.startswith("simulator"):
            lines.append(
                "  hint: the simulator prices each layer from the device's spec-sheet speed "
                "plus a fixed launch cost (on GPUs under PyTorch, plus host times measured on "
                "H200 hosts); the framework's host time per layer call and per step on this "
                "machine (Keras's Python, op dispatch) can be far larger, so small models and "
                "CPUs run slower than it predicts (docs/estimator.md)"
            )
    if data["speedup_vs_even_predicted"] is not None:
        scorers = data.get("speedup_vs_even_scorers") or {}
        mine, even = (short_scorer(scorers.get("plan") or ""),
                      short_scorer(scorers.get("even") or ""))
        mixed = (f" (scored differently, so compare with care: this plan by the {mine}, even "
                 f"data parallelism by the {even})" if scorers.get("even") and mine != even
                 else "")
        lines.append(f"  predicted speedup over even data parallelism: "
                     f"{data['speedup_vs_even_predicted']}x{mixed}")
    sync = ", ".join(f"{k} x{v}" for k, v in data["sync"].items()) or "none (one device)"
    lines.append(
        f"  sync: {sync}; "
        f"{data['buckets']['count']} gradient bucket(s); "
        f"{data['op_fusion_regions']} op-fusion region(s)"
    )
    lines += [f"  note: {n}" for n in data["notes"]]
    return lines


def _group_lines(data):
    """Where each layer runs, for a plan that is not plain data parallelism."""
    if data.get("data_parallel", True) or not data.get("groups"):
        return []
    lines = ["Layer groups (where each layer runs; split groups divide the batch):"]
    for group in data["groups"]:
        layers = group["layers"]
        named = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
        replicas = group["replicas"]
        where = (f"on {replicas[0]['device']}" if len(replicas) == 1 else
                 "split over " + ", ".join(f"{r['device']} ({r['batch_share']} rows)"
                                           for r in replicas))
        lines.append(f"  {group['name']}: {named} ({len(layers)} layer"
                     f"{'s' if len(layers) != 1 else ''}) {where}")
    return lines


def _internal_lines(data):
    """The planner's own search figures, apart from the candidates and labelled."""
    rows = data.get("planner_internal") or []
    if not rows:
        return []
    planner = rows[0]["recorded_by"] or "the planner"
    count = len(data["candidates"])
    lines = [f"Not candidates: figures {planner} recorded inside its own search (simulator, "
             f"predicted; not among the {count} candidate(s)"
             + (" above" if count else "") + "):"]
    for r in rows:
        step = _ms(r["predicted_step_time_s"])
        step = "no step time" if step is None else f"{step} ms"
        feasible = "" if r["feasible"] is None else f", feasible {r['feasible']}"
        lines.append(f"  {r['name']}: {step}{feasible}; {r['role']}")
    return lines


def _unused_candidate_lines(data):
    """Why each candidate that could not be chosen was left out (infeasible, not built)."""
    return [f"  {c['name']}: {c['reason']}" for c in data["candidates"]
            if c.get("reason") and (not c.get("feasible") or c.get("executable") is False)]


DEVICE_COLUMNS = [
    ("device", "device"), ("model", "model"), ("batch_share", "batch share"),
    ("layers", "layers"), ("predicted_busy_ms", "busy ms (pred.)"),
    ("predicted_utilisation", "util. (pred.)"),
    ("predicted_peak_memory_mib", "peak MiB (pred.)"), ("memory_mib", "memory MiB"),
]
CANDIDATE_COLUMNS = [
    ("name", "candidate"), ("predicted_step_time_s", "step ms (pred.)"),
    ("feasible", "feasible"), ("executable", "runs here"), ("planning_time_s", "planning s"),
    ("scorer", "scored by"),
]


def _cell(key, value):
    if key == "predicted_step_time_s":
        return _fmt(_ms(value))
    if key == "planning_time_s" and value is not None:
        return f"{value:.3f}"
    if key == "scorer" and value:
        return short_scorer(value)
    return _fmt(value)


def short_scorer(source):
    """`"learned estimator (gnn, torch; predicted)"` -> `"learned (gnn)"`, etc."""
    if source.startswith("learned estimator ("):
        return f"learned ({source[len('learned estimator ('):].split(',')[0]})"
    if source.startswith("simulator x"):
        return "simulator, rescaled"
    if source.startswith("simulator"):
        return "simulator"
    return source


def _plain_table(columns, rows):
    """Lines of a plain-text table, each column as wide as its widest cell or title."""
    cells = [[title for _, title in columns]]
    cells += [[_cell(key, row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return ["  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip()
            for line in cells]


def _render_plain(data):
    lines = _header_lines(data)
    lines.append("")
    lines += _plain_table(DEVICE_COLUMNS, data["devices"])
    groups = _group_lines(data)
    if groups:
        lines += [""] + groups
    if data["candidates"]:
        lines.append("")
        if data.get("candidates_note"):
            lines.append(f"Candidates: {data['candidates_note']}.")
        lines += _plain_table(CANDIDATE_COLUMNS, data["candidates"])
        left_out = _unused_candidate_lines(data)
        if left_out:
            lines += ["", "Candidates left out, and why:"] + left_out
    internal = _internal_lines(data)
    if internal:
        lines += [""] + internal
    return "\n".join(lines)


def _render_rich(data):
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Cells and titles are Text, not markup: a GPU named "RTX [lab]" in a YAML spec
    # (or "X[/]") was styled away, or stopped explain() with rich's MarkupError.
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    for line in _header_lines(data):
        console.print(line, highlight=False, markup=False)
    table = Table(title="Devices (predicted figures from the simulator)")
    for _, title in DEVICE_COLUMNS:
        table.add_column(title)
    for row in data["devices"]:
        table.add_row(*[Text(_cell(k, row[k])) for k, _ in DEVICE_COLUMNS])
    console.print(table)
    for line in _group_lines(data):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if data["candidates"]:
        title = "Candidates (predicted)"
        if data.get("candidates_note"):
            title += f": {data['candidates_note']}"
        table = Table(title=Text(title))
        for _, title in CANDIDATE_COLUMNS:
            table.add_column(title)
        for c in data["candidates"]:
            table.add_row(*[Text(_cell(k, c.get(k))) for k, _ in CANDIDATE_COLUMNS])
        console.print(table)
        left_out = _unused_candidate_lines(data)
        if left_out:
            console.print("Candidates left out, and why:", highlight=False, markup=False)
            for line in left_out:
                console.print(line, highlight=False, markup=False)
    for line in _internal_lines(data):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    return buffer.getvalue()
