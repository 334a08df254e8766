"""Calibration algorithms on routed experts: per-expert statistics (only each expert's rows),
GPTQ, clip search and SparseGPT per expert, AWQ / SmoothQuant scales folded exactly with the
router compensated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_support import quantize_with_report
from flax import nnx

import lowbit
from lowbit.algorithms import capture
from lowbit.algorithms._clip import clip_experts
from lowbit.algorithms._smooth import apply_folds, plan_folds
from lowbit.api import SparseRule, nm_masks, sparsegpt_params
from lowbit.models import Decoder, DecoderConfig
from lowbit.models._decoder import MoE
from lowbit.qarray import PerGroup, PerToken, QuantConfig
from lowbit.recipes import AWQ, GPTQ, Recipe, Rule, SmoothQuant, param_leaves

CONFIG = DecoderConfig(
    vocab_size=64,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    n_experts=4,
    n_experts_used=2,
    expert_ffn_dim=64,
    shared_ffn_dim=64,
    norm_topk=False,
)
EXPERTS = [f"layers/{i}/moe/{n}_proj/kernel" for i in range(2) for n in ("gate", "up", "down")]
INT4 = QuantConfig(format="int4", granularity=PerGroup(16, axis=-2))


def _model(dead_expert: bool = False):
    """(fn, float params, batches); with `dead_expert`, layer 0's router never picks expert 3
    (its column equals expert 2's, and top_k breaks ties to the lower index, while experts 0
    and 1 are expert 2's column plus and minus one vector: one of them always beats it)."""
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    if dead_expert:
        router = np.array(params["layers"][0]["moe"]["router"])
        u = router[:, 0].copy()
        router[:, 0], router[:, 1] = router[:, 2] + u, router[:, 2] - u
        router[:, 3] = router[:, 2]
        params["layers"][0]["moe"]["router"] = jnp.asarray(router)
    fn = lambda p, tokens: nnx.merge(graphdef, p)(tokens)
    rng = np.random.default_rng(0)
    batches = [(jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32),) for _ in range(6)]
    return fn, params, batches


def _moe_inputs(monkeypatch, fn, params, batches) -> list[np.ndarray]:
    """Per layer, the MoE's input (the MLP norm's output) over all batches, [tokens, dim]."""
    seen: list[np.ndarray] = []
    call = MoE.__call__

    def record(self, x):
        seen.append(np.asarray(x).reshape(-1, x.shape[-1]))
        return call(self, x)

    monkeypatch.setattr(MoE, "__call__", record)
    for (tokens,) in batches:
        fn(params, tokens)
    monkeypatch.setattr(MoE, "__call__", call)
    n = CONFIG.n_layers
    return [np.concatenate(seen[i::n]) for i in range(n)]


def _routed_rows(flat: np.ndarray, moe: dict) -> list[np.ndarray]:
    """Per expert, the rows routed to it (by hand: softmax, top-k, token order)."""
    logits = flat @ np.asarray(moe["router"])
    top = np.asarray(jax.lax.top_k(jax.nn.softmax(jnp.asarray(logits), -1), 2)[1])
    return [flat[np.any(top == e, axis=1)] for e in range(CONFIG.n_experts)]


def _reference(flat: np.ndarray, moe: dict, name: str) -> list[np.ndarray]:
    """Per expert, the input rows of its `name` projection."""
    rows = _routed_rows(flat, moe)
    if name != "down":
        return rows
    gate, up = np.asarray(moe["gate_proj"]["kernel"]), np.asarray(moe["up_proj"]["kernel"])
    silu = lambda v: v / (1.0 + np.exp(-v))
    return [silu(r @ gate[e]) * (r @ up[e]) for e, r in enumerate(rows)]


