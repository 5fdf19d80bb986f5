"""Independent random streams per replica: Dropout masks that differ between replicas.

A data-parallel replica runs the model on its own rows of the global batch.
If it drew random numbers from the same state as replica 0, every replica
would apply the same Dropout mask (and the same noise of `GaussianNoise` or
random augmentation layers) to its rows: the replicas' masks would be
copies, which single-device Keras never does for the rows of one batch.

Keras layers draw from a `keras.random.SeedGenerator`, whose state variable
holds `[seed, counter]`; each draw uses the state and increments the
counter. Replica `r` draws from `[seed + r * SEED_STRIDE, counter]`: its own
stream, while the counter advances as on replica 0, whose state is the one
kept. Replica 0 draws exactly what single-device Keras would.

Under PyTorch, Keras's `Dropout` without a seed draws from torch's global
generator instead. At the start of every fit rank 0 sends `rank0_streams`
(a digest of its generator and its seed states); rank `r` then seeds its
global generator from the digest and its rank, and sets its seed states to
rank 0's with replica `r`'s seeds (`use_rank_streams`).

Example:

```python
states = seed_state_variables(model)
mapping = offset_states(states, replica=2)  # [(variable, value for replica 2), ...]
```
"""

SEED_STRIDE = 0x9E3779B1  # odd, ~2.65e9: successive replicas' seeds lie far apart
_SEED_STATE_NAME = "seed_generator_state"  # the variable `SeedGenerator` makes


def seed_state_variables(model):
    """The state variables of the `SeedGenerator`s of `model`'s layers, in Keras's order.

    Args:
        model: A built Keras model.

    Returns:
        A list of variables of shape `(2,)`: `[seed, counter]` each.
    """
    return [v for v in model.variables if is_seed_state(v)]


def is_seed_state(variable):
    """Whether `variable` is a `SeedGenerator`'s state (see `seed_state_variables`).

    Args:
        variable: A Keras variable.

    Returns:
        True for a variable named like a seed state, of shape `(2,)` and an
        integer dtype.
    """
    return (variable.name == _SEED_STATE_NAME and tuple(variable.shape) == (2,)
            and "int" in str(variable.dtype))


def wrap_seed(value, dtype):
    """`value` wrapped into the range of the seed dtype (`"int32"` or `"int64"`)."""
    bits = 32 if "32" in str(dtype) else 64
    half = 1 << (bits - 1)
    return (int(value) + half) % (1 << bits) - half


def seed_offset(replica, dtype):
    """What replica `replica` adds to a seed (wrapped into `dtype`)."""
    return wrap_seed(int(replica) * SEED_STRIDE, dtype)


def _offset_tensor(replica, dtype):
    """`[seed_offset(replica), 0]` as a tensor of the state's dtype (the counter untouched)."""
    from keras import ops

    return ops.convert_to_tensor([seed_offset(replica, dtype), 0], dtype=dtype)


def offset_states(states, replica):
    """`[(variable, value), ...]` giving replica `replica` its own seeds.

    Args:
        states: `seed_state_variables(model)`.
        replica: The replica's index in the plan (0 keeps the states).

    Returns:
        Pairs for a Keras `StatelessScope`'s `state_mapping`: each state with
        `seed_offset(replica)` added to its seed, the counter unchanged.
    """
    from keras import ops

    return [(v, ops.add(v.value, _offset_tensor(replica, v.dtype))) for v in states]


def restore_seed(value, replica, dtype):
    """A replica's state after its draws, with replica 0's seed back (the counter kept)."""
    from keras import ops

    return ops.subtract(value, _offset_tensor(replica, dtype))


def generator_digest(generator_state):
    """A 63-bit digest of torch generator states (bytes of `torch.get_rng_state()`).

    Rank 0 sends it at the start of a fit, so that the workers' seeds follow
    the user's `keras.utils.set_random_seed` and change from fit to fit as
    rank 0's generator advances; rank 0's own generator is not drawn from.
    """
    import hashlib

    digest = hashlib.blake2b(bytes(generator_state), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def torch_rank_seed(digest, rank):
    """The seed of rank `rank`'s global torch generator for a fit (`torch.manual_seed`).

    Args:
        digest: Rank 0's `generator_digest` for this fit.
        rank: The worker's rank (> 0).

    Returns:
        An int in `[0, 2**63)`, different for every rank.
    """
    return generator_digest(int(digest).to_bytes(8, "little") + int(rank).to_bytes(4, "little"))


def rank0_streams(model):
    """What rank 0 sends at the start of a fit so that the workers draw their own numbers.

    Returns:
        A JSON-able dict: the digest of rank 0's torch generators and its
        seed states, `[[seed, counter], ...]`.
    """
    import torch
    from keras import ops

    state = torch.get_rng_state().numpy().tobytes()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state += torch.cuda.get_rng_state().numpy().tobytes()
    return {
        "digest": generator_digest(state),
        "seed_states": [[int(x) for x in ops.convert_to_numpy(v.value)]
                        for v in seed_state_variables(model)],
    }


def use_rank_streams(model, streams, rank):
    """Rank `rank` (> 0) takes its own random streams for this fit.

    Args:
        model: The rank's model (the same layers as rank 0's).
        streams: Rank 0's `rank0_streams(model)`.
        rank: This rank, which runs the plan's replica `rank`.

    Raises:
        BackendError: If the model has not as many seed generators as rank 0's.
    """
    import torch

    from autodist_keras.errors import BackendError

    torch.manual_seed(torch_rank_seed(streams["digest"], rank))
    states = seed_state_variables(model)
    if len(states) != len(streams["seed_states"]):
        raise BackendError(
            f"Rank {rank}'s model has {len(states)} random seed generators and rank 0's has "
            f"{len(streams['seed_states'])}; every rank must build the same model. "
            f"Received: {[v.path for v in states][:6]}"
        )
    for variable, (seed, counter) in zip(states, streams["seed_states"]):
        variable.assign([wrap_seed(seed + seed_offset(rank, variable.dtype), variable.dtype),
                         counter])
