"""`lowbit.api.compile_stored`: a program's traced form kept on disk and read back by a
second start, with the same results and no trace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_support import tiny_lm as _tiny_lm

import lowbit
from lowbit import api, kernels, serving
from lowbit.api import _stored


def _new_process():
    """Forgets the programs compiled so far, as a new process would."""
    _stored._COMPILED.clear()


def _affine(counter):
    def fn(params, x):
        counter.append(1)  # once per trace
        return {"y": x @ params["w"] + params["b"], "n": jnp.sum(x)}

    return fn


def _args():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.ones((4,))}
    return params, jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)


def _compile(fn, args, directory, **options):
    return api.compile_stored(
        "affine",
        fn,
        args,
        static="affine v1",
        out_like=lambda a: {"y": 0, "n": 0},
        directory=directory,
        **options,
    )


def test_a_second_compile_reads_the_kept_program_without_tracing(tmp_path):
    args = _args()
    traces = []
    first = _compile(_affine(traces), args, tmp_path)
    assert first.stored and len(traces) == 1
    kept = list(tmp_path.iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("affine-")

    traces.clear()
    assert _compile(_affine(traces), args, tmp_path) is first  # the same process: no work
    _new_process()
    second = _compile(_affine(traces), args, tmp_path)
    assert second.stored and traces == []
    expected = jax.jit(_affine([]))(*args)
    for program in (first, second):
        out = program(*args)
        np.testing.assert_allclose(out["y"], expected["y"], rtol=1e-6)
        np.testing.assert_allclose(out["n"], expected["n"], rtol=1e-6)
    assert second.out_shapes["y"].shape == (3, 4)


def test_programs_lowered_first_compile_together_and_chain(tmp_path):
    """A second program lowered from the first's output shapes before either compiles (a
    generation's decode after its prefill); compiled together they give what each compiled
    alone gives, and asking again gives the same programs."""
    args = _args()
    first = api.lower_stored(
        "affine",
        _affine([]),
        args,
        static="affine v1",
        out_like=lambda a: {"y": 0, "n": 0},
        directory=tmp_path,
    )
    assert first.out_shapes["y"] == jax.ShapeDtypeStruct((3, 4), jnp.float32)
    assert not first.read_back  # traced and kept now
    second = api.lower_stored(
        "square",
        lambda out: out["y"] ** 2,
        (first.out_shapes,),
        static="",
        out_like=lambda a: 0,
        directory=tmp_path,
    )
    affine, square = api.compile_together([first, second])
    out = affine(*args)
    np.testing.assert_allclose(out["y"], args[1] @ args[0]["w"] + 1, rtol=1e-6)
    np.testing.assert_allclose(square(out), out["y"] ** 2, rtol=1e-6)
    assert {p.name.split("-")[0] for p in tmp_path.iterdir()} == {"affine", "square"}
    assert _compile(_affine([]), args, tmp_path) is affine
    assert api.compile_together([first]) == [affine]
    _new_process()
    again = api.lower_stored(
        "affine",
        _affine(traces := []),
        args,
        static="affine v1",
        out_like=lambda a: {"y": 0, "n": 0},
        directory=tmp_path,
    )
    assert again.read_back and traces == []
    np.testing.assert_allclose(api.compile_together([again])[0](*args)["y"], out["y"])


def test_the_key_changes_with_shapes_dtypes_and_the_static_description(tmp_path):
    params, x = _args()
    key = api.program_key("p", "s", (params, x))
    assert key == api.program_key("p", "s", (params, x))
    assert key != api.program_key("p", "t", (params, x))
    assert key != api.program_key("p", "s", (params, x[:2]))
    assert key != api.program_key("p", "s", (params, x.astype(jnp.bfloat16)))
    assert key != api.program_key("p", "s", ({"w": params["w"]}, x))


def test_describe_drops_process_addresses():
    def f():
        pass

    assert " at 0x" in repr(f) and " at 0x" not in api.describe(f)


def test_a_damaged_file_is_traced_again(tmp_path):
    args = _args()
    _compile(_affine([]), args, tmp_path)
    (kept,) = tmp_path.iterdir()
    kept.write_bytes(b"not a program")
    _new_process()
    traces = []
    program = _compile(_affine(traces), args, tmp_path)
    assert traces == [1] and program.stored
    np.testing.assert_allclose(program(*args)["y"], jax.jit(_affine([]))(*args)["y"], rtol=1e-6)


def test_without_a_directory_nothing_is_kept(tmp_path):
    program = _compile(_affine([]), _args(), None)
    assert not program.stored
    assert list(tmp_path.iterdir()) == []


def test_a_program_export_refuses_still_compiles(tmp_path):
    """A host callback cannot be serialized: the program is traced and compiled as usual."""

    def fn(params, x):
        jax.debug.callback(lambda v: None, x)
        return {"y": x @ params["w"], "n": jnp.sum(x)}

    args = _args()
    program = _compile(fn, args, tmp_path)
    assert not program.stored and list(tmp_path.iterdir()) == []
    np.testing.assert_allclose(program(*args)["y"], args[1] @ args[0]["w"], rtol=1e-6)


def test_the_output_structure_is_checked_when_traced(tmp_path):
    with pytest.raises(ValueError, match="out_like"):
        api.compile_stored(
            "bad",
            _affine([]),
            _args(),
            static="",
            out_like=lambda a: (0, 0),
            directory=tmp_path,
        )


def test_donated_arguments_are_consumed(tmp_path):
    args = _args()
    program = api.compile_stored(
        "donate",
        lambda params, x: {"y": x * 2, "n": jnp.sum(x)},
        args,
        static="",
        out_like=lambda a: {"y": 0, "n": 0},
        donate_argnums=(1,),
        directory=tmp_path,
    )
    x = jnp.array(args[1])
    out = program(args[0], x)
    np.testing.assert_allclose(out["y"], args[1] * 2)
    assert x.is_deleted()


@pytest.mark.skipif(
    not (kernels.available() and jax.default_backend() == "cpu"), reason="CPU kernels"
)
def test_a_model_on_the_cpu_kernels_round_trips(tmp_path):
    """lowbit's own FFI calls (int8 kernels on prepared weights) are kept and read back."""
    tiny_lm = _tiny_lm(dim=256, ffn_dim=512)
    state = nnx.to_pure_dict(nnx.state(tiny_lm.model))
    served = serving.ready(tiny_lm, lowbit.quantize_params(state, "int8"))
    fn = lowbit.run(serving.model_fn(tiny_lm.model, tiny_lm.kind))
    tokens = jnp.array([[1, 2, 3, 4]], jnp.int32)
    expected = np.asarray(jax.jit(fn)(served, tokens))
    for _ in range(2):
        _new_process()
        program = api.compile_stored(
            "lm",
            fn,
            (served, tokens),
            static=api.describe(nnx.graphdef(tiny_lm.model)),
            out_like=lambda a: 0,
            directory=tmp_path,
        )
        assert program.stored
        np.testing.assert_array_equal(np.asarray(program(served, tokens)), expected)
