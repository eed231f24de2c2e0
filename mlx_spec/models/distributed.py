"""Several machines: the target split tensor-parallel over an `mx.distributed` group.

`mlx.launch` starts one process per rank; each loads the target and shards it with mlx-lm's
own `Model.shard(group)` (every attention and MLP block ends in an all-reduce), and loads the
draft whole. Every rank then runs the same decode loop on the same tokens: the draft and prompt
lookup propose the same guesses everywhere, the all-reduced logits are bitwise equal on every
rank (the ring backend reduces each segment on one rank and gathers the result), and the same
random keys make the same acceptance decisions. So nothing but the target's own all-reduces
crosses the link, except small broadcasts of what is rank-local: a seed drawn when none is
given, and the timings the `auto` controller learns from (clocks differ by rank).

A verify pass over k+1 tokens costs the same number of all-reduces as a plain step over one,
so speculation divides the link's latency per token by the tokens a round keeps.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..core.policies import Auto, Controller, DraftLength
from ..errors import SpecError
from .model_dir import text_config

# set by mlx.launch (ring, JACCL: MLX_RANK; MPI: OMPI_/PMI_; NCCL: MLX_WORLD_SIZE)
LAUNCH_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE")
# config keys that a tensor-parallel split divides by the group size
DIVIDED_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
CALIBRATION_REPEATS = 8


def launched() -> bool:
    return any(v in os.environ for v in LAUNCH_VARIABLES)


def world():
    """The group `mlx.launch` started this process in, or None when it runs alone (a group
    of one is the single-process path, untouched)."""
    if not launched():
        return None
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile is not None and _blank(hostfile):
        return None  # `mlx.launch -n 1` writes an empty ring hostfile, which init cannot parse
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def _blank(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return not f.read().strip()
    except OSError:
        return False


def broadcast(group, values: list[int]) -> list[int]:
    """Rank 0's integers on every rank (one all-reduce; the others contribute zeros)."""
    mine = mx.array(values, mx.int32) * (group.rank() == 0)
    return mx.distributed.all_sum(mine, group=group).tolist()


# ------------------------------------------------------------------------------ sharding


def check_divisible(config: dict, size: int) -> None:
    """Heads and MLP width must split evenly, or the shards would not add up to the model."""
    cfg = text_config(config)
    for key in DIVIDED_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and value % size:
            raise SpecError(
                f"the target's {key} ({value}) does not divide by the group size {size}; "
                "run it on a group whose size divides its heads and MLP width"
            )


def shard(model, config: dict, group) -> None:
    """Split `model` tensor-parallel over `group` with mlx-lm's own `shard`, in place."""
    kind = config.get("model_type", "?")
    if not hasattr(model, "shard"):
        raise SpecError(
            f"mlx-lm cannot split a {kind} model tensor-parallel (it can: llama, qwen2, qwen3, "
            "qwen3_moe, qwen3_5, gpt_oss, deepseek_v2/v3, glm4_moe, minimax and a few more)"
        )
    check_divisible(config, group.size())
    try:
        model.shard(group)
    except (ValueError, TypeError, AttributeError) as err:
        raise SpecError(
            f"cannot split the {kind} target over {group.size()} ranks: {err}"
        ) from None


def collectives_per_pass(model) -> int:
    """Collectives in one forward pass of a sharded model: counted while its graph is built
    (never run), since their number depends on the layers, not on the tokens fed."""
    from mlx_lm.models.cache import make_prompt_cache

    calls = 0
    real = {name: getattr(mx.distributed, name) for name in ("all_sum", "all_gather")}

    def counted(op):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            return op(*args, **kwargs)

        return call

    for name, op in real.items():
        setattr(mx.distributed, name, counted(op))
    try:
        model(mx.array([[0]], mx.uint32), cache=make_prompt_cache(model))
    finally:
        for name, op in real.items():
            setattr(mx.distributed, name, op)
    return calls


def time_all_sum(group, width: int, rows: int, dtype) -> float:
    """Seconds one all-reduce of (rows, width) activations takes on this group."""
    x = mx.zeros((rows, width), dtype)
    mx.eval(mx.distributed.all_sum(x, group=group))  # warm-up
    start = time.perf_counter()
    for _ in range(CALIBRATION_REPEATS):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - start) / CALIBRATION_REPEATS


@dataclass
class Link:
    """The target's group and what its collectives cost: counted per forward pass, timed by a
    calibration at load (an all-reduce's latency + per-row cost, measured on this group)."""

    group: object
    per_pass: int  # collectives in one target forward pass
    latency: float = 0.0  # seconds per collective of one row
    per_row: float = 0.0  # extra seconds per further row
    collectives: int = 0  # so far, this process
    seconds: float = 0.0  # estimated time in them so far
    passes: int = 0  # target forward passes so far

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()

    def __deepcopy__(self, memo) -> Link:
        """The one link of the process, shared by a copy of what holds it (a forked decoder's
        `auto` policy): its group cannot be copied, and its counts are the process's."""
        return self

    def count_pass(self, rows: int) -> None:
        self.passes += 1
        self.count(self.per_pass, rows)

    def count(self, collectives: int, rows: int = 1) -> None:
        self.collectives += collectives
        self.seconds += collectives * (self.latency + self.per_row * max(0, rows - 1))

    def calibrate(self, width: int, dtype) -> None:
        one = time_all_sum(self.group, width, 1, dtype)
        many = time_all_sum(self.group, width, 16, dtype)
        self.latency, self.per_row = one, max(0.0, (many - one) / 15)


