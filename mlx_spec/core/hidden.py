"""The target's hidden states, read in the pass that computes its logits.

A drafting head (MTP, EAGLE, DFlash) drafts from the target's features at chosen layers. mlx-lm
models return logits only, so for the length of one call the chosen entries of the model's
layer list are wrapped: each wrapper runs its layer and keeps the output. Nothing is computed
twice and the layers themselves are untouched (the list is put back after the call).
Captures nest on one thread; two overlapping on different threads would not (the model's list
is shared): the thread that owns the models (threads.py) is the only one that runs them.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.nn as nn

from ..errors import SpecError

# where mlx-lm models keep their decoder stack: Model.model.layers, or under a multimodal
# wrapper's language_model (Gemma 3, Qwen3.5, Mistral 3)
_CHILDREN = ("language_model", "model", "backbone", "transformer")
# the name a drafter asks for the final norm's output by (MTP heads read it), beside layer ids
FINAL_NORM = "norm"
KV = "kv"


def kv_of(layer: int) -> tuple:
    """The name a drafter asks for a layer's keys and values by (Gemma 4's assistant attends
    to them): what the layer's attention read in the pass, i.e. its cache's whole content
    after the pass wrote to it — one `LayerKV` per batch row. Layers that return (hidden,
    (keys, values), ...) only (mlx-lm's gemma4_text)."""
    return (KV, layer)


class LayerKV(tuple):
    """One row's keys and values of a layer in a pass. With a cache (`cache`: the layer's
    cache object, which the drafter reads when it needs to) it is empty: the arrays the
    attention read are views of the cache's buffer, and a view still held when a later pass
    writes into the buffer makes that write copy the whole buffer. Without one, (keys,
    values), each (kv heads, positions, head dim), the last column the pass's last token."""

    cache = None


def is_kv(name) -> bool:
    return isinstance(name, tuple) and len(name) == 2 and name[0] == KV


def decoder_stack(model) -> nn.Module:
    """The module whose `layers` list the forward pass iterates (a pipeline slice is a copy:
    not that) and which holds the final `norm`."""
    node = model
    for _ in range(4):
        layers = node.get("layers") if isinstance(node, dict) else None
        if isinstance(layers, list) and layers:
            return node
        node = next((node[n] for n in _CHILDREN if isinstance(node.get(n), nn.Module)), None)
        if node is None:
            break
    raise SpecError(f"cannot find the layers of this {type(model).__name__} to read hidden states")


def layer_list(model) -> list:
    return decoder_stack(model)["layers"]


class _Kept:
    """Stands in for one layer (or the final norm) during a call: runs it, keeps its output
    (under `name`) and, asked for (`kv_name`), the keys and values its attention read."""

    def __init__(self, layer, out: dict, name, kv_name=None):
        self._layer, self._out, self._name, self._kv_name = layer, out, name, kv_name

    def __call__(self, *args, **kwargs):
        y = self._layer(*args, **kwargs)
        if self._name is not None:
            self._out[self._name] = y[0] if isinstance(y, tuple) else y
        if self._kv_name is not None:
            kv = y[1] if isinstance(y, tuple) and len(y) > 1 else None
            if not (isinstance(kv, tuple) and len(kv) == 2):
                raise SpecError(f"this {type(self._layer).__name__} returns no keys and values")
            keys, values = kv
            cache = args[2] if len(args) > 2 else kwargs.get("cache")
            rows = []
            for b in range(keys.shape[0]):
                row = LayerKV(() if cache is not None else (keys[b], values[b]))
                row.cache = cache
                rows.append(row)
            self._out[self._kv_name] = rows
        return y

    def __getattr__(self, name):  # models read layer attributes (is_linear, use_sliding…)
        return getattr(self._layer, name)


@contextmanager
def capturing(model, layers: tuple):
    """`with capturing(model, (2, -1, FINAL_NORM)) as hidden: model(x, cache=c)`: after the
    block, hidden[2], hidden[-1] are those layers' outputs and hidden["norm"] the final
    norm's (batch, rows, hidden size), lazy; hidden[kv_of(3)] layer 3's keys and values, a
    list of (keys, values) per batch row (see kv_of). No layers: a plain call."""
    out: dict = {}
    if not layers:
        yield out
        return
    stack = decoder_stack(model)
    blocks = stack["layers"]
    n = len(blocks)
    for i in layers:
        if i == FINAL_NORM:
            if not isinstance(stack.get("norm"), nn.Module):
                raise SpecError(f"this {type(model).__name__} has no final norm to read")
            continue
        j = i[1] if is_kv(i) else i
        if isinstance(j, bool) or not isinstance(j, int) or not -n <= j < n:
            raise SpecError(f"the target has {n} layers; cannot read layer {i!r}")
    outputs = {i % n for i in layers if isinstance(i, int)}
    keys = {i[1] % n for i in layers if is_kv(i)}
    saved = {i: blocks[i] for i in sorted(outputs | keys)}
    kept: dict = {}
    norm = stack["norm"] if FINAL_NORM in layers else None
    try:
        for i, layer in saved.items():
            blocks[i] = _Kept(
                layer, kept, i if i in outputs else None, (KV, i) if i in keys else None
            )
        if norm is not None:
            stack[FINAL_NORM] = _Kept(norm, kept, FINAL_NORM)
        yield out
    finally:
        for i, layer in saved.items():
            blocks[i] = layer
        if norm is not None:
            stack[FINAL_NORM] = norm
        for i in layers:  # under the names the drafter asked for (-1 as -1)
            key = i if i == FINAL_NORM else (KV, i[1] % n) if is_kv(i) else i % n
            if key in kept:
                out[i] = kept[key]
