"""`lowbit._host_memory`: freed memory handed back after a compile, and only then."""

import jax
import jax.numpy as jnp

from lowbit import _host_memory


def test_memory_is_released_after_a_call_that_compiled_and_not_after_one_that_reused(monkeypatch):
    released = []
    monkeypatch.setattr(_host_memory, "release_free_memory", lambda: released.append(1))
    double = _host_memory.releasing_after_compile(jax.jit(lambda x: x * 2))

    assert float(double(jnp.ones(3))[0]) == 2.0
    assert len(released) == 1
    double(jnp.ones(3))  # the same program
    assert len(released) == 1
    double(jnp.ones(4))  # a new shape compiles a new program
    assert len(released) == 2


def test_a_function_without_a_jit_cache_is_returned_as_it_is():
    plain = lambda x: x  # noqa: E731
    assert _host_memory.releasing_after_compile(plain) is plain


def test_release_free_memory_runs_wherever_it_is_called():
    _host_memory.release_free_memory()  # glibc: malloc_trim; elsewhere nothing, never an error
