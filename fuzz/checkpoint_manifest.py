"""Fuzzes the checkpoint manifest (`lowbit.io` load path: the manifest's parse, the tree's
decoding against its tensor table, and every QArray's invariants checked on shapes alone, as
`load_checkpoint` does before it reads a tensor), and a stored recipe's comparison.

Contract: `CheckpointError` naming the manifest (or a node or tensor in it), or a plan whose
abstract tree builds.
"""

from __future__ import annotations

from fuzz._contract import documented, main
from fuzz._seeds import manifest_seeds

seeds = manifest_seeds  # what `python -m fuzz` starts the corpus from

_FILE = "ckpt/manifest.json"


def _load():
    global CheckpointError, build_tree, checkpoint, decode_tree, jax, recipe
    import jax

    from lowbit.io import CheckpointError
    from lowbit.io import _checkpoint as checkpoint
    from lowbit.io._manifest import build_tree, decode_tree
    from lowbit.recipes import preset

    recipe = preset("int4_weight_only")


def test_one(data: bytes) -> None:
    # Messages name the manifest file, or (from `build_tree`) the qarray / nm_sparse node.
    with documented((CheckpointError,), (_FILE, "qarray ", "nm_sparse ")):
        manifest = checkpoint._parse_manifest(data, _FILE)
        plan = decode_tree(manifest["tree"], manifest["tensors"], _FILE)
        build_tree(plan, {n: jax.ShapeDtypeStruct(s, d) for n, (d, s) in plan.tensors.items()})
        if manifest["recipe"] is not None:
            try:
                checkpoint._check_recipe(manifest["recipe"], recipe, _FILE)
            except CheckpointError as err:
                if "recipe mismatch" not in str(err) and _FILE not in str(err):
                    raise


if __name__ == "__main__":
    main(test_one, _load)
