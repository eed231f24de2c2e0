"""What every drafter is: a base class with defaults for the optional parts, and a kind.

A drafter keeps its own view of the sequence. The engine calls `prefill` with the prompt,
then each round `propose(k, ...)` and, after verification, `commit(kept, output)` with the
tokens the round emitted (the accepted draft tokens followed by the target's own token) and
what the target computed for them (`TargetOutput`).

A `DrafterKind` is the registry's entry for one kind of drafter (drafters/__init__.py):
how a pair configuration using it is validated, how it is built from a loaded pair, how many
tokens it can draft a round, whether it needs a draft model and whether it uses the server's
history. A new kind is one module (a Drafter and its kind) plus one registry line (the
package's own kinds are in kinds.py).

Nothing here loads MLX (its names appear in annotations only): `PairConfig` validates a
configuration against its kind, and `mlx-spec models` every curated pair, without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import SpecError
from ..models.hub import is_downloaded, resolve_head

if TYPE_CHECKING:
    import mlx.core as mx

    from ..core.sampling import SamplingParams


@dataclass
class TargetOutput:
    """What the target computed over the tokens it was fed in one pass: the unfed tokens of
    the sequence (the last one, or a recurrent target's replay), then the draft tokens. Row i
    is the state at input i. `hidden[layer]` holds that layer's output (fed, hidden size) for
    each layer in the drafter's `hidden_layers`: computed in the same pass as the logits,
    never a second forward. The first `kept` rows are of tokens now in the sequence; the rest
    were rejected (0 when a recurrent target's state went back: the next pass replays them)."""

    logits: mx.array | None  # the rows the engine read, before processors (None: prefill)
    hidden: dict[int, mx.array]  # layer -> (fed, hidden)
    fed: int
    kept: int


class Drafter:
    """Defaults for everything but `propose`; a kind overrides what it needs."""

    steps = 0  # draft-model forward passes the last `propose` queued (0 without a model)
    max_draft: int | None = None  # the most tokens one proposal can hold (None: any k)
    # target layers whose outputs `prefill` and `commit` receive (-1: the last layer;
    # hidden.FINAL_NORM: the final norm's output, what the target's head reads)
    hidden_layers: tuple = ()

    def prefill(
        self, tokens: list[int], timed: bool = False, output: TargetOutput | None = None
    ) -> float | None:
        """Start a new sequence (or continue a cached one) from these tokens. `timed`: return
        the seconds of one draft step, measured on the prompt's last tokens (0 without a model;
        None if the prompt was too short to time). `output`: the target's hidden states over
        the prompt's new tokens, when `hidden_layers` asks for them."""
        return 0.0

    def reset(self) -> None:
        """Forget everything (the next prefill starts from nothing)."""

    def fork(self) -> Drafter:
        """An independent copy of the per-sequence state (Decoder.fork): the two may then go
        on apart, neither touching the other's caches, lists or arrays. Models, heads,
        tokenizers and the history index are shared (read-only). Every kind that keeps state
        defines its own; this default refuses rather than share a state it does not know."""
        raise SpecError(f"a {type(self).__name__} drafter cannot be forked (it defines no fork)")

    def propose(
        self, k: int, params: SamplingParams, key: mx.array | None, *, processors=()
    ) -> tuple[mx.array, mx.array | None]:
        """Up to k draft tokens (k,) and, unless greedy or deterministic, their distributions
        q (k, vocab). Lazy. `processors` (processors.py) transform each draft step's logits as
        the target's are transformed, before sampling. None for q: a point mass on each
        guess (the drafter is deterministic)."""
        raise NotImplementedError

    def commit(self, kept: list[int], output: TargetOutput | None = None) -> None:
        """The round emitted `kept`: the accepted draft tokens, then the target's one.
        `output` (when `hidden_layers` asks): what the target computed for the round's
        inputs; a round's first rows line up with `kept` after the tokens it replayed."""

    def has_proposal(self) -> bool | None:
        """Whether a round now would draft anything, when that is free to tell (prompt
        lookup); None: unknown until proposed."""
        return None

    def catch_up(self) -> None:
        """Take in, in one batched pass, the tokens emitted while the drafter did not run
        (after a plain stretch)."""

    def settle(self) -> None:
        """Evaluate any state kept between replies (see Decoder.settle)."""

    def cache_bytes(self) -> int:
        """Bytes of cache the drafter holds (what the server's prompt cache counts)."""
        return 0

    def held_cache(self) -> tuple[list, list[int]] | None:
        """Its KV cache and the tokens it holds, for a batch row to take over (batch.py;
        a draft model's); None: no cache a batch could take."""
        return None

    def adopt(self, cache: list, cached: list[int], unfed: list[int]) -> None:
        """Continue from a cache built elsewhere (a batch row's, as it leaves) that holds
        `cached`; `unfed` are the sequence's tokens after them."""
        raise SpecError(f"a {type(self).__name__} keeps no cache another could hand it")

    def disk_state(self) -> tuple[list, dict] | None:
        """A head's per-sequence state for the prompt cache's disk tier: (cache layers in
        mlx-lm's cache classes, JSON-able figures with `kind`: the class's name), or None
        where it cannot be stored (the entry then stays in RAM only). Kinds whose state is a
        draft model's cache (`held_cache`) or tokens alone need none."""
        return None

    def restore_disk_state(self, layers: list, figures: dict, target: list) -> None:
        """Take back what `disk_state` gave (a fresh drafter of the same kind and head);
        `target`: the target's restored cache layers, which the decoder adopts next. A state
        of another kind or shape is refused (SpecError), never taken."""
        raise SpecError(f"a {type(self).__name__} drafter keeps no state on disk")

    def use_history(self, history) -> None:
        """Search a history.HistoryIndex of earlier requests too (kinds with uses_history)."""

    def suffix_match(self) -> tuple[int, int] | None:
        """Suffix decoding (suffix.py): (the longest match's length, the longest lookup draft
        it supports); None: a drafter without lookup drafts past k."""
        return None

    def propose_lookup(self, k: int) -> tuple[mx.array, None]:
        """Its lookup draft, k tokens at most (a point mass on each: q None)."""
        raise NotImplementedError


class DrafterKind:
    """A registry entry: one kind of drafter, named as models.toml and --drafter name it."""

    name: str = ""
    needs_model = False  # a draft model must be loaded (--draft or --draft-bits)
    needs_head = False  # a head directory must be named (--head DIR): MTP, EAGLE-3, DFlash
    uses_history = False  # the server hands it a HistoryIndex (prompt lookup across requests)
    max_draft: int | None = None  # the most tokens a round can draft (None: any k)
    # the optional drafter settings of PairConfig it reads; PairConfig refuses the others with
    # one message for every kind (ngram lengths have defaults and are kept for a later switch)
    settings: tuple[str, ...] = ()
    help = ""

    @classmethod
    def validate(cls, config) -> None:
        """Refuse (SpecError, one line) a pair configuration this kind cannot run."""

    @classmethod
    def resolve_head(cls, name: str, target_config: dict, progress=None):
        """The head directory a pair names (a path, package:MODULE/DIR or a hub id),
        downloaded when missing; called by load_pair before any weights are loaded."""
        return resolve_head(name, progress)

    @classmethod
    def head_downloaded(cls, name: str, target: str) -> bool:
        """Whether `resolve_head` would find the head here, without the network."""
        return is_downloaded(name)

    @classmethod
    def load_head(cls, path, target, target_config: dict):
        """A head directory -> the loaded head (an nn.Module), checked against the target;
        called once by load_pair, which evaluates its arrays (threads.py)."""
        raise NotImplementedError

    @classmethod
    def build(cls, pair) -> Drafter:
        """A fresh drafter over a loaded pair (its draft model, its head: `pair.head`)."""
        raise NotImplementedError

    @classmethod
    def history_index(cls, max_tokens: int):
        """The index of a key's earlier requests the server keeps for it (uses_history), or
        None: the server's plain one (decode/history.py's HistoryIndex, prompt lookup's)."""
        return None

    @classmethod
    def batch_drafting(cls, pair) -> dict | None:
        """How a batch of requests drafts with this kind: the keywords of
        `batch.BatchDecoder` (`draft=` a draft model batched like the target, `lookup=`
        (ngram_max, ngram_min) per row or a callable making each row's suffix drafter, also
        beside a draft model or a head, `head=` a head: EAGLE-3, MTP, DFlash, DSpark, Gemma 4's
        assistant); None: not batched yet (the batch then decodes plainly, or the pair runs one
        stream at a time)."""
        return None