def test_per_expert_statistics_are_those_of_the_rows_routed_to_each_expert(monkeypatch):
    fn, params, batches = _model(dead_expert=True)
    stats = capture(fn, params, batches, paths=EXPERTS)
    inputs = _moe_inputs(monkeypatch, fn, params, batches)
    for layer in range(CONFIG.n_layers):
        moe = params["layers"][layer]["moe"]
        for name in ("gate", "up", "down"):
            path = f"layers/{layer}/moe/{name}_proj/kernel"
            got = {s.fixed: s for s in stats.for_path(path)}
            assert sorted(got) == [((0, e),) for e in range(CONFIG.n_experts)]
            for e, rows in enumerate(_reference(inputs[layer], moe, name)):
                s = got[((0, e),)]
                assert s.ragged and s.input_axes == (1,)
                assert s.count == len(rows)
                ref_gram = rows.T @ rows if len(rows) else np.zeros((rows.shape[1],) * 2)
                scale = max(1.0, float(np.abs(ref_gram).max()))
                np.testing.assert_allclose(s.gram, ref_gram, atol=2e-4 * scale, rtol=2e-4)
                np.testing.assert_allclose(s.abs_sum, np.abs(rows).sum(0), rtol=1e-4, atol=1e-3)
                ref_max = np.abs(rows).max(0) if len(rows) else np.zeros(rows.shape[1])
                np.testing.assert_allclose(s.abs_max, ref_max, rtol=1e-5, atol=1e-6)
    # The dead expert: no rows, zero sums (not NaN).
    dead = {s.fixed: s for s in stats.for_path(EXPERTS[0])}[((0, 3),)]
    assert dead.count == 0 and not np.any(np.asarray(dead.gram))
    assert np.all(np.isfinite(np.asarray(dead.abs_mean)))
    # Rows per expert add up to (tokens x experts used).
    tokens = sum(b[0].size for b in batches)
    assert sum(s.count for s in stats.for_path(EXPERTS[3])) == tokens * CONFIG.n_experts_used


def _output_error(w, q, gram) -> float:
    """``tr(Δᵀ G Δ)``: the squared output error on the rows whose Gram matrix is `gram`."""
    d = np.asarray(w, np.float64) - np.asarray(q, np.float64)
    return float(np.sum(d * (np.asarray(gram, np.float64) @ d)))


def test_gptq_solves_every_expert_with_its_own_hessian_and_beats_rtn_on_its_rows():
    fn, params, batches = _model()
    recipe = Recipe(
        rules=(Rule(path=r".*/moe/(gate|up|down)_proj/kernel", weight=INT4, algorithm=GPTQ()),)
    )
    stats = capture(fn, params, batches, paths=EXPERTS)
    q, report = quantize_with_report(params, recipe, statistics=stats)
    rtn = lowbit.quantize_params(
        params, Recipe(rules=(Rule(path=recipe.rules[0].path, weight=INT4),))
    )
    floats = dict(param_leaves(params))
    gq = {p: leaf.dequantize() for p, leaf in param_leaves(q) if p in EXPERTS}
    rq = {p: leaf.dequantize() for p, leaf in param_leaves(rtn) if p in EXPERTS}
    for path in EXPERTS:
        assert report.applied[path].startswith("gptq per expert (4 of 4 experts"), report.applied[
            path
        ]
        for s in stats.for_path(path):
            e = s.fixed[0][1]
            w = floats[path][e]
            gptq_err = _output_error(w, gq[path][e], s.gram)
            rtn_err = _output_error(w, rq[path][e], s.gram)
            assert gptq_err < rtn_err, (path, e, gptq_err, rtn_err)


def test_an_expert_that_received_no_rows_keeps_rtn_and_is_reported():
    fn, params, batches = _model(dead_expert=True)
    recipe = Recipe(
        rules=(Rule(path=r".*/moe/(gate|up|down)_proj/kernel", weight=INT4, algorithm=GPTQ()),)
    )
    q, report = quantize_with_report(params, recipe, fn=fn, calibration=batches)
    path = "layers/0/moe/gate_proj/kernel"
    assert "3 of 4 experts" in report.applied[path]
    assert "rtn: expert 3 received no calibration rows" in report.applied[path]
    assert any("rtn: expert 3 received no calibration rows" in n for n in report.notes)
    rtn = lowbit.quantize_params(
        params, Recipe(rules=(Rule(path=recipe.rules[0].path, weight=INT4),))
    )
    got, want = dict(param_leaves(q))[path], dict(param_leaves(rtn))[path]
    np.testing.assert_array_equal(got.dequantize()[3], want.dequantize()[3])
    assert np.all(np.isfinite(np.asarray(got.dequantize())))
    with pytest.raises(ValueError, match="expert 3 received no calibration rows"):
        quantize_with_report(params, recipe, fn=fn, calibration=batches, strict=True)


