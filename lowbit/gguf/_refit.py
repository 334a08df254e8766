"""Re-fitting K-quant blocks onto the grid that already-decoded values lie on.

llama.cpp's reference searches, run on values that are decoded GGUF blocks, usually land on the
same block but can miss a sub-block's level or a super-scale by a step. These functions find the
block that decodes exactly to the values where there is one: Q2_K / Q4_K / Q5_K / Q6_K levels
near the searched ones or from the values' own steps, Q3_K's recovered outright. The encoders
call them only where the values look decoded (`needs_refit`); float weights never take them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.gguf._bits import f16, f16_bytes, nearest, pack_q3_k, safe_div, signed_absmax


def _exact_sub_blocks(xs, d, dmin, ls, lm, q, codes, levels, reach, skip=None):
    """K-quant sub-blocks re-fitted to decode exactly to `xs` where they can.

    When `xs` already are decoded values, the reference search usually lands on the same
    super-scales `d`, `dmin` but can miss a sub-block's scale or min level (1 decoded Q5_K block
    in 16, by one to five levels; 1 real Q6_K block in 100, by one). Scale levels within
    `reach` of the searched one are tried, nearest first, with the searched min level, its
    neighbours and the levels that put the sub-block's smallest value at code 0, 1 or 2; the
    first pair that reproduces every value exactly is kept.

    Args:
      xs: [..., n_sub, sub] values, ``x = d ls q - dmin lm``; d, dmin: [...] super-scales (as
        decoded from float16; `dmin` zero for the types without mins); ls, lm: [..., n_sub]
        searched levels; q: [..., n_sub, sub] codes; codes, levels: (lowest, highest) code and
        scale level; reach: largest scale change tried; skip: [...] blocks to leave as they
        are (reported done).
    Returns:
      (ls, lm, q) with the exact fits substituted, and done [..., n_sub]: which are exact.
    """
    ls, lm = ls.astype(jnp.int32), lm.astype(jnp.int32)
    x_min = xs.min(-1)
    inv_dmin = safe_div(1.0, dmin)[..., None]

    def attempt(state):
        k, out_ls, out_lm, out_q, done = state
        # Offsets 0, -1, +1, -2, +2, ...
        ls2 = ls + jnp.where(k % 2 == 1, -1, 1) * ((k + 1) // 2)
        dl = d[..., None] * ls2.astype(jnp.float32)
        # The min level that gives the smallest value code 0, 1 or 2: x = dl q - ml.
        at_code = [nearest(inv_dmin * (dl * c - x_min)).astype(lm.dtype) for c in range(3)]
        tries = jnp.stack([lm, lm - 1, lm + 1, *at_code])

        # The min levels in order, each on the sub-blocks still inexact: a rolled loop keeps
        # the compiled program small (see `_refit_k_min`).
        def try_min(j, state):
            out_ls, out_lm, out_q, done = state
            lm2 = jnp.clip(tries[j], 0, levels[1])
            ml = dmin[..., None] * lm2.astype(jnp.float32)
            q2 = nearest((xs + ml[..., None]) / jnp.where(dl == 0, 1, dl)[..., None])
            q2 = jnp.where((dl == 0)[..., None], q, jnp.clip(q2, *codes).astype(jnp.float32))
            ok = jnp.all(dl[..., None] * q2 - ml[..., None] == xs, axis=-1)
            ok &= (ls2 >= levels[0]) & (ls2 <= levels[1]) & ~done
            out_ls, out_lm = jnp.where(ok, ls2, out_ls), jnp.where(ok, lm2, out_lm)
            return out_ls, out_lm, jnp.where(ok[..., None], q2, out_q), done | ok

        state = (out_ls, out_lm, out_q, done)
        return k + 1, *jax.lax.fori_loop(0, tries.shape[0], try_min, state)

    def more(state):
        return (state[0] < 2 * reach + 1) & ~jnp.all(state[-1])

    done = jnp.zeros(ls.shape, bool)
    if skip is not None:
        done = jnp.broadcast_to(skip[..., None], ls.shape)
    return jax.lax.while_loop(more, attempt, (0, ls, lm, q, done))[1:]


def exact_k_min(xs, d16, dmin16, ls, lm, q, nmax, smax, codes=None):
    """Q2_K / Q4_K / Q5_K blocks re-fitted to decode exactly to `xs` where they can.

    First around the searched super-scales (`_exact_sub_blocks`); where that leaves a
    sub-block inexact, around super-scales recovered from the values the way the reference
    sets them: the sub-blocks of largest scale and largest min have level ``smax``, so the
    steepest line through a sub-block's codes and values is ``smax`` times `d`, the largest
    offset ``smax`` times `dmin`. (The search misses them, by a few float16 steps or by a
    sub-block's whole level, on 1 decoded Q5_K block in 100 and 1 Q2_K block in 200; on 1
    real Q2_K block in 1500 it lands on 2/3 of `d`, fooled by an outlier sub-block that uses
    only codes 0 and 2.)

    Args:
      xs: [..., n_sub, sub] values; d16, dmin16: [..., 2] float16 bytes; ls, lm: [..., n_sub]
      levels; q: [..., n_sub, sub] codes; nmax: largest code; smax: largest level;
      codes: for `needs_refit` to count distinct values against (Q2_K: its 4 codes in
      sub-blocks of 16; Q4_K blocks re-encode without it, and the sort costs its float
      encoding 10%).
    Returns:
      (d16, dmin16, ls, lm, q).
    """
    d, dmin = f16(d16), f16(dmin16)
    ls, lm = ls.astype(jnp.int32), lm.astype(jnp.int32)
    searched = (d16, dmin16, ls, lm, q)
    dl = d[..., None] * ls.astype(jnp.float32)
    ml = dmin[..., None] * lm.astype(jnp.float32)
    hit = jnp.all(dl[..., None] * q - ml[..., None] == xs, axis=-1)
    return jax.lax.cond(
        needs_refit(xs, hit, codes),
        lambda: _refit_k_min(xs, *searched, nmax, smax),
        lambda: searched,
    )


def needs_refit(xs: jax.Array, hit: jax.Array, codes: int | None = None) -> jax.Array:
    """Whether the exact refits should run on these blocks: the values look decoded, and some
    varied sub-block of `xs` [..., n_sub, sub] does not decode exactly from the search's
    result (`hit` [..., n_sub]). Decoded values: some varied sub-block already decodes
    exactly, or (given `codes`, a number of codes below a sub-block's size) every sub-block
    holds at most `codes` distinct values: a search that lands on the wrong super-scale (2/3
    of the right one, for a Q2_K outlier block) leaves no sub-block exact. Float weights look
    decoded by neither test; decoded blocks the search gives back need no refit. The refits
    (a few times the search's cost) run on neither."""
    varied = xs.max(-1) > xs.min(-1)
    decoded = jnp.any(hit & varied)
    if codes is not None:
        distinct = 1 + jnp.sum(jnp.diff(jnp.sort(xs, axis=-1), axis=-1) > 0, axis=-1)
        decoded |= jnp.any(varied) & jnp.all(distinct <= codes)
    return decoded & ~jnp.all(hit | ~varied)


def _smallest_gap(xs: jax.Array) -> jax.Array:
    """[..., n] -> [...]: the smallest positive difference between two values (0 if all are
    equal): a decoded sub-block's step, when two of its values sit on neighbouring codes."""
    gaps = jnp.diff(jnp.sort(xs, axis=-1), axis=-1)
    gap = jnp.min(jnp.where(gaps > 0, gaps, jnp.inf), axis=-1)
    return jnp.where(jnp.isfinite(gap), gap, 0.0)


def _per_block(use: jax.Array, new: tuple, old: tuple) -> tuple:
    """Fields of `new` where `use` [...] is set, of `old` elsewhere (fields [..., *rest])."""
    return tuple(
        jnp.where(use.reshape(use.shape + (1,) * (a.ndim - use.ndim)), a, b)
        for a, b in zip(new, old, strict=True)
    )


def _refit_k_min(xs, d16, dmin16, ls, lm, q, nmax, smax):
    """`exact_k_min`'s refits, on every block."""

    def fit(d, dmin, ls, lm, skip=None):
        return _exact_sub_blocks(xs, d, dmin, ls, lm, q, (0, nmax), (0, smax), 8, skip)

    d, dmin = f16(d16), f16(dmin16)
    best = (d16, dmin16, *fit(d, dmin, ls, lm))
    found = jnp.all(best[-1], axis=-1)
    # Lines x = slope q - offset through each sub-block, from the searched levels' codes or
    # from codes that count the smallest gap between two values from the smallest value.
    starts = (
        (d[..., None] * ls.astype(jnp.float32), dmin[..., None] * lm.astype(jnp.float32)),
        (_smallest_gap(xs), -xs.min(-1)),
    )
    candidates = []  # (d16, dmin16, ls, lm) of each line and stride, in the order tried
    for slope, offset in starts:
        for _ in range(2):
            codes = nearest((xs + offset[..., None]) / jnp.where(slope == 0, 1, slope)[..., None])
            codes = jnp.clip(codes, 0, nmax).astype(jnp.float32)
            q_mean, x_mean = codes.mean(-1), xs.mean(-1)
            centred = codes - q_mean[..., None]
            slope = safe_div((centred * xs).sum(-1), (centred * centred).sum(-1))
            offset = slope * q_mean - x_mean
        dmin_c16 = f16_bytes(jnp.maximum(offset.max(-1), 0.0) / smax)
        lm_c = jnp.clip(nearest(safe_div(1.0, f16(dmin_c16))[..., None] * offset), 0, smax)
        # A sub-block that uses only every other (or third) code, like an outlier at level
        # smax holding codes 0 and 2, has a line `stride` times too steep: try d / 2, d / 3.
        for stride in (1, 2, 3):
            d_c16 = f16_bytes(slope.max(-1) / (smax * stride))
            ls_c = jnp.clip(nearest(safe_div(1.0, f16(d_c16))[..., None] * slope), 0, smax)
            candidates.append((d_c16, dmin_c16, ls_c, lm_c))
    candidates = tuple(jnp.stack(field) for field in zip(*candidates, strict=True))

    # One fit in a rolled loop over the candidates, not one each: the fits were nearly all
    # of a K-quant quantizer's program (Q4_K's compiled in 5.7 s for one weight shape, 0.6 s
    # without them).
    def try_candidate(i, state):
        best, found = state
        d_c16, dmin_c16, ls_c, lm_c = (field[i] for field in candidates)
        candidate = (d_c16, dmin_c16, *fit(f16(d_c16), f16(dmin_c16), ls_c, lm_c, skip=found))
        use = jnp.all(candidate[-1], axis=-1) & ~found
        return _per_block(use, candidate, best), found | use

    best, _ = jax.lax.fori_loop(0, candidates[0].shape[0], try_candidate, (best, found))
    return best[:5]


def refit_q6_k(xs, d16, sc, q):
    """Q6_K blocks re-fitted to decode exactly to `xs` (decoded values) where they can.

    Scales within 8 levels of the searched ones, of either sign (the search can turn a
    sub-block of scale -128 into +127), around the searched `d` and, where that leaves a
    sub-block inexact, around the `d` that gives the steepest sub-block scale -128, as the
    reference does. (1 real Q6_K block in 5000 needed that.)

    Args:
      xs: [..., 16, 16] values; d16: [..., 2] float16 bytes; sc: [..., 16] int32 scales;
      q: [..., 16, 16] codes + 32.
    Returns:
      (d16, sc, q).
    """
    zero = jnp.zeros(xs.shape[:-2], jnp.float32)

    def fit(d, sc, skip=None):
        tries = [
            _exact_sub_blocks(
                xs, d, zero, s, jnp.zeros_like(s), q - 32, (-32, 31), (-128, 127), 8, skip
            )
            for s in (sc, -sc)
        ]
        use = ~tries[0][3] & tries[1][3]
        sc_fit = jnp.where(use, tries[1][0], tries[0][0])
        q_fit = jnp.where(use[..., None], tries[1][2], tries[0][2])
        return sc_fit, q_fit + 32, tries[0][3] | tries[1][3]

    best = (d16, *fit(f16(d16), sc))
    # Lines x = slope q through each sub-block, codes counting the smallest gap between two
    # values (the searched scales' codes lead straight back to the searched `d`).
    slope = _smallest_gap(xs)
    for _ in range(2):
        codes = jnp.clip(nearest(xs / jnp.where(slope == 0, 1, slope)[..., None]), -32, 31)
        codes = codes.astype(jnp.float32)
        slope = safe_div((codes * xs).sum(-1), (codes * codes).sum(-1))
    steepest = jnp.take_along_axis(slope, jnp.argmax(jnp.abs(slope), -1)[..., None], -1)[..., 0]
    d_c16 = f16_bytes(steepest / -128)
    d_c = f16(d_c16)
    sc_c = jnp.clip(nearest(safe_div(1.0, d_c)[..., None] * slope), -128, 127)
    found = jnp.all(best[-1], axis=-1)
    candidate = (d_c16, *fit(d_c, sc_c, skip=found))
    use = jnp.all(candidate[-1], axis=-1) & ~found
    return _per_block(use, candidate[:3], best[:3])


def q3_k_lattice(x, decode):
    """The Q3_K block whose decoded values are exactly `x`, when there is one.

    The scale search does not find the grid that decoded values already lie on (about half of
    decoded Q3_K blocks came back different), so it is recovered directly. A Q3_K value is
    ``d * sc * q`` with every product exact in float32 (11 + 6 + 3 significant bits), so
    ``x / d`` is an integer in [-128, 128] for every element when `d` is right. The reference
    quantizer gives the sub-block of largest scale ``sc = -32`` and maps a sub-block's largest
    value to a negative code (-4, or -3 after its refinement): those name the candidates for
    `d`, tried on the sub-blocks in order of their largest values. Each sub-block's scale is
    then the smallest one (sign first: its largest value's code negative) that leaves every
    code an integer in [-4, 3].

    Args:
      x: [..., 256] float32 values.
      decode: Q3_K's block decoder (blocks [..., 110] -> values [..., 256]), to check the
        found blocks with.
    Returns:
      (found [...] bool: the blocks decode exactly to `x`, blocks [..., 110] uint8).
    """
    xs = x.reshape(*x.shape[:-1], 16, 16)
    peak = jnp.max(jnp.abs(xs), axis=-1)
    # The sign of each sub-block's first largest value. (Decoding can tie the reference's
    # largest value with one of the other sign; neither the first, nor the larger or smaller
    # group of tied values names it right much more than half the time.)
    sign = jnp.where(signed_absmax(xs)[1] < 0, -1.0, 1.0)
    order = jnp.argsort(-peak, axis=-1)

    def candidate(k, state):
        d, found = state
        j = order[..., k, None]
        top = jnp.take_along_axis(peak, j, axis=-1)[..., 0]
        sub = jnp.take_along_axis(xs, j[..., None], axis=-2)[..., 0, :]
        top_sign = jnp.take_along_axis(sign, j, axis=-1)[..., 0]
        for flip, code in ((1, 4), (1, 3), (-1, 3)):
            # Sub-block j has sc = -32 and its peak elements (of sign top_sign * flip) code
            # -code: x = d * -32 * -code.
            c = flip * top_sign * top / (32.0 * code)
            safe = jnp.where(c == 0, 1, c)[..., None]
            # round(x / c) * c == x, not x / c == round(x / c): XLA divides by a broadcast
            # as a multiply by its reciprocal, which is not exact.
            n = jnp.round(x / safe)
            n_sub = jnp.round(sub / safe)
            ok = (c != 0) & (c.astype(jnp.float16).astype(jnp.float32) == c)
            ok &= jnp.all((n * c[..., None] == x) & (jnp.abs(n) <= 128), axis=-1)
            ok &= jnp.all((n_sub % 32 == 0) & (n_sub <= 128) & (n_sub >= -96), axis=-1)
            d = jnp.where(ok & ~found, c, d)
            found |= ok
        return d, found

    init = (jnp.zeros(x.shape[:-1], jnp.float32), jnp.zeros(x.shape[:-1], bool))
    d, found = jax.lax.fori_loop(0, 16, candidate, init)
    n = jnp.round(xs / jnp.where(found, d, 1)[..., None, None])
    first = jnp.where(signed_absmax(n)[1] < 0, 1.0, -1.0)

    def scale(magnitude, state):
        sc, done = state
        for direction in (first, -first):
            s = direction * magnitude.astype(jnp.float32)
            q = jnp.round(n / s[..., None])
            ok = (s <= 31) & jnp.all((q * s[..., None] == n) & (q >= -4) & (q <= 3), axis=-1)
            sc = jnp.where(ok & ~done, s, sc)
            done |= ok
        return sc, done

    init = (jnp.zeros(first.shape, jnp.float32), jnp.all(n == 0, axis=-1))
    sc, done = jax.lax.fori_loop(1, 33, scale, init)
    q = jnp.where((sc == 0)[..., None], 0.0, jnp.round(n / jnp.where(sc == 0, 1, sc)[..., None]))
    blocks = pack_q3_k(f16_bytes(d), (sc + 32).astype(jnp.int32), q + 4)
    found &= jnp.all(done, axis=-1)
    found &= jnp.all(decode(blocks) == x, axis=-1)
    return found, blocks
