"""Communication cost models: alpha-beta links and collective algorithms.

Every link is an alpha-beta link: sending `S` bytes from device `a` to device
`b` takes `alpha + S / beta` seconds, where `alpha` is the link latency
(`Topology.latency(a, b)`) and `beta` its bandwidth in bytes per second
(`Topology.bandwidth(a, b)`).

Closed forms (`S` bytes reduced over `n` members, `B` the slowest link's
bandwidth, `alpha` the largest link latency among the links used):

- Ring all-reduce (reduce-scatter then all-gather, `n - 1` steps each):
  `2 (n - 1) / n * S / B + 2 (n - 1) * alpha`.
- Tree all-reduce (reduce up a binary tree, broadcast down, whole buffer per
  step, no pipelining): `2 * ceil(log2 n) * (alpha + S / B)`.
- Hierarchical all-reduce (Horovod / NCCL style): reduce inside each node
  (ring reduce-scatter over the node's devices:
  `(k - 1) / k * S / B_intra + (k - 1) * alpha_intra` for the largest node of
  `k` devices), ring all-reduce among the `m` node leaders over the NICs
  (`2 (m - 1) / m * S / B_nic + 2 (m - 1) * alpha_nic`), then broadcast inside
  each node (same cost as the reduce).
- Parameter server: `n` clients each push `S` bytes to the server and pull
  `S` bytes back. Every push goes through the server's link, so they are
  serialised there: `n * (alpha + S / B)` to push, the same to pull. The
  simulator does not use this closed form; it moves each push and pull as its
  own transfer on the server's link queue, so contention comes out of the
  simulation. `ps_time` is the closed form the tests compare against.

Example:

```python
t = ring_allreduce_time(100 * 2**20, n=8, bandwidth=12e9, latency=5e-6)
model = CommModel(cluster.topology)
t = model.allreduce_time(100 * 2**20, cluster.names, "ring")
```
"""

import math

from autodist_keras.errors import EstimatorError

ALGORITHMS = ("ring", "tree", "hierarchical")


def _check_bytes(nbytes):
    if nbytes < 0 or math.isnan(nbytes):
        raise EstimatorError(
            f"A message size must be a non-negative number of bytes. Received: {nbytes!r}"
        )


def _check_link(bandwidth, latency, where="link"):
    if not bandwidth or bandwidth <= 0 or math.isnan(bandwidth):
        raise EstimatorError(
            f"The {where} bandwidth must be a positive number of bytes per second; fix "
            f"the cluster's topology. Received: bandwidth={bandwidth!r}"
        )
    if latency is None or latency < 0 or math.isnan(latency):
        raise EstimatorError(
            f"The {where} latency must be a non-negative number of seconds; fix the "
            f"cluster's topology. Received: latency={latency!r}"
        )


def p2p_time(nbytes, bandwidth, latency):
    """Time to send `nbytes` over one alpha-beta link.

    Args:
        nbytes: Message size in bytes.
        bandwidth: Link bandwidth in bytes per second.
        latency: Link latency in seconds.

    Returns:
        Seconds; 0 for an empty message.

    Example:

    >>> p2p_time(1e9, bandwidth=1e9, latency=1e-5)
    1.00001
    """
    _check_bytes(nbytes)
    if nbytes == 0:
        return 0.0
    _check_link(bandwidth, latency)
    return latency + nbytes / bandwidth


def ring_allreduce_time(nbytes, n, bandwidth, latency):
    """Ring all-reduce: `2 (n-1)/n * S / B + 2 (n-1) * alpha`.

    Args:
        nbytes: Buffer size `S` in bytes (the same on every member).
        n: Number of members.
        bandwidth: Bandwidth `B` of the slowest ring link, bytes per second.
        latency: Latency `alpha` of the slowest ring link, seconds.

    Returns:
        Seconds; 0 when `n <= 1` or the buffer is empty.
    """
    _check_bytes(nbytes)
    if n <= 1 or nbytes == 0:
        return 0.0
    _check_link(bandwidth, latency)
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def tree_allreduce_time(nbytes, n, bandwidth, latency):
    """Binary-tree all-reduce: `2 ceil(log2 n)` steps of `alpha + S / B`.

    Args:
        nbytes: Buffer size `S` in bytes.
        n: Number of members.
        bandwidth: Bandwidth `B` of the slowest tree link, bytes per second.
        latency: Latency `alpha` of the slowest tree link, seconds.

    Returns:
        Seconds; 0 when `n <= 1` or the buffer is empty.
    """
    _check_bytes(nbytes)
    if n <= 1 or nbytes == 0:
        return 0.0
    _check_link(bandwidth, latency)
    steps = 2 * math.ceil(math.log2(n))
    return steps * (latency + nbytes / bandwidth)


def hierarchical_allreduce_time(
    nbytes, node_sizes, intra_bandwidth, intra_latency, inter_bandwidth, inter_latency
):
    """Hierarchical all-reduce: intra-node reduce, leader ring, intra-node broadcast.

    Args:
        nbytes: Buffer size `S` in bytes.
        node_sizes: Number of members on each node, e.g. `[4, 4]`.
        intra_bandwidth: Slowest intra-node link bandwidth, bytes per second.
        intra_latency: Largest intra-node link latency, seconds.
        inter_bandwidth: Slowest NIC bandwidth between node leaders.
        inter_latency: Largest latency between node leaders, seconds.

    Returns:
        Seconds. With one node this equals the intra-node ring all-reduce;
        with one device per node it equals the ring among the leaders.
    """
    _check_bytes(nbytes)
    sizes = [int(k) for k in node_sizes if k > 0]
    if nbytes == 0 or sum(sizes) <= 1:
        return 0.0
    k = max(sizes)
    m = len(sizes)
    intra = 0.0
    if k > 1:
        _check_link(intra_bandwidth, intra_latency, "intra-node link")
        intra = (k - 1) / k * nbytes / intra_bandwidth + (k - 1) * intra_latency
    inter = 0.0
    if m > 1:
        inter = ring_allreduce_time(nbytes, m, inter_bandwidth, inter_latency)
    return 2.0 * intra + inter


