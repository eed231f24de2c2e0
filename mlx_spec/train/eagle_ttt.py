"""EAGLE-3 test-time training (SafeAILab/EAGLE `cnets.py`, SpecForge `core/eagle3.py`): the
target's features at three layers and its top logits per position (`target_features`), batches
of them (`make_batch`), the head's chained forward over `steps` draft steps (`ttt_forward`), its
loss and its held-out agreement. `eagle_head.py` runs the recipe around these.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from ..core.hidden import capturing
from ..drafters.eagle import Eagle3Head
from .common import Sequence

STEP_WEIGHT = 0.8  # EAGLE-3: step i's loss weighs 0.8^i


# the target's logits kept per position: its distribution over the draft vocabulary is
# learned from these (a tail beyond them weighs little), a 64th of keeping the whole draft row
TOP_K = 64


LOGIT_FLOOR = -1e4  # every other logit: exp(floor - lse) is 0 in float32


@dataclasses.dataclass
class Batch:
    feats: mx.array  # (B, T, 3H) the target's three layers
    tokens: mx.array  # (B, T)
    logits: mx.array  # (B, T, Vd) the target's logits over the draft vocabulary (TOP_K kept)
    lse: mx.array  # (B, T) logsumexp of the target's full logits
    argmax: mx.array  # (B, T) the target's argmax (target ids)
    reply: mx.array  # (B, T) 1 where row m predicts a reply token (m + 1 >= start)
    in_vocab: mx.array  # (B, T) 1 where the target's argmax is in the draft vocabulary


def position_records(hidden: dict, layers: tuple, logits: mx.array) -> tuple:
    """One target pass's training records, per position: the three layers' features, the
    TOP_K largest logits (ids, values), logsumexp and argmax; lazy."""
    feats = mx.concatenate([hidden[j] for j in layers], -1).astype(mx.float16)  # (B, n, 3H)
    logits = logits.astype(mx.float32)  # (B, n, V)
    top = mx.argpartition(-logits, TOP_K - 1, axis=-1)[..., :TOP_K].astype(mx.int32)
    values = mx.take_along_axis(logits, top, -1).astype(mx.float16)  # (B, n, TOP_K)
    return feats, top, values, mx.logsumexp(logits, -1), mx.argmax(logits, -1).astype(mx.int32)


def item(records: list, tokens: list[int], start: int) -> dict:
    """One sequence's training item from its records (numpy, one row per position)."""
    feats, top, values, lse, argmax = (np.concatenate(r) for r in zip(*records, strict=True))
    return {
        "feats": feats, "top": top, "values": values, "lse": lse, "argmax": argmax,
        "tokens": np.array(tokens, np.int32), "start": start,
    }  # fmt: skip


def window_item(it: dict, max_length: int) -> dict:
    """The last `max_length` positions (features read with the whole prompt before them)."""
    cut = max(0, len(it["tokens"]) - max_length)
    if not cut:
        return it
    out = {k: v[cut:] for k, v in it.items() if k != "start"}
    return {**out, "start": max(1, it["start"] - cut)}


def target_features(pair, layers: tuple, seqs: list[Sequence], batch_size: int,
                    progress) -> list[dict]:  # fmt: skip
    """One target pass per batch of sequences (right-padded; causal, so padding changes
    nothing before it): each sequence's training item."""
    out = []
    for i in range(0, len(seqs), batch_size):
        progress(f"the target's features: {min(i + batch_size, len(seqs))}/{len(seqs)} sequences")
        part = seqs[i : i + batch_size]
        width = max(len(s.tokens) for s in part)
        tokens = np.zeros((len(part), width), np.int32)
        for b, s in enumerate(part):
            tokens[b, : len(s.tokens)] = s.tokens
        with capturing(pair.target, layers) as hidden:
            logits = pair.target(mx.array(tokens))  # (B, T, V)
        records = position_records(hidden, layers, logits)  # captures land as the block ends
        mx.eval(records)
        records = [np.array(r) for r in records]
        for b, s in enumerate(part):
            n = len(s.tokens)
            out.append(item([[r[b, :n] for r in records]], s.tokens, s.start))
    return out


def make_batch(items: list[dict], head: Eagle3Head) -> Batch:
    width = max(len(it["tokens"]) for it in items)
    B = len(items)
    vd = int(head._to_target.shape[0])
    gather = np.array(head._gather)  # target id -> draft id (vd: none)

    def pad(key, shape, dtype):
        a = np.zeros((B, width, *shape), dtype)
        for b, it in enumerate(items):
            a[b, : len(it[key])] = it[key]
        return a

    # the target's kept logits scattered into the draft vocabulary; the rest LOGIT_FLOOR (a
    # finite floor: a row with none of its TOP_K in the vocabulary stays a finite uniform,
    # and is masked out by in_vocab)
    logits = np.full((B, width, vd + 1), LOGIT_FLOOR, np.float16)
    for b, it in enumerate(items):
        n = len(it["tokens"])
        np.put_along_axis(logits[b, :n], gather[it["top"]], it["values"], -1)
    argmax = pad("argmax", (), np.int32)
    reply = np.zeros((B, width), np.float32)
    for b, it in enumerate(items):
        reply[b, it["start"] - 1 : len(it["tokens"]) - 1] = 1  # row m predicts token m + 1
    return Batch(
        feats=mx.array(pad("feats", items[0]["feats"].shape[1:], np.float16)),
        tokens=mx.array(pad("tokens", (), np.int32)),
        logits=mx.array(logits[..., :vd]),
        lse=mx.array(pad("lse", (), np.float32)),
        argmax=mx.array(argmax),
        reply=mx.array(reply),
        in_vocab=mx.array((gather[argmax] < vd).astype(np.float32)),
    )


