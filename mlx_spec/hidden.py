"""The target's hidden states, read in the pass that computes its logits.

A drafting head (MTP, EAGLE, DFlash) drafts from the target's features at chosen layers. mlx-lm
models return logits only, so for the length of one call the chosen entries of the model's
layer list are wrapped: each wrapper runs its layer and keeps the output. Nothing is computed
twice and the layers themselves are untouched (the list is put back after the call).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .errors import SpecError

# where mlx-lm models keep their decoder stack: Model.model.layers, or under a multimodal
# wrapper's language_model (Gemma 3, Qwen3.5, Mistral 3)
_CHILDREN = ("language_model", "model", "backbone", "transformer")


def layer_list(model) -> list:
    """The list the model's forward pass iterates (a pipeline slice is a copy: not that)."""
    node = model
    for _ in range(4):
        layers = node.get("layers") if isinstance(node, dict) else None
        if isinstance(layers, list) and layers:
            return layers
        node = next((node[n] for n in _CHILDREN if isinstance(node.get(n), nn.Module)), None)
        if node is None:
            break
    raise SpecError(f"cannot find the layers of this {type(model).__name__} to read hidden states")


class _Kept:
    """Stands in for one layer during a call: runs it, keeps its output."""

    def __init__(self, layer, out: dict, index: int):
        self._layer, self._out, self._index = layer, out, index

    def __call__(self, *args, **kwargs):
        y = self._layer(*args, **kwargs)
        self._out[self._index] = y[0] if isinstance(y, tuple) else y
        return y

    def __getattr__(self, name):  # models read layer attributes (is_linear, use_sliding…)
        return getattr(self._layer, name)


@contextmanager
def capturing(model, layers: tuple[int, ...]):
    """`with capturing(model, (2, -1)) as hidden: model(x, cache=c)` -> hidden[2], hidden[-1]
    are those layers' outputs (batch, rows, hidden size), lazy. No layers: a plain call."""
    out: dict[int, mx.array] = {}
    if not layers:
        yield out
        return
    stack = layer_list(model)
    n = len(stack)
    for i in layers:
        if not -n <= i < n:
            raise SpecError(f"the target has {n} layers; cannot read layer {i}")
    saved = {i % n: stack[i % n] for i in layers}
    kept: dict[int, mx.array] = {}
    try:
        for i, layer in saved.items():
            stack[i] = _Kept(layer, kept, i)
        yield out
    finally:
        for i, layer in saved.items():
            stack[i] = layer
        for i in layers:  # under the names the drafter asked for (-1 as -1)
            if i % n in kept:
                out[i] = kept[i % n]
