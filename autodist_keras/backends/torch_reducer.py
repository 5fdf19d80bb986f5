"""Gradient reduction for the PyTorch runtime: planned buckets, launched during backward.

`GradientReducer` registers a `register_post_accumulate_grad_hook` on every
trainable parameter. When the last gradient of a bucket has been accumulated,
the bucket's gradients are copied into one flat buffer and its collective is
launched asynchronously, while backward goes on with earlier layers. Buckets
are launched strictly in the plan's order (a bucket that is ready early waits
for the ones before it), so every rank issues the same sequence of collectives
whatever the timing of its hooks. `finish()` launches what is left (variables
that got no gradient reduce zeros), waits, runs the second phase of PS and
hierarchical buckets, and returns the summed gradients.

Each bucket ends with one presence element per variable (1 where this rank
had a gradient, else 0), summed with the gradients: a variable that got no
gradient on any rank gets `None`, as in Keras's own step, so the optimizer
leaves it alone (no weight decay, no momentum), instead of a zero gradient.

Sync methods (from `plan.sync`, per variable; a planned bucket mixing methods
is split, in order, into runs of one method):

- `allreduce` with `ring` or `tree`: one `all_reduce` (SUM) of the bucket. The
  algorithm inside is the backend's own (gloo's ring-based allreduce on CPU,
  NCCL's ring/tree choice on GPU): the plan's algorithm is not forced.
- `allreduce` with `hierarchical`: when the replicas span several nodes, a
  reduce to the first rank of each node, an all-reduce among those leaders and
  a broadcast inside each node; on one node it is a plain all-reduce.
- `ps` with a server device: a reduce to the server's rank, then a broadcast
  of the sum from it. Every rank then applies the same sum with its own
  optimizer, which equals the server applying it and sending the weights.

With a shared `ReduceArea` (`use_shared_memory`; spawned CPU workers on rank
0's machine), the sums go through shared memory instead of gloo's sockets: an
all-reduce bucket is summed slice by slice, each rank its own slice, and a PS
bucket by its server alone; gloo carries only two one-element barriers per
bucket (`torch_shm_reduce`).

`StateSync` keeps non-trainable float variables (BatchNormalization moving
statistics) identical on all ranks: each rank contributes its update
`(new - old) * share / global_batch`, all-reduced, and every rank sets
`old + sum`. For a moving mean that is exactly the update the global batch's
mean would give; variables nobody changed stay bit-identical. Integer
variables declared `aggregation="sum"` (a count of rows) contribute their
whole change, so they advance by the whole batch's
(`loss_trackers.sums_replica_changes`).

Example:

```python
reducer = GradientReducer(comm, model.trainable_weights, plan, rank_nodes)
reducer.attach()
reducer.start_step()
loss.backward()
grads = reducer.finish()
```
"""

from autodist_keras.backends import batchnorm_stats
from autodist_keras.backends import loss_trackers
from autodist_keras.backends import torch_shm_reduce
from autodist_keras.backends.torch_transport import CommFailure
from autodist_keras.errors import BackendError


class _Bucket:
    def __init__(self, indices, kind, root=None, algorithm=None):
        self.indices = list(indices)
        self.kind = kind  # "allreduce", "hierarchical" or "ps"
        self.root = root
        self.algorithm = algorithm
        self.buffer = None
        self.offsets = []
        self.presence = 0  # offset of the per-variable presence elements
        self.work = None
        self.pending = 0
        # Shared-memory sums (`GradientReducer.use_shared_memory`).
        self.inputs = None  # every rank's input region
        self.output = None  # the sum
        self.flags = None  # one-element tensors of the two barriers

    @property
    def numel(self):
        return self.presence + len(self.indices)