def _attention(attn, x, offset: int, keys: list, values: list):
    """The head's attention at one TTT step. x (B, n, 2H): entries 0..n-1 of this step, at
    positions j + offset. keys/values hold the earlier steps' (step 0: every real entry;
    later steps: their entry j, the chained entry a query at j sees); this step's are added."""
    B, n, _ = x.shape
    nh, nkv = attn.n_heads, attn.n_kv_heads
    q = attn.q_proj(x).reshape(B, n, nh, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, n, nkv, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, n, nkv, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
    keys.append(k)
    values.append(v)
    d = q.shape[-1]
    q = q.reshape(B, nkv, nh // nkv, n, d) * attn.scale  # (B, kv, rep, n, d)
    k0, v0 = keys[0][:, :, None, :n], values[0][:, :, None, :n]  # (B, kv, 1, n, d)
    scores = (q @ k0.swapaxes(-1, -2)).astype(mx.float32)  # (B, kv, rep, n, n)
    causal = mx.tril(mx.ones((n, n), mx.bool_))
    scores = mx.where(causal, scores, -mx.inf)
    diag = [(q * ks[:, :, None, :n]).sum(-1, keepdims=True) for ks in keys[1:]]  # (.., n, 1)
    probs = mx.softmax(mx.concatenate([scores, *diag], -1) if diag else scores, -1)
    probs = probs.astype(q.dtype)
    o = probs[..., :n] @ v0  # (B, kv, rep, n, d)
    for s, vs in enumerate(values[1:]):
        o = o + probs[..., n + s : n + s + 1] * vs[:, :, None, :n]
    o = o.reshape(B, nh, n, d).transpose(0, 2, 1, 3).reshape(B, n, nh * d)
    return attn.o_proj(o)


def _layer(layer, embeds, h, offset, keys, values):
    """FirstLayer's forward (drafters/eagle.py) with the TTT attention."""
    if layer.norm_before_residual:
        h = residual = layer.hidden_norm(h)
    else:
        residual, h = h, layer.hidden_norm(h)
    x = mx.concatenate([layer.input_layernorm(embeds), h], axis=-1)
    h = residual + _attention(layer.self_attn, x, offset, keys, values)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def ttt_forward(head: Eagle3Head, batch: Batch, steps: int):
    """Per step i: (the head's draft-vocabulary logits (B, n_i, Vd), the rows of the target
    they are scored against), n_i = T - 1 - i. Entry j of step i reads token j + 1 + i and
    predicts token j + i + 2, scored against the target's row j + i + 1."""
    B, T, _ = batch.feats.shape
    embeds = mx.stop_gradient(head.embed(batch.tokens)).astype(head.fc.weight.dtype)
    h = head.fuse_joined(batch.feats)  # (B, T, H), as drafting fuses them
    keys, values, outs = [], [], []
    for i in range(steps):
        n = T - 1 - i
        if n <= 0:
            break
        g = _layer(head.midlayer, embeds[:, 1 + i : 1 + i + n], h[:, :n], i, keys, values)
        outs.append((head.lm_head(head.norm(g)).astype(mx.float32), slice(1 + i, 1 + i + n)))
        h = g  # the head's own output: the next step's features (drafting chains so)
    return outs


def ttt_loss(head: Eagle3Head, batch: Batch, steps: int) -> mx.array:
    total = mx.array(0.0)
    for i, (logits, rows) in enumerate(ttt_forward(head, batch, steps)):
        target = batch.logits[:, rows].astype(mx.float32)
        p = mx.softmax(target, -1)  # the target restricted to the draft vocabulary
        ce = -(p * (logits - mx.logsumexp(logits, -1, keepdims=True))).sum(-1)  # (B, n)
        mask = batch.reply[:, rows] * batch.in_vocab[:, rows]
        total = total + STEP_WEIGHT**i * (ce * mask).sum() / mx.maximum(mask.sum(), 1)
    return total


def evaluate(head: Eagle3Head, items: list[dict], steps: int, batch_size: int) -> dict:
    """Offline, teacher-forced on held-out sequences, per draft step: greedy agreement (the
    head's argmax is the target's, out-of-vocabulary targets counted as misses) and
    Σ min(p, q) against the target's full distribution; and the tokens per target pass a
    greedy chain of `steps` drafts would give (1 + the mean run of agreeing steps)."""
    agree = np.zeros(steps)
    accept = np.zeros(steps)
    count = np.zeros(steps)
    runs = 0.0
    starts = 0.0
    for i in range(0, len(items), batch_size):
        batch = make_batch(items[i : i + batch_size], head)
        run = None
        for s, (logits, rows) in enumerate(ttt_forward(head, batch, steps)):
            mask = batch.reply[:, rows]  # (B, n)
            guess = head._to_target[mx.argmax(logits, -1)].astype(mx.int32)
            same = (guess == batch.argmax[:, rows]).astype(mx.float32)
            p = mx.exp(batch.logits[:, rows].astype(mx.float32) - batch.lse[:, rows, None])
            overlap = mx.minimum(p, mx.softmax(logits, -1)).sum(-1)
            n = same.shape[1]
            run = same if run is None else run[:, :n] * same  # all steps so far agreed
            if s == 0:
                base = mask
            a, o, c, r = mx.stack([
                (same * mask).sum(), (overlap * mask).sum(), mask.sum(),
                (run * base[:, :n]).sum(),
            ]).tolist()  # fmt: skip
            agree[s] += a
            accept[s] += o
            count[s] += c
            runs += r
        starts += float(base.sum().item())
    count = np.maximum(count, 1)
    return {
        "greedy_agreement": (agree / count).tolist(),
        "acceptance_t1": (accept / count).tolist(),
        "tokens_per_pass_offline": 1 + runs / max(starts, 1),
        "positions": int(count[0]),
    }
