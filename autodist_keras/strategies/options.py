"""Checks `AutoStrategy`'s options when the strategy is made, not at the first step.

Two kinds of mistake are caught here, before any model is built:

- a value that cannot work (`sync="foo"`, `bucket_bytes=-5`, a `ps_server` or
  `speeds` key that is not a device of the cluster, `timeout_s=0`);
- an option that the chosen strategy would not use. The options that fix a
  plan's shape (`sync`, `ps_server`, `speeds`, `buckets`, ...) shape the
  data-parallel baselines; the FastT, HeteroG and Disco planners choose those
  things themselves, and `auto` compares plans of every shape. `op_fusion`
  and `op_fusion_compiler` compile a plan's op-fusion regions, which only
  Disco's plans (and so `auto`'s, and a plan given with `plan=`) have;
  `estimator` scores the candidates of a search, and `plan=` runs no search.
  Options that contradict each other (`speeds` with `step_costs`, which both
  set the proportional shares; `algorithm` with `sync="ps"`, which runs no
  all-reduce) are refused too. Silently dropping such an option would train
  with something other than what the user asked for, so it is an error that
  says which strategies take it.

Example:

```python
check_options("proportional", {"sync": "ps", "ps_server": "node0/cpu1"}, cluster)
check_options("fastt", {"sync": "ps"}, cluster)  # raises StrategyError
```
"""

import math
import numbers

from autodist_keras.errors import StrategyError
from autodist_keras.strategies.plan import ALLREDUCE_ALGORITHMS

# The options that shape a plan, and the strategies that use each.
PLAN_OPTIONS_FOR = {
    "auto": ("algorithm", "bucket_bytes", "step_costs"),
    "single_device": (),
    "data_parallel": ("sync", "ps_server", "algorithm", "bucket_bytes", "buckets"),
    "proportional": ("sync", "ps_server", "algorithm", "bucket_bytes", "buckets", "speeds",
                     "step_costs"),
    "fastt": (),
    "heterog": (),
    "disco": (),
}
PLAN_OPTIONS = ("sync", "ps_server", "algorithm", "bucket_bytes", "buckets", "speeds",
                "step_costs")

_WHY_NOT = {
    "auto": "auto compares plans of every family and shape, and these options would fix "
            "one shape (auto passes only algorithm, bucket_bytes and step_costs to its "
            "data-parallel baselines)",
    "single_device": "a single-device plan has no gradient synchronisation or batch shares",
    "data_parallel": "even shares do not use device speeds or measured step costs",
    "proportional": "",
    "fastt": "the FastT planner chooses placement, order and synchronisation itself",
    "heterog": "the HeteroG planner chooses batch shares and synchronisation itself",
    "disco": "the Disco planner chooses gradient buckets and synchronisation itself",
}


# The runtime options that only some strategies use: the op-fusion options compile
# a plan's op-fusion regions, which only the Disco planner makes (auto may choose a
# Disco plan; a plan given with plan= may have regions, so plan= takes them too).
RUNTIME_OPTIONS_FOR = {
    "op_fusion": ("auto", "disco"),
    "op_fusion_compiler": ("auto", "disco"),
}
_WHY_NOT_RUNTIME = {
    "op_fusion": "its plans have no op-fusion regions to compile (only the Disco planner "
                 "makes them)",
    "op_fusion_compiler": "its plans have no op-fusion regions to compile (only the Disco "
                          "planner makes them)",
}


# The shortest `timeout_s` accepted: a rank waits this long for the others at start-up
# and in every collective of a step.
MIN_TIMEOUT_S = 1.0


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _users_of(option):
    return [name for name, allowed in PLAN_OPTIONS_FOR.items() if option in allowed]