class GradientReducer:
    """Sums gradients over ranks bucket by bucket, overlapping backward.

    Args:
        comm: The rank's `Comm`.
        variables: The model's trainable Keras variables (`model.trainable_weights`).
        plan: The data-parallel `Plan` (its `buckets` and `sync`).
        rank_nodes: The node name of each rank (for hierarchical all-reduce).
        device_ranks: Dict from device name to rank (for PS servers).
        paths: Optional plan names of `variables`, in order (default: their paths).
    """

    def __init__(self, comm, variables, plan, rank_nodes, device_ranks, paths=None):
        self.comm = comm
        self.variables = list(variables)
        self.params = [v.value for v in self.variables]
        if paths is not None and len(paths) != len(self.variables):
            raise BackendError(
                f"This replica has {len(self.variables)} trainable variables but rank 0's "
                f"model has {len(paths)}; every rank must build the same model. "
                f"Received: {[v.path for v in self.variables][:6]} vs {list(paths)[:6]}"
            )
        paths = list(paths) if paths is not None else [v.path for v in self.variables]
        index = {}
        for i, path in enumerate(paths):
            if path in index:
                raise BackendError(
                    "Two trainable variables of the model share the path "
                    f"{path!r}, so the plan cannot name them apart. Give the layers "
                    f"unique names. Received: {path!r}"
                )
            index[path] = i
        planned = [name for bucket in plan.buckets for name in bucket]
        missing = [p for p in paths if p not in set(planned)]
        unknown = [p for p in planned if p not in index]
        if missing or unknown or len(planned) != len(paths):
            raise BackendError(
                "The plan's gradient buckets do not match the model's trainable "
                "variables (did layers change `trainable` after the plan was made?). "
                "Compile the model again inside strategy.scope() or leave plan= out, so "
                "that it is planned for its current trainable variables. "
                f"Received: not in any bucket {missing[:5]}, unknown {unknown[:5]}"
            )
        self.rank_nodes = list(rank_nodes)
        self.device_ranks = dict(device_ranks)
        self.buckets = []
        for bucket in plan.buckets:
            run, key = [], None
            for name in bucket:
                i = index[name]
                k = self._sync_key(plan.sync[name], name) + (str(self.params[i].dtype),)
                if run and k != key:
                    self.buckets.append(self._make_bucket(run, key))
                    run = []
                run.append(i)
                key = k
            if run:
                self.buckets.append(self._make_bucket(run, key))
        self.bucket_of = {}
        for b, bucket in enumerate(self.buckets):
            offset = 0
            for i in bucket.indices:
                self.bucket_of[i] = b
                n = self.params[i].numel()
                bucket.offsets.append((offset, n))
                offset += n
            bucket.presence = offset
        self.area = None  # a `torch_shm_reduce.ReduceArea` once `use_shared_memory` ran
        self._handles = []
        self._next = 0
        self.error = None
        self.launched_during_backward = 0  # buckets launched from hooks in the last step
        self._missing = False  # some variable got no gradient on this rank this step
        self._hier = self._hierarchy()

    # ------------------------------------------------------------ plan
    def _sync_key(self, spec, name):
        if spec.method == "ps":
            if spec.server not in self.device_ranks:
                raise BackendError(
                    f"Variable {name!r} is synchronised by a parameter server on "
                    f"{spec.server!r}, which runs no replica. The PyTorch runtime runs a PS "
                    "server inside one of the replicas' processes: choose a server among "
                    f"{sorted(self.device_ranks)}. Received: server={spec.server!r}"
                )
            return ("ps", self.device_ranks[spec.server], None)
        algorithm = spec.algorithm or "ring"
        if algorithm == "hierarchical" and len(set(self.rank_nodes)) > 1:
            return ("hierarchical", None, algorithm)
        return ("allreduce", None, algorithm)

    def _make_bucket(self, indices, key):
        return _Bucket(indices, key[0], root=key[1], algorithm=key[2])

    def _hierarchy(self):
        nodes = {}
        for r, node in enumerate(self.rank_nodes):
            nodes.setdefault(node, []).append(r)
        leaders = [ranks[0] for ranks in nodes.values()]
        mine = nodes.get(self.rank_nodes[self.comm.rank], [self.comm.rank])
        return {"node_ranks": mine, "leaders": leaders}

    @property
    def num_buckets(self):
        return len(self.buckets)

    def shared_layout(self):
        """`[(numel, dtype name), ...]` of the buckets (what a `ReduceArea` holds)."""
        return [(b.numel, str(self.params[b.indices[0]].dtype)) for b in self.buckets]

    def use_shared_memory(self, area):
        """Sums the buckets through `area` (a `ReduceArea` every rank mapped)
        from the next step on, instead of through the process group. The area
        must hold these buckets: rank 0 makes it from its `shared_layout()`,
        and a worker maps it with `ReduceArea.open(..., buckets=shared_layout())`,
        which checks that.

        Raises:
            BackendError: If the area is for another number of ranks.
        """
        import torch

        if area.world != self.comm.world_size:
            raise BackendError(
                f"The shared reduce area is for {area.world} ranks but {self.comm.world_size} "
                f"run. Received: world={area.world}"
            )
        for b, bucket in enumerate(self.buckets):
            bucket.inputs = area.inputs(b)
            bucket.output = area.output(b)
            bucket.flags = (torch.zeros(1), torch.zeros(1))
            if bucket.buffer is None:
                bucket.buffer = torch.empty_like(bucket.output)
        self.area = area

    def release_shared_memory(self):
        """Drops the buckets' views of the shared area and closes it, once the
        session is over: the deleted file keeps taking `/dev/shm` space while
        mapped, and a strategy left to the garbage collector (one per trial of
        a hyper-parameter search) held 8.4 MiB per fit for a 535k-parameter MLP."""
        if self.area is None:
            return
        for bucket in self.buckets:
            bucket.inputs = bucket.output = bucket.flags = None
        self.area.close()

    # ------------------------------------------------------------ hooks
    def attach(self):
        """Registers the gradient hooks on the parameters."""
        self.detach()
        for i, param in enumerate(self.params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook(i)))

    def detach(self):
        """Removes the hooks (the model trains as usual again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, i):
        def hook(param):
            bucket = self.buckets[self.bucket_of[i]]
            bucket.pending -= 1
            if bucket.pending == 0:
                self.launched_during_backward += self._launch_ready()

        return hook

    # ------------------------------------------------------------- step
    def start_step(self):
        """Resets per-step state; call before backward."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.indices)
            bucket.work = None
        self._next = 0
        self.error = None
        self.launched_during_backward = 0
        self._missing = False

    def _launch_ready(self):
        launched = 0
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._launch(self.buckets[self._next])
            self._next += 1
            launched += 1
        return launched

    def _fill(self, bucket):
        import torch

        if bucket.buffer is None:
            first = self.params[bucket.indices[0]]
            bucket.buffer = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        # With shared memory, this rank's input region is the flat bucket.
        target = bucket.buffer if bucket.inputs is None else bucket.inputs[self.comm.rank]
        present = []
        with torch.no_grad():
            for i, (offset, n) in zip(bucket.indices, bucket.offsets):
                grad = self.params[i].grad
                view = target[offset:offset + n]
                if grad is None:
                    view.zero_()
                    present.append(0.0)
                else:
                    view.copy_(grad.reshape(-1))
                    present.append(1.0)
            if 0.0 in present:
                self._missing = True
            target[bucket.presence:].copy_(torch.tensor(present, dtype=target.dtype))

    def _launch(self, bucket):
        import torch.distributed as dist

        if self.error is not None:
            return
        try:
            self._fill(bucket)
            pg = self.comm.grad_pg
            if bucket.inputs is not None:  # arrival barrier; the sum follows in `finish`
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.SUM
                bucket.work = pg.allreduce([bucket.flags[0]], opts)
            elif bucket.kind == "ps":
                opts = dist.ReduceOptions()
                opts.rootRank = bucket.root
                opts.reduceOp = dist.ReduceOp.SUM
                bucket.work = pg.reduce([bucket.buffer], opts)
            elif bucket.kind == "hierarchical":
                node_ranks = self._hier["node_ranks"]
                if len(node_ranks) > 1:
                    opts = dist.ReduceOptions()
                    opts.rootRank = 0
                    opts.reduceOp = dist.ReduceOp.SUM
                    bucket.work = self.comm.subgroup(node_ranks).reduce([bucket.buffer], opts)
            else:
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.SUM
                bucket.work = pg.allreduce([bucket.buffer], opts)
        except RuntimeError as e:  # a peer is gone: report it after backward
            self.comm.broken = True
            self.error = CommFailure(str(e))

    def launch_rest(self):
        """Launches every bucket backward has not launched (variables that got
        no gradient reduce zeros). `finish` does it too; calling it first lets a
        rank do other work while every collective is in flight."""
        for bucket in self.buckets[self._next:]:
            bucket.pending = 0
        self._launch_ready()

    def finish(self):
        """Launches remaining buckets, waits for all, returns the summed gradients.

        Returns:
            A list of tensors, one per trainable variable (views into the
            bucket buffers, valid until the next step).

        Raises:
            CommFailure: If a collective failed.
        """
        import torch.distributed as dist

        self.launch_rest()
        if self.error is not None:
            raise self.error
        if self.area is not None:
            return self._finish_shared()
        second = []
        for bucket in self.buckets:
            if bucket.work is not None:
                self.comm.wait(bucket.work)
                bucket.work = None
            if bucket.kind == "ps":
                opts = dist.BroadcastOptions()
                opts.rootRank = bucket.root
                second.append(self.comm.call(self.comm.grad_pg.broadcast, [bucket.buffer], opts))
            elif bucket.kind == "hierarchical":
                second.append(("hier", bucket))
        for item in second:
            if isinstance(item, tuple):
                self._hierarchical_rest(item[1])
            else:
                self.comm.wait(item)
        return self._grads()

    def _grads(self):
        grads = [None] * len(self.params)
        for bucket in self.buckets:
            # Every variable had a gradient here, so the sums are all positive:
            # read them (a device sync on GPUs) only when some gradient was missing.
            present = bucket.buffer[bucket.presence:].tolist() if self._missing else None
            for j, (i, (offset, n)) in enumerate(zip(bucket.indices, bucket.offsets)):
                if present is not None and present[j] == 0:
                    continue  # no rank had a gradient: None, as Keras's own step gives
                grads[i] = bucket.buffer[offset:offset + n].view(self.params[i].shape)
        return grads

    def _finish_shared(self):
        """`finish` through the shared area: arrival, sum, done, copy out."""
        import torch
        import torch.distributed as dist

        rank, world = self.comm.rank, self.comm.world_size
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        done = []
        with torch.no_grad():
            for bucket in self.buckets:
                self.comm.wait(bucket.work)  # every rank's input is written
                bucket.work = None
                if bucket.kind == "ps":
                    if rank == bucket.root:
                        torch_shm_reduce.sum_into(bucket.output, bucket.inputs, 0, bucket.numel)
                else:
                    start, stop = torch_shm_reduce.slice_bounds(bucket.numel, world, rank)
                    torch_shm_reduce.sum_into(bucket.output, bucket.inputs, start, stop)
                done.append(self.comm.call(self.comm.grad_pg.allreduce, [bucket.flags[1]], opts))
            for bucket, work in zip(self.buckets, done):
                self.comm.wait(work)  # every slice of the sum is written
                # A private copy: the optimizer may read it while another rank
                # already writes the next step's sum.
                bucket.buffer.copy_(bucket.output)
        return self._grads()

    def _hierarchical_rest(self, bucket):
        import torch.distributed as dist

        node_ranks = self._hier["node_ranks"]
        leaders = self._hier["leaders"]
        if self.comm.rank in leaders and len(leaders) > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg = self.comm.subgroup(leaders)
            self.comm.wait(self.comm.call(pg.allreduce, [bucket.buffer], opts))
        if len(node_ranks) > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg = self.comm.subgroup(node_ranks)
            self.comm.wait(self.comm.call(pg.broadcast, [bucket.buffer], opts))


