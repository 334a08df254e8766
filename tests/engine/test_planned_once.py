"""Each quantized product of a traced decoder step is planned once (`ops.plan_dot_general`)."""

import jax
import jax.numpy as jnp
from flax import nnx
from lm_support import tiny_lm

import lowbit
from lowbit import ops, serving
from lowbit.engine import EngineReport
from lowbit.ops import _dot_general, _dot_path


def _counting(monkeypatch, module, name, *more):
    """Replaces `module.name` (and the same function at `more`'s (module, name)) by a wrapper
    that counts its calls; returns the count's list."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for where, attr in ((module, name), *more):
        monkeypatch.setattr(where, attr, counted)
    return calls


def test_a_decoder_step_plans_each_product_once(monkeypatch):
    # 256 x 512 weights take the CPU kernels where they are built; the 256 x 128 key and value
    # projections, below the kernels' size floor, the portable product: both kinds are here.
    loaded = tiny_lm(dim=256, ffn_dim=512)
    state = nnx.to_pure_dict(nnx.state(loaded.model))
    params = lowbit.quantize(state, "int4w_g32_asym")
    fn = serving.model_fn(loaded.model, loaded.kind)
    tokens = jnp.array([[1, 2, 3]], jnp.int32)

    planned = _counting(monkeypatch, ops, "plan_dot_general", (_dot_general, "plan_dot_general"))
    cores = _counting(monkeypatch, _dot_general, "choose_plan", (_dot_path, "plan"))
    report = EngineReport()
    jax.make_jaxpr(lowbit.run(fn, report=report))(params, tokens)

    products = sum(n for op, n in report.quantized_ops.items() if op.startswith("dot_general"))
    assert products == 8  # q, k, v, o, gate, up, down and the output projection
    assert len(planned) == products
    # The portable product's own plan is part of the product's plan, and is not made again
    # where the product runs (every lowering platform without a kernel traces it). Products
    # of one shape and plan share one trace of their platform branches, so it may be fewer.
    assert 0 < len(cores) <= products