def check_options(strategy, options, cluster, fixed_plan=False):
    """Raises `StrategyError` for option values that cannot work or are not used.

    Args:
        strategy: The strategy name (one of `PLAN_OPTIONS_FOR`).
        options: The options given to `AutoStrategy` (names already checked).
        cluster: The resolved `Cluster`.
        fixed_plan: True when `plan=` gives the plan: then no option may
            shape one.

    Raises:
        StrategyError: Naming the option, what is wrong and how to fix it.
    """
    if fixed_plan:
        fixed = [k for k in PLAN_OPTIONS if k in options]
        if fixed:
            raise StrategyError(
                f"Option(s) {fixed} shape a plan, but plan= gives the plan to run as it is. "
                "Leave them out, or drop plan= to have the strategy build one. "
                f"Received: {', '.join(f'{k}={options[k]!r}' for k in fixed)}"
            )
        if "estimator" in options:
            raise StrategyError(
                "estimator scores the candidate plans of a search, but plan= gives the plan "
                "to run as it is: no search runs, and its prediction is the one recorded in "
                "the plan (or the simulator's). Leave estimator out, or drop plan= to have "
                f"the strategy plan. Received: estimator={options['estimator']!r}"
            )
    else:
        # (op_fusion="off" asks for what these strategies do anyway: a script may set it
        # for every strategy it tries)
        idle = [k for k, users in RUNTIME_OPTIONS_FOR.items()
                if k in options and strategy not in users
                and not (k == "op_fusion" and options[k] == "off")]
        if idle:
            why = "; ".join(dict.fromkeys(_WHY_NOT_RUNTIME[k] for k in idle))
            takers = sorted({s for k in idle for s in RUNTIME_OPTIONS_FOR[k]})
            given = ", ".join(f"{k}={options[k]!r}" for k in idle)
            raise StrategyError(
                f"Option(s) {idle} would be ignored by strategy={strategy!r}: {why}. They "
                f"are used by strategy {' or '.join(repr(s) for s in takers)} (and with "
                "plan= when the plan has op-fusion regions); use one of those, or leave the "
                f"option(s) out. Received: strategy={strategy!r}, {given}"
            )
    unused = [k for k in PLAN_OPTIONS if k in options and k not in PLAN_OPTIONS_FOR[strategy]]
    if unused and not fixed_plan:
        takers = sorted({s for k in unused for s in _users_of(k)})
        given = ", ".join(f"{k}={options[k]!r}" for k in unused)
        raise StrategyError(
            f"Option(s) {unused} would be ignored by strategy={strategy!r}: "
            f"{_WHY_NOT[strategy]}. They are used by strategy "
            f"{' or '.join(repr(s) for s in takers)}; use one of those, or leave the "
            f"option(s) out. Received: strategy={strategy!r}, {given}"
        )
    if "sync" in options and options["sync"] not in ("allreduce", "ps"):
        raise StrategyError(
            "sync must be 'allreduce' or 'ps' (parameter server). "
            f"Received: sync={options['sync']!r}"
        )
    if "ps_server" in options:
        if options.get("sync") != "ps":
            raise StrategyError(
                "ps_server names the parameter server, so it needs sync='ps'. "
                f"Received: ps_server={options['ps_server']!r}, sync={options.get('sync')!r}"
            )
        if options["ps_server"] not in cluster.names:
            raise StrategyError(
                f"ps_server must be a device of the cluster ({cluster.names}). "
                f"Received: ps_server={options['ps_server']!r}"
            )
    if "algorithm" in options and options["algorithm"] not in ALLREDUCE_ALGORITHMS:
        raise StrategyError(
            f"algorithm must be one of {ALLREDUCE_ALGORITHMS}. "
            f"Received: algorithm={options['algorithm']!r}"
        )
    if "algorithm" in options and options.get("sync") == "ps":
        raise StrategyError(
            "algorithm names an all-reduce algorithm, but sync='ps' synchronises the "
            "gradients through a parameter server, with no all-reduce: the algorithm would "
            "be ignored. Leave algorithm out, or use sync='allreduce'. "
            f"Received: algorithm={options['algorithm']!r}, sync='ps'"
        )
    if "bucket_bytes" in options and not (
            _is_number(options["bucket_bytes"]) and options["bucket_bytes"] >= 0):
        raise StrategyError(
            "bucket_bytes must be a number of bytes >= 0 (0: one bucket per gradient; "
            f"the default is 25 MiB). Received: bucket_bytes={options['bucket_bytes']!r}"
        )
    if "buckets" in options:
        buckets = options["buckets"]
        if not isinstance(buckets, (list, tuple)) or not all(
                isinstance(b, (list, tuple)) and all(isinstance(v, str) for v in b)
                for b in buckets):
            raise StrategyError(
                "buckets must be a list of lists of variable names (their paths, e.g. "
                f"'dense/kernel'). Received: buckets={buckets!r}"
            )
    if "speeds" in options:
        speeds = options["speeds"]
        bad = (not isinstance(speeds, dict) or any(
            not (_is_number(v) and v > 0) for v in speeds.values()))
        if bad:
            raise StrategyError(
                "speeds must be a dict {device name: positive relative speed}. "
                f"Received: speeds={speeds!r}"
            )
        unknown = [d for d in speeds if d not in cluster.names]
        if unknown:
            raise StrategyError(
                f"speeds names devices that are not in the cluster ({cluster.names}). "
                f"Received: {unknown}"
            )
    if "step_costs" in options:
        # (already read and checked by share_balance: a dict by device name)
        unknown = [d for d in options["step_costs"] if d not in cluster.names]
        if unknown:
            raise StrategyError(
                f"step_costs names devices that are not in the cluster ({cluster.names}); "
                "measure the costs on this cluster's devices, or pass the cluster they were "
                f"measured on. Received: {unknown}"
            )
        if "speeds" in options:
            raise StrategyError(
                "speeds and step_costs are alternatives: both set the proportional shares "
                "(step_costs, measured per-replica costs, replace the speeds), so one of "
                "them would be ignored. Pass one of them. "
                f"Received: speeds={options['speeds']!r}, step_costs={options['step_costs']!r}"
            )
    if "timeout_s" in options and not (
            _is_number(options["timeout_s"]) and options["timeout_s"] >= MIN_TIMEOUT_S):
        raise StrategyError(
            f"timeout_s must be a number of seconds, at least {MIN_TIMEOUT_S:g}: it bounds "
            "each wait of a rank for the others (start-up, every step's collectives), so a "
            "shorter one fails on the first slow step with a communication error that "
            "looks like a crashed worker (0.01 s did on PyTorch). The default is 300. "
            f"Received: timeout_s={options['timeout_s']!r}"
        )