def count_passes(model, link: Link) -> None:
    """Count every forward pass of `model` (the engine's, mlx-lm's) on `link`: its class is
    swapped for a subclass whose __call__ counts, so the model object stays the same."""
    base = type(model)

    def __call__(self, inputs, *args, **kwargs):
        link.count_pass(inputs.shape[-1])
        return base.__call__(self, inputs, *args, **kwargs)

    model.__class__ = type(base.__name__, (base,), {"__call__": __call__})


def sharded(model, config: dict, group) -> Link:
    """Shard a lazily loaded target, load its slice of the weights, and measure the link."""
    shard(model, config, group)
    mx.eval(model.parameters())
    # every rank has its weights before the first collective (a slow loader would time out)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    link = Link(group, collectives_per_pass(model))
    text = text_config(config)
    link.calibrate(int(text.get("hidden_size", 1024)), _activation_dtype(model))
    count_passes(model, link)
    return link


def _activation_dtype(model):
    from mlx.utils import tree_flatten

    for _, w in tree_flatten(model.parameters()):
        if mx.issubdtype(w.dtype, mx.floating):
            return w.dtype
    return mx.float16


# ------------------------------------------------------------------ agreement between ranks


def agreed_seed(pair, seed: int | None) -> int | None:
    """No seed given on a group: rank 0 draws one and every rank uses it (else each would
    seed from its own clock and sample differently)."""
    link = getattr(pair, "link", None)
    if seed is not None or link is None:
        return seed
    drawn = secrets.randbits(62)
    parts = broadcast(link.group, [(drawn >> s) & 0x7FFF_FFFF for s in (0, 31)])
    link.count(1)
    return parts[0] | parts[1] << 31


def broadcast_floats(group, values: list[float]) -> list[float]:
    """Rank 0's numbers on every rank, as float32 (rank 0 gets the rounded values too)."""
    mine = mx.array(values, mx.float32) * (group.rank() == 0)
    return mx.distributed.all_sum(mine, group=group, stream=mx.cpu).tolist()


def _floats(values) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, tuple):
            out += _floats(v)
        elif isinstance(v, float):
            out.append(v)
    return out


def _replace_floats(values: tuple, agreed) -> tuple:
    """`values` with each float, in order, taken from the iterator `agreed`."""

    def one(v):
        if isinstance(v, tuple):
            return _replace_floats(v, agreed)
        return next(agreed) if isinstance(v, float) else v

    return tuple(one(v) for v in values)


class AgreedController(Controller):
    """`auto` on a group. Every rank must choose the same k, plain stretch, timed prefill and
    split rounds, but each times rounds with its own clock. So each rank holds its
    measurements back and, when the next choice is due, all apply rank 0's (one small
    broadcast per choice): the controllers' states stay equal, and so does all they decide."""

    def __init__(self, link: Link, *args):
        super().__init__(*args)
        self.link = link
        self.held: list[tuple] = []  # (method, arguments): measurements not yet agreed

    def update(self, *args) -> None:
        self.held.append((super().update, args))

    def update_plain(self, *args) -> None:
        self.held.append((super().update_plain, args))

    def calibrate(self, *args) -> None:
        self.held.append((super().calibrate, args))

    def next(self, available: bool | None = None) -> int:
        self.agree()
        return super().next(available)

    def agree(self) -> None:
        """Apply the held measurements with rank 0's timings. Their shape (which calls, which
        arguments are None) is the same on every rank: it follows from equal states."""
        values = _floats(tuple(args for _, args in self.held))
        agreed = iter(broadcast_floats(self.link.group, values) if values else [])
        if values:
            self.link.count(1)
        for method, args in self.held:
            method(*_replace_floats(args, agreed))
        self.held = []


@dataclass(frozen=True)
class AgreedAuto(Auto):
    link: Link | None = field(default=None, compare=False, hash=False)

    def policy(self, max_draft: int | None = None) -> Controller:
        limit = self.k_max if max_draft is None else min(self.k_max, max_draft)
        return AgreedController(self.link, limit)


def agreed_length(pair, length: DraftLength) -> DraftLength:
    """A fixed k needs no agreement; `auto` on a group follows rank 0."""
    link = getattr(pair, "link", None)
    if link is None or not isinstance(length, Auto) or isinstance(length, AgreedAuto):
        return length
    return AgreedAuto(length.k_max, link)


# ----------------------------------------------------------------------------- output


@contextlib.contextmanager
def rank_zero_prints(pair):
    """On a group, only rank 0 writes to stdout and stderr; errors still surface on every rank
    (the CLI prints them after this block)."""
    link = getattr(pair, "link", None)
    if link is None or link.rank == 0:
        yield
        return
    with open(os.devnull, "w") as null:
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = null
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved
