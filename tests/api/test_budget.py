"""`choose_plan` on a tiny MLP: the budget holds in stored bytes, the error is the output error
on the calibration Gram matrices, and bad budgets name both bounds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.algorithms import capture
from lowbit.api import AlgorithmOptions, choose_plan, measure_candidates, plan_within
from lowbit.eval import param_bytes
from lowbit.recipes import Recipe, parse_candidates

CANDIDATES = "int8,int4:g32,int3:g32:gptq"


@pytest.fixture(scope="module")
def model():
    # Two weights of one shape: each candidate compiles once (the tests stay fast).
    k = jax.random.split(jax.random.key(0), 2)
    params = {
        "up": {"kernel": jax.random.normal(k[0], (64, 64)) * 0.1},
        "down": {"kernel": jax.random.normal(k[1], (64, 64)) * 0.1},
    }

    def fn(p, x):
        return jax.nn.gelu(x @ p["up"]["kernel"]) @ p["down"]["kernel"]

    batches = [jax.random.normal(jax.random.key(i), (2, 64, 64)) for i in range(2)]
    stats = capture(fn, params, batches)
    measured = measure_candidates(params, stats, candidates=parse_candidates(CANDIDATES))
    return params, stats, measured


def test_plan_meets_the_budget_in_stored_bytes(model):
    params, stats, measured = model
    plan = plan_within(measured, bits=5.0)
    elements = sum(t.size for t in plan.tensors)
    assert plan.nbytes <= 5.0 * elements / 8 and plan.bits <= 5.0
    quantized = lowbit.quantize_params(
        params, plan.recipe, algorithm_options=AlgorithmOptions(statistics=stats)
    )
    assert param_bytes(quantized) == plan.nbytes  # counted from the stored bytes, scales too
    # The measured error is the output error of what quantize_params stores (GPTQ included).
    for t in plan.tensors:
        q = quantized
        for key in t.path.split("/"):
            q = q[key]
        delta = np.asarray(q.dequantize(jnp.float32)) - np.asarray(
            params[t.path.split("/")[0]][t.path.split("/")[1]]
        )
        (s,) = stats.for_path(t.path)
        want = float(
            np.sum((delta.T @ np.asarray(s.gram)) * delta.T)
        )  # tr(ΔW G ΔWᵀ), rows = outputs
        np.testing.assert_allclose(t.chosen.error, want, rtol=1e-3)
    text = str(plan)
    assert "bits per layer" in text and "up/kernel" in text
    assert Recipe.from_json(plan.recipe.to_json()) == plan.recipe


def test_more_bits_lower_error(model):
    _, _, measured = model
    errors = [plan_within(measured, bits=b).error for b in (4.0, 4.5, 6.0, 8.0)]
    assert errors == sorted(errors, reverse=True)


def test_budget_outside_the_candidates_names_both_bounds(model):
    _, _, measured = model
    low, high = measured.bounds()
    with pytest.raises(ValueError, match=rf"below the smallest plan.*{low} to {high} bytes"):
        plan_within(measured, max_bytes=low - 1)
    with pytest.raises(ValueError, match=rf"above the largest plan.*{low} to {high} bytes"):
        plan_within(measured, bits=12.0)
    with pytest.raises(ValueError, match="exactly one budget"):
        plan_within(measured, bits=4.0, max_bytes=10**6)


def test_gguf_target_refuses_lowbit_only_candidates(model):
    params, stats, _ = model
    with pytest.raises(ValueError, match="GGUF file stores none of the candidates nf4:g64"):
        choose_plan(params, stats, bits=4.0, target="gguf", candidates=parse_candidates("nf4:g64"))


def test_gguf_target_counts_ggml_bytes(model):
    params, stats, _ = model
    plan = choose_plan(
        params, stats, bits=7.0, target="gguf", candidates=parse_candidates("q8_0,q4_0")
    )
    per = {"q8_0": 34 / 32, "q4_0": 18 / 32}
    assert plan.nbytes == sum(t.size * per[t.chosen.candidate.name] for t in plan.tensors)
    assert {t.chosen.candidate.name for t in plan.tensors} == {"q8_0", "q4_0"}


def _mlp(p, x):
    return jax.nn.gelu(x @ p["up"]["kernel"]) @ p["down"]["kernel"]


def test_output_sensitivity_is_the_gauss_newton_diagonal():
    """For y = x W, ∂y[r, n] / ∂W[k, n] = x[r, k]: diag(JᵀJ)[k, n] = Σ_r x[r, k]² over the
    positions the mask keeps, whatever n; the random projections estimate it."""
    w = jax.random.normal(jax.random.key(1), (16, 8))
    x = jax.random.normal(jax.random.key(2), (2, 12, 16))
    mask = jnp.arange(12)[None, :] < jnp.array([[12], [5]])  # the second row padded after 5
    sens = lowbit.algorithms.output_sensitivity(
        lambda p, x, m: x @ p["w"]["kernel"],
        {"w": {"kernel": w}},
        [(x, mask)],
        probes=2000,
        row_mask=lambda x, m: m,
    )
    want = np.sum(np.square(np.asarray(x)) * np.asarray(mask)[..., None], axis=(0, 1))
    got = np.asarray(sens["w/kernel"])
    assert got.shape == (16, 8)
    np.testing.assert_allclose(got, np.broadcast_to(want[:, None], (16, 8)), rtol=0.2)


def test_plan_on_output_sensitivity(model):
    params, stats, _ = model
    batches = [jax.random.normal(jax.random.key(i), (2, 64, 64)) for i in range(2)]
    sens = lowbit.algorithms.output_sensitivity(_mlp, params, batches, probes=2)
    assert set(sens) == {"up/kernel", "down/kernel"}
    candidates = parse_candidates("int8,int4:g32")
    plan = choose_plan(params, stats, bits=6.0, candidates=candidates, sensitivity=sens)
    quantized = lowbit.quantize_params(params, plan.recipe)
    for t in plan.tensors:
        layer = t.path.split("/")[0]
        delta = quantized[layer]["kernel"].dequantize(jnp.float32) - params[layer]["kernel"]
        want = float(jnp.sum(sens[t.path] * jnp.square(delta)))
        np.testing.assert_allclose(t.chosen.error, want, rtol=1e-4)
    with pytest.raises(ValueError, match="no score for the planned weight 'up/kernel'"):
        measure_candidates(
            params, stats, candidates=candidates, sensitivity={"down/kernel": sens["down/kernel"]}
        )


def test_output_sensitivity_bad_input(model):
    params, _, _ = model
    batch = [(jnp.ones((1, 64)),)]
    with pytest.raises(ValueError, match="probes=0"):
        lowbit.algorithms.output_sensitivity(_mlp, params, batch, probes=0)
    with pytest.raises(ValueError, match="'up/bias' is not a floating parameter"):
        lowbit.algorithms.output_sensitivity(_mlp, params, batch, paths=["up/bias"])


def test_time_candidates_fills_every_candidate(model):
    from lowbit.api import time_candidates

    _, _, measured = model
    timed = time_candidates(measured)
    # Untimed measurements cannot be planned under a time limit; timed ones can.
    with pytest.raises(ValueError, match="time_candidates"):
        plan_within(measured, bits=8.5, max_ms_per_token=1e6)
    plan_within(timed, bits=8.5, max_ms_per_token=1e6)
    for path, ms in timed.measured.items():
        for before, after in zip(measured.measured[path], ms, strict=True):
            assert (after.candidate, after.nbytes, after.error) == (
                before.candidate,
                before.nbytes,
                before.error,
            )


# Stand-in kernel times (seconds per token), not measured: int8 the slowest, so that a time
# limit pushes a plan that bytes alone would leave at int8 onto the other candidates.
FAKE_SECONDS = {"int8": 3e-3, "int4:g32": 1e-3, "int3:g32:gptq": 2e-3}


def test_plan_within_a_time_limit(model):
    _, _, measured = model
    with pytest.raises(ValueError, match="time_candidates"):
        plan_within(measured, bits=8.5, max_ms_per_token=1.0)
    timed = dataclasses.replace(
        measured,
        measured={
            path: [dataclasses.replace(m, seconds=FAKE_SECONDS[m.candidate.name]) for m in ms]
            for path, ms in measured.measured.items()
        },
    )
    chosen = lambda plan: [t.chosen.candidate.name for t in plan.tensors]
    free = plan_within(timed, bits=8.5)
    assert chosen(free) == ["int8", "int8"]  # bytes alone leave both at int8
    plan = plan_within(timed, bits=8.5, max_ms_per_token=4.0)
    assert sum(FAKE_SECONDS[name] for name in chosen(plan)) <= 4e-3  # the stand-in costs
    assert plan.error >= free.error  # time bought with error, never the other way
    assert "ms of kernels per token within 4" in str(plan)
    with pytest.raises(ValueError, match="the fastest found takes 0.002 s"):
        plan_within(timed, bits=8.5, max_ms_per_token=1.0)


def test_a_file_counts_its_own_bytes(model):
    """With a `FileBytes`, each candidate costs the file's bytes for it, `max_bytes` is the
    whole file (its fixed bytes first), and a budget below the smallest file is refused from
    shapes alone, naming the file's sizes."""
    from lowbit.api import FileBytes, check_budget

    params, stats, _ = model
    candidates = parse_candidates(CANDIDATES)
    # A stand-in file: every weight padded by 100 bytes, 5000 bytes of header.
    file = FileBytes(fixed=5000, nbytes=lambda path, q: int(q.nbytes) + 100, what="test file")
    measured = measure_candidates(params, stats, candidates=candidates, file=file)
    plain = measure_candidates(params, stats, candidates=candidates)
    for path, ms in measured.measured.items():
        assert [m.nbytes for m in ms] == [m.nbytes + 100 for m in plain.measured[path]]
    low, high = measured.bounds()
    budget = 5000 + (low + high) // 2
    plan = plan_within(measured, max_bytes=budget)
    assert plan.file_nbytes == plan.nbytes + 5000 <= budget
    assert f"the test file: {plan.file_nbytes} bytes (5000 besides" in str(plan)
    # The bytes left are fewer than any change of lower error would add.
    assert plan.step is not None and budget - plan.file_nbytes < plan.step
    assert plan_within(measured, max_bytes=high + 5000).step is None  # every weight at its best
    message = rf"below the smallest plan: the test file takes {low + 5000} to {high + 5000} bytes"
    with pytest.raises(ValueError, match=message):
        plan_within(measured, max_bytes=low + 4999)
    with pytest.raises(ValueError, match=message):
        check_budget(params, max_bytes=low + 4999, candidates=candidates, file=file)
    check_budget(params, max_bytes=low + 5000, candidates=candidates, file=file)