def ps_time(nbytes, n_clients, bandwidth, latency):
    """Parameter-server push and pull with the server's link shared.

    `n_clients` clients (other than the server itself) each push `nbytes`
    and pull `nbytes` back; all transfers cross the server's link one at a
    time: `2 * n_clients * (alpha + S / B)`. Aggregation and the update on
    the server are not included.

    Args:
        nbytes: Bytes per client and direction.
        n_clients: Number of clients that are not the server.
        bandwidth: Server link bandwidth, bytes per second.
        latency: Server link latency, seconds.

    Returns:
        Seconds.
    """
    _check_bytes(nbytes)
    if n_clients <= 0 or nbytes == 0:
        return 0.0
    _check_link(bandwidth, latency, "server link")
    return 2.0 * n_clients * (latency + nbytes / bandwidth)


def _slowest(links):
    """`(largest latency, smallest bandwidth)` of `(latency, bandwidth)` links."""
    return max(l for l, _ in links), min(b for _, b in links)


class CommModel:
    """Alpha-beta communication model over a cluster's topology.

    Args:
        topology: An object with `bandwidth(a, b)` (bytes/s) and
            `latency(a, b)` (seconds) for device names, i.e. a
            `devices.Topology`.
        node_of: Dict from device name to node name (for hierarchical
            all-reduce). Default: the part of the name before `/`.

    Example:

    ```python
    comm = CommModel(cluster.topology, {d.name: d.node for d in cluster.devices})
    comm.allreduce_time(25 * 2**20, cluster.names, "hierarchical")
    ```
    """

    def __init__(self, topology, node_of=None):
        self.topology = topology
        self.node_of = dict(node_of) if node_of is not None else None
        self._links = {}

    def node(self, device):
        if self.node_of is not None and device in self.node_of:
            return self.node_of[device]
        return device.split("/", 1)[0]

    def link(self, src, dst):
        """Returns `(latency_s, bandwidth_bytes_per_s)` of the link `src -> dst`."""
        key = (src, dst)
        found = self._links.get(key)
        if found is None:
            try:
                found = (
                    float(self.topology.latency(src, dst)),
                    float(self.topology.bandwidth(src, dst)),
                )
            except KeyError as e:
                raise EstimatorError(
                    f"The topology has no link between {src!r} and {dst!r}; every "
                    f"device of a plan must be in the cluster. Received: {e}"
                ) from None
            self._links[key] = found
        return found

    def transfer_time(self, nbytes, src, dst):
        """Point-to-point transfer time; 0 on the same device."""
        _check_bytes(nbytes)
        if src == dst or nbytes == 0:
            return 0.0
        latency, bandwidth = self.link(src, dst)
        return p2p_time(nbytes, bandwidth, latency)

    def _ring_links(self, devices):
        n = len(devices)
        return _slowest([self.link(devices[i], devices[(i + 1) % n]) for i in range(n)])

    def allreduce_time(self, nbytes, devices, algorithm="ring"):
        """All-reduce of `nbytes` over `devices` with `algorithm`.

        Args:
            nbytes: Buffer size in bytes.
            devices: Member device names, in ring order.
            algorithm: `"ring"`, `"tree"` or `"hierarchical"`.

        Returns:
            Seconds.

        Raises:
            EstimatorError: For an unknown algorithm.
        """
        devices = list(devices)
        n = len(devices)
        if algorithm not in ALGORITHMS:
            raise EstimatorError(
                f"Unknown all-reduce algorithm {algorithm!r}; use one of {ALGORITHMS}. "
                f"Received: {algorithm!r}"
            )
        if n <= 1 or nbytes == 0:
            return 0.0
        if algorithm == "ring":
            latency, bandwidth = self._ring_links(devices)
            return ring_allreduce_time(nbytes, n, bandwidth, latency)
        if algorithm == "tree":
            # Binary tree in member order: member i's parent is (i - 1) // 2.
            latency, bandwidth = _slowest(
                [self.link(devices[i], devices[(i - 1) // 2]) for i in range(1, n)]
            )
            return tree_allreduce_time(nbytes, n, bandwidth, latency)
        by_node = {}
        for d in devices:
            by_node.setdefault(self.node(d), []).append(d)
        intra_lat, intra_bw = 0.0, float("inf")
        for members in by_node.values():
            if len(members) > 1:
                lat, bw = self._ring_links(members)
                intra_lat, intra_bw = max(intra_lat, lat), min(intra_bw, bw)
        leaders = [members[0] for members in by_node.values()]
        inter_lat, inter_bw = 0.0, float("inf")
        if len(leaders) > 1:
            inter_lat, inter_bw = self._ring_links(leaders)
        return hierarchical_allreduce_time(
            nbytes, [len(m) for m in by_node.values()], intra_bw, intra_lat, inter_bw, inter_lat
        )
