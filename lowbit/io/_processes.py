"""Messages between the processes of one save, through JAX's distributed key-value store.

A save by several processes is a few steps in lock step (write the shards, agree on the
manifest, publish). Each step is a message per process under a key unique to the save, read
with a deadline: a process that died or hangs makes the others raise an error naming it after
`timeout` seconds instead of waiting forever in a collective, and a process that fails says so
in its message, so the others stop at once. No device collective is used: a save moves only
bytes of JSON between processes.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jax

from lowbit.engine import distributed_client

_FAILED = "failed: "
# Every process runs the same saves in the same order, so the n-th save has the same number
# in every process: the prefix of its keys.
_SAVES = itertools.count()


class ProcessError(RuntimeError):
    """Another process of a save failed, died or did not answer in time."""


def _client() -> Any:
    client = distributed_client()
    if client is None:
        raise ProcessError(
            f"{jax.process_count()} processes but no jax.distributed client: call "
            "jax.distributed.initialize() in every process before saving"
        )
    return client


class Exchange:
    """The messages of one save: ``send(step, value)`` and ``receive(step, process)``.

    Args:
      what: what the save is (the checkpoint path), for errors.
      timeout: seconds to wait for each other process's message.
    """

    def __init__(self, what: str, timeout: float):
        self._prefix = f"lowbit/checkpoint/{next(_SAVES)}"
        self._what, self._timeout = what, timeout
        self._sent: set[str] = set()
        self.process, self.count = jax.process_index(), jax.process_count()
        # One process (a per-process layout asked for in one process) talks to itself.
        self._local: dict[str, str] | None = {} if self.count == 1 else None

    def _set(self, key: str, text: str) -> None:
        if self._local is not None:
            self._local[key] = text
        else:
            _client().key_value_set(key, text)

    def _get(self, key: str) -> str:
        if self._local is not None:
            return self._local[key]
        return _client().blocking_key_value_get(key, int(self._timeout * 1000))

    def _key(self, step: str, process: int) -> str:
        return f"{self._prefix}/{step}/{process}"

    def send(self, step: str, value: Any) -> None:
        """Publishes this process's JSON `value` for `step` (once per step)."""
        if step not in self._sent:
            self._sent.add(step)
            self._set(self._key(step, self.process), json.dumps(value))

    def forget(self, step: str) -> None:
        """Drops this process's value for `step` from the store, once no one will read it
        (a table of pieces per save would otherwise stay for the life of the job)."""
        if self._local is not None:
            self._local.pop(self._key(step, self.process), None)
        else:
            _client().key_value_delete(self._key(step, self.process))

    def fail(self, steps: tuple[str, ...], reason: str) -> None:
        """Tells the other processes, at each of `steps` not sent yet, that this one failed."""
        for step in steps:
            if step not in self._sent:
                self._sent.add(step)
                try:
                    self._set(self._key(step, self.process), _FAILED + reason[:2000])
                except Exception:  # noqa: BLE001 - the store is gone too: they time out
                    return

    def receive(self, step: str, process: int) -> Any:
        """Process `process`'s value for `step`.

        Raises:
          ProcessError: naming the process, if it failed (with its reason) or sent nothing
            within the timeout.
        """
        try:
            text = self._get(self._key(step, process))
        except Exception as err:  # the store raises its own error types on a deadline
            raise ProcessError(
                f"process {self.process}: process {process} did not finish step {step!r} of "
                f"saving {self._what} within {self._timeout:g} s (it died, hangs, or runs "
                f"another program); the checkpoint was not replaced ({type(err).__name__})"
            ) from None
        if text.startswith(_FAILED):
            raise ProcessError(
                f"process {self.process}: process {process} failed while saving {self._what}: "
                f"{text[len(_FAILED) :]}; the checkpoint was not replaced"
            )
        return json.loads(text)

    def receive_all(self, step: str) -> list[Any]:
        """Every process's value for `step`, this one's included (it must have sent it)."""
        return [self.receive(step, p) for p in range(self.count)]