class StateSync:
    """Keeps non-trainable float variables (e.g. BN moving statistics) equal on all ranks.

    Integer variables declared `aggregation="sum"` join them unweighted: every
    rank sets `old + sum_r (new_r - old)` (a count of rows advances by the
    whole batch); other integer variables are left to each rank.

    Args:
        comm: The rank's `Comm`.
        variables: The model's non-trainable Keras variables.
        moving_pairs: `batchnorm_stats.moving_pairs(model)`: for each, the
            same all-reduce also sums `w d^2` of the moving mean's change `d`,
            and the moving variance gets `batchnorm_stats.variance_correction`,
            so it follows the global batch's variance.
    """

    def __init__(self, comm, variables, moving_pairs=()):
        self.comm = comm
        self.variables = [v for v in variables if "float" in str(v.dtype)
                          or loss_trackers.sums_replica_changes(v)]
        # Positions of the summed integer variables: their change is not weighted.
        self.summed = {i for i, v in enumerate(self.variables) if "float" not in str(v.dtype)}
        index = {id(v): i for i, v in enumerate(self.variables)}
        self.pairs = [(index[id(m)], index[id(v)], momentum) for m, v, momentum in moving_pairs
                      if id(m) in index and id(v) in index]
        self._old = None
        self._buffer = None
        self._work = None

    def snapshot(self):
        """Records the values before the step."""
        if not self.variables:
            return
        self._old = [v.value.detach().clone() for v in self.variables]

    def launch(self, weight):
        """All-reduces this rank's weighted updates; call once the forward pass is done."""
        import torch
        import torch.distributed as dist

        if not self.variables:
            return
        with torch.no_grad():
            changes = [(v.value.detach() - old).reshape(-1).to(torch.float64)
                       for v, old in zip(self.variables, self._old)]
            deltas = [change if i in self.summed else change * weight
                      for i, change in enumerate(changes)]
            deltas += [changes[mean] * changes[mean] * weight for mean, _, _ in self.pairs]
            self._buffer = torch.cat(deltas)
        if self.comm.grad_backend == "nccl":
            self._buffer = self._buffer.to(self._old[0].device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._work = self.comm.call(self.comm.grad_pg.allreduce, [self._buffer], opts)

    def finish(self):
        """Waits and sets every variable to `old + summed update`."""
        import torch

        if not self.variables:
            return
        self.comm.wait(self._work)
        offset = 0
        summed = []
        for old in self._old:
            summed.append(self._buffer[offset:offset + old.numel()])
            offset += old.numel()
        for mean, variance, momentum in self.pairs:
            squares = self._buffer[offset:offset + self._old[mean].numel()]
            offset += self._old[mean].numel()
            summed[variance] = summed[variance] + batchnorm_stats.variance_correction(
                summed[mean], squares, momentum)
        with torch.no_grad():
            for i, (v, old, delta) in enumerate(zip(self.variables, self._old, summed)):
                delta = delta.reshape(old.shape)
                if i in self.summed:
                    delta = torch.round(delta)
                if torch.any(delta != 0):
                    v.assign((old.to(torch.float64) + delta).to(old.dtype))
                else:
                    v.assign(old)
        self._old = None