def _rule(algorithm):
    if isinstance(algorithm, SmoothQuant):
        act = QuantConfig(format="int8", granularity=PerToken())
        w8 = QuantConfig(format="int8", granularity=lowbit.PerChannel((-1,)))
        return Rule(path=".*kernel", weight=w8, activation=act, algorithm=algorithm)
    return Rule(path=".*kernel", weight=INT4, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", [AWQ(grid=4), SmoothQuant(alpha=0.5)])
def test_expert_scales_fold_exactly_with_the_router_compensated(algorithm):
    fn, params, batches = _model()
    recipe = Recipe(rules=(_rule(algorithm),))
    stats = capture(fn, params, batches, sample_rows=64)
    wanted = lowbit.api.algorithm_weights(recipe, params)
    leaves = dict(param_leaves(params))
    floats = frozenset(p for p in leaves if p not in wanted)
    folds, skipped = plan_folds(leaves, wanted, stats, floats)
    by_target = {f.target: f for f in folds}
    for i in range(CONFIG.n_layers):
        moe = f"layers/{i}/moe"
        norm = by_target[f"layers/{i}/mlp_norm/scale"]
        assert set(norm.weights) == {
            f"{moe}/{n}_proj/kernel" for n in ("gate", "up", "shared/gate", "shared/up")
        }
        assert dict(norm.compensate) == {f"{moe}/router": 0, f"{moe}/shared_gate": 0}
        assert not np.allclose(norm.scale, 1.0)
        down = by_target[f"{moe}/up_proj/kernel"]
        assert down.weights == (f"{moe}/down_proj/kernel",) and down.axis == 2
        assert f"{moe}/down_proj/kernel" not in skipped
    # Folds without a target are applied inside the op (`QArray.input_scale`), not here.
    folds = [f for f in folds if f.target is not None]
    axes = {p: stats.for_path(p)[0].input_axes[0] for f in folds for p in f.weights}
    folded = apply_folds(params, folds, axes)
    for (tokens,) in batches[:2]:
        np.testing.assert_allclose(fn(folded, tokens), fn(params, tokens), rtol=1e-4, atol=1e-4)


def test_awq_through_quantize_params_reports_the_expert_fold():
    fn, params, batches = _model()
    recipe = Recipe(rules=(_rule(AWQ(grid=4)),))
    q, report = quantize_with_report(params, recipe, fn=fn, calibration=batches)
    note = report.applied["layers/0/moe/gate_proj/kernel"]
    assert "folded into layers/0/mlp_norm/scale" in note and "router" in note, note
    down = report.applied["layers/0/moe/down_proj/kernel"]
    assert "folded into layers/0/moe/up_proj/kernel's output" in down
    assert "clipped per expert" in note and "clipped per expert" in down
    # The router stays float and absorbs the scale.
    router = dict(param_leaves(q))["layers/0/moe/router"]
    assert not np.allclose(router, params["layers"][0]["moe"]["router"])
    tokens = batches[0][0]
    out, ref = lowbit.run(fn)(q, tokens), fn(params, tokens)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 0.5


def test_clip_search_per_expert_needs_blocks_within_one_expert():
    w = jax.random.normal(jax.random.key(0), (2, 32, 8))
    grams = [jnp.eye(32), None]
    clipped, ratio = clip_experts(w, grams, INT4)
    np.testing.assert_array_equal(clipped[1], w[1])  # no rows: full range kept
    assert clipped.shape == w.shape and 0.5 <= ratio <= 1.0
    across = QuantConfig(format="int4", granularity=PerGroup(2, axis=0))
    assert isinstance(clip_experts(w, grams, across), str)


def test_sparsegpt_prunes_every_expert_on_its_own_rows():
    fn, params, batches = _model(dead_expert=True)
    rule = SparseRule(path=r"layers/0/moe/(gate|up|down)_proj/kernel")
    pruned, masks, notes = sparsegpt_params(fn, params, batches, rule)
    stats = capture(fn, params, batches, paths=list(masks))
    magnitude = nm_masks(params, rule)
    leaves, new = dict(param_leaves(params)), dict(param_leaves(pruned))
    for path, mask in masks.items():
        # 2 of every 4 inputs kept in every expert, and the pruned entries are zero.
        groups = np.asarray(mask).reshape(4, -1, 4, mask.shape[-1]).sum(axis=2)
        assert np.all(groups == 2)
        assert not np.any(np.asarray(new[path])[~np.asarray(mask)])
        for s in stats.for_path(path):
            e = s.fixed[0][1]
            if s.count == 0:  # the dead expert: magnitude mask, noted
                np.testing.assert_array_equal(mask[e], magnitude[path][e])
                assert f"{path}[expert {e}]: received no calibration rows" in " ".join(notes)
                continue
            w = leaves[path][e]
            ours = _output_error(w, new[path][e], s.gram)
            by_magnitude = _output_error(w, jnp.where(magnitude[path][e], w, 0.0), s.gram)
            assert ours < by_magnitude, (path, e)
