"""Gathering small host values from every process of a multi-process program.

`jax.experimental.multihost_utils.process_allgather` returns once the first local device's
copy of the result has arrived. With several devices per process the others' copies come
from collectives still running, and a process that returns and exits then leaves its peers
waiting on those collectives for ever (gloo's connection set-up waits for a peer that is
gone; the peers hang at interpreter shutdown). `allgather` waits for every local copy.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _identity(a: jax.Array) -> jax.Array:
    # One function for every gather, so `jax.jit` reuses its program for a repeated shape and
    # sharding (a new lambda each call was traced and compiled on every call).
    return a


def allgather(x: np.ndarray | jax.Array, *, tiled: bool = False) -> np.ndarray:
    """Every process's `x`, on the host of each (a collective: every process must call it).

    Args:
      x: a host value of the same shape and dtype in every process, or a `jax.Array` whose
        pieces lie in several processes (then `tiled` must be True).
      tiled: concatenate along axis 0 instead of stacking on a new leading axis.
    Returns:
      For a host value: ``(processes, *x.shape)`` stacked (or ``(processes * x.shape[0],
      ...)`` tiled; a scalar is always stacked). For an array spanning processes: the whole
      array.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not tiled:
            raise ValueError("allgather of an array spanning processes needs tiled=True")
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            replicated = sharding.update(spec=PartitionSpec())
        else:
            replicated = NamedSharding(
                Mesh(np.asarray(sharding._device_assignment), ("all",)), PartitionSpec()
            )
        out = jax.jit(_identity, out_shardings=replicated)(x)
    else:
        host = np.asarray(x)
        if host.ndim == 0 or not tiled:
            host = host[None]
        if jax.process_count() == 1:
            return host
        devices = np.asarray(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
        mesh = Mesh(devices, ("processes", "local"))
        shape = (host.shape[0] * jax.process_count(), *host.shape[1:])
        pieces = [jax.device_put(host, d) for d in jax.local_devices()]
        spread = jax.make_array_from_single_device_arrays(
            shape, NamedSharding(mesh, PartitionSpec("processes")), pieces
        )
        out = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(spread)
    # Every local copy, not only the first: see the module doc.
    return np.asarray(jax.block_until_ready(out).addressable_data(0))
