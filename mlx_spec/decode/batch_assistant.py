"""Gemma 4's assistant drafting for a batch's rows (batch.py), each row as it drafts alone.

The assistant (drafters/assistant.py) keeps no cache of its own: it attends to the target's
keys and values. So where the other heads keep a batched cache beside the target's
(batch_head.py's BatchHead), `AssistantBatch` keeps one state per row and reads each row's
keys and values from the batch's target cache itself, after the round's roll-back. It answers
what batch.py asks of a BatchHead; `batch_head` picks the one a head needs.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.hidden import FINAL_NORM
from ..drafters.assistant import AssistantDrafter, AssistantHead
from ..drafters.base import TargetOutput
from .batch_head import BatchHead, own_drafter


class AssistantBatch:
    """Gemma 4's assistant (drafters/assistant.py) drafting for a batch's rows, each as alone.

    It keeps no cache and no entries: per row only the target's final-norm state at the
    position before its last token (taken from every pass, drafting or plain: `take`). Each
    round it attends to the batch's own target cache as it stands after the last round's
    roll-back (`target_cache()`, the BatchDecoder's): every row's tokens end at the buffer's
    column `_idx - 1`, its left padding before them, so one additive mask per layer type keeps
    each row to what it sees alone — all its keys for a full layer, its last `window - 1` for a
    sliding one — and its queries sit at its own position (`at`, the last token's). Plays
    BatchHead's part (batch.py asks the same of both); a row that leaves hands back an
    AssistantDrafter holding what a single stream's would (its state, its keys and values as
    views of the row's cache)."""

    block = False  # one step a token, chained on its own state
    chained = selects = False
    max_draft = None
    cache = None  # (none of its own)

    def __init__(self, head, target, target_cache):
        self.head, self.target, self.kind = head, target, self
        self.target_cache = target_cache  # () -> the batch's target cache (a list per layer)
        self.hidden_layers = AssistantDrafter(head, target).hidden_layers
        self.embed = AssistantDrafter(head, target).embed
        self.states: list = []  # per row: (backbone,) or None (nothing to draft from yet)

    def kept_drafter(self, kept):
        d = own_drafter(kept)
        ok = isinstance(d, AssistantDrafter) and d.head is self.head
        return d.fork() if ok else None

    def prefill(self, prompt: list[int], hidden: dict, fed: int, kept=None, timed=False):
        """A joining row's state, as the single stream's prefill makes it (and, `timed`, one
        step's seconds over the row's own keys and values)."""
        drafter = kept if kept is not None else AssistantDrafter(self.head, self.target)
        output = TargetOutput(None, hidden, fed, fed) if fed else None
        seconds = drafter.prefill(prompt, timed, output)
        state = drafter.state[0] if drafter.state is not None else None
        return state, (seconds if timed and state is not None else None)

    def join(self, state) -> None:
        self.states.append(state)

    def keep(self, keep: list[int]) -> None:
        self.states = [self.states[i] for i in keep]

    def can_draft(self, b: int) -> bool:
        return self.states[b] is not None

    def feed(self, sequences) -> None:
        """(No entries to make.)"""

    def forget(self, chained: int) -> None:
        """(No chained entries to drop.)"""

    def _shared(self, sequences) -> tuple[dict, dict, mx.array]:
        """{type: (keys, values)} (B, heads, S, d) of the target layers read, {type: mask}
        and each row's query position."""
        cache = self.target_cache()
        kv, masks = {}, {}
        for kind, i in self.head.reads.items():
            c = cache[i]
            idx = c._idx
            keys, values = c.keys[..., :idx, :], c.values[..., :idx, :]
            first = c.left_padding  # (B,) each row's first column
            if kind == "sliding_attention":
                first = mx.maximum(first, idx - (self.head.window - 1))
            cols = mx.arange(idx)[None]
            seen = (cols >= first[:, None]) | (cols == idx - 1)  # (a row with no keys: any)
            mask = mx.where(seen, 0.0, -mx.inf).astype(keys.dtype)
            kv[kind], masks[kind] = (keys, values), mask[:, None, None, :]
        positions = mx.array([len(s) - 1 for s in sequences])
        return kv, masks, positions

    def draft_logits(self, j, picks, sequences, width: int, process=None):
        """Step j's logits for every row (B, vocab): fed each row's last token (j = 0) or
        the guess it drew at step j - 1, chained on the step's own state."""
        if j == 0:
            self._kv, self._masks, self._positions = self._shared(sequences)
            some = next((s for s in self.states if s is not None), None)
            zeros = mx.zeros(
                (self.head.args.backbone_hidden_size,),
                some.dtype if some is not None else mx.float32,
            )
            self._state = mx.stack([s if s is not None else zeros for s in self.states])[:, None]
            tokens = mx.array([s[-1] for s in sequences], mx.uint32)
        else:
            tokens = picks.astype(mx.uint32)
        e = self.embed(tokens)[:, None] * self.head.embed_scale
        x = mx.concatenate([e.astype(self._state.dtype), self._state], axis=-1)
        logits, self._state = self.head.step(x, self._kv, self._positions, self._masks)
        if j == width - 1:  # the last step: hold no view of the target's cache past it (a
            # held view would make the verify pass's write copy the whole buffer)
            self._kv = self._masks = self._state = None
        return logits

    def take(self, hidden: dict, kept: list[int], sequences, starts=None) -> None:
        """Row b's state: the final-norm row of the last of its `kept[b]` positions."""
        rows = hidden[FINAL_NORM]  # (B, width, H)
        for b, n in enumerate(kept):
            if n:
                start = starts[b] if starts is not None else 0
                self.states[b] = rows[b, start + n - 1]

    def extract(self, b: int, sequence: list[int]):
        drafter = AssistantDrafter(self.head, self.target)
        at = len(sequence) - 1
        drafter.tokens, drafter.target_at = list(sequence), at
        state = self.states[b]
        drafter.state = state[None] if state is not None else None
        cache = self.target_cache()
        for i in set(self.head.reads.values()):
            c = cache[i]
            pad = int(c.left_padding[b].item())
            held = c._idx - pad
            keys = mx.contiguous(c.keys[b, :, pad : c._idx])
            values = mx.contiguous(c.values[b, :, pad : c._idx])
            drafter.kv[i] = (keys, values, at - held)
        return drafter

    def arrays(self) -> list:
        return [s for s in self.states if s is not None]


def batch_head(head, target, target_cache):
    """The batch's head: Gemma 4's assistant reads the target's cache (`target_cache()`),
    the others keep their own (BatchHead)."""
    if isinstance(head, AssistantHead):
        return AssistantBatch(head, target, target_cache)
    return BatchHead(head, target)
