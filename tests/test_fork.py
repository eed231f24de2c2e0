"""Forks (Decoder.fork, Drafter.fork, caches.copy): a copy of a decoder's whole state that goes
on from where the original stood, losslessly, while the original stays exactly as it was.

Every drafter kind and every cache kind the tiny models give (KV, sliding window with and
without compaction, chunked, recurrent Mamba and hybrid Qwen3.5) is forked after a reply; the
fork continues with a prompt that extends the conversation and with one that branches off
inside the prompt. Its output equals a fresh decoder's; the original's state stays bit for bit
what it was, and its own next turn is the one a copy taken before the fork ran makes (the same
drafts, round by round). `Decoder.reusable` says what `prefill` then reuses.
"""

from __future__ import annotations

import json
import threading
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from mlx_lm.utils import common_prefix_len

from mlx_spec import Decoder, SpecError, generate, load_pair, make_decoder, stream
from mlx_spec.core import caches
from mlx_spec.errors import Aborted

TEXT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."
REPLY = 12
K = 3  # a fixed draft length: the same rounds from the same state (auto reads wall times)
NOISE = {"gemma3_text": 0.02, "qwen3_5": 0.03, "mamba": 0.1}
# attribute names a fork shares on purpose (models are shared as nn.Modules)
SHARED = {"pair", "target", "history"}


# ----------------------------------------------------------------------------- the pairs


@pytest.fixture(scope="module")
def pairs(tiny_models, tmp_path_factory):
    """Pairs by case name: "KIND" on the tiny llama, "KIND/FAMILY" on a family of tiny.py."""
    root = tmp_path_factory.mktemp("fork")
    tok = tiny_models.tokenizer
    configs = {**tiny.family_configs(320), "mamba": {**tiny.mamba_config(320)}}
    configs["mamba"]["tie_word_embeddings"] = False
    dirs, loaded = {}, {}

    def family(name):
        if name not in dirs:
            cfg = configs[name]
            weights = tiny.family_weights(cfg, seed=0)
            target = tiny.write_model(root / name, cfg, weights, tok)
            noisy = tiny.noisy(weights, NOISE.get(name, 0.05))
            draft = tiny.write_model(root / f"{name}-draft", cfg, noisy, tok)
            dirs[name] = (str(target), str(draft), cfg)
        return dirs[name]

    def eagle_head():
        from test_eagle import head_weights, subset, write_head

        cfg = tiny.llama_config(320, layers=4)
        weights = head_weights(cfg, subset(320, 96, seed=1), seed=5, embed=False)
        return write_head(root / "eagle", cfg, weights, ids=[0, 1, 3])

    def block_head(kind, cfg, layer_ids, block_size):
        """A random DFlash or DSpark head (test_dflash's or test_dspark's writer)."""
        module = __import__(f"test_{kind}")
        name = f"{kind}-{cfg['model_type']}"
        config = module.head_config(cfg, layer_ids, block_size=block_size)
        return module.write_head(root / name, config)

    def mtp_pair():
        from test_mtp import original_checkpoint

        from mlx_spec.cli import main

        original_checkpoint(root / "qwen35", 320, tok, agree=0.0)
        assert main(["heads", "extract", str(root / "qwen35"), str(root / "mtp")]) == 0
        return load_pair(target=str(root / "qwen35"), drafter="mtp", head=str(root / "mtp"))

    def assistant_pair():
        """A Gemma 4 target (sliding and full layers, shared keys and values) and its
        assistant (test_gemma4_assistant's writer)."""
        from test_gemma4_assistant import head_config, target_embedding, text_of, write_head

        target = tiny.write_gemma4(root / "gemma4", tok)
        head = write_head(
            root / "assistant", head_config(text_of(target)), target_embedding(target)
        )
        return load_pair(target=str(target), drafter="assistant", head=str(head))

    def build(case):
        target, draft = str(tiny_models.target), str(tiny_models.draft)
        kind, _, fam = case.partition("/")
        if kind == "assistant":
            return assistant_pair()
        if fam == "chunked":  # Llama 4's chunked attention (plain decoding here)
            target = str(tiny_models.chunked)
        elif fam and kind != "mtp":
            target, draft, cfg = family(fam)
        if kind == "model":
            return load_pair(target=target, draft=draft)
        if kind == "plain":
            return load_pair(target=target)
        if kind in ("ngram", "ngram+model"):
            extra = {"draft": draft} if kind == "ngram+model" else {}
            return load_pair(target=target, drafter=kind, **extra)
        if kind == "eagle3":
            return load_pair(target=target, drafter="eagle3", head=str(eagle_head()))
        if kind in ("dflash", "dspark"):
            if fam:
                head = block_head(kind, cfg, [1, 2], 6)
            else:
                llama = json.loads((tiny_models.target / "config.json").read_text())
                head = block_head(kind, llama, [0, 2], 8)
            return load_pair(target=target, drafter=kind, head=str(head))
        if kind == "mtp":
            return mtp_pair()
        raise AssertionError(case)

    def get(case):
        if case not in loaded:
            loaded[case] = build(case)
        return loaded[case]

    return get


# kinds: every kind drafters/__init__.py registers, and plain decoding; caches: KVCache,
# WindowedKVCache (compacting too), ArraysCache alone (mamba) and beside KV (qwen3_5),
# ChunkedKVCache (plain decoding only). No model's cache is a QuantizedKVCache, CacheList or
# ConcatenateKVCache here: caches.copy is tested on those layer by layer below.
CASES = [
    "plain",
    "model",
    "ngram",
    "ngram+model",
    "eagle3",
    "dflash",
    "dspark",
    "mtp/qwen3_5",
    "assistant/gemma4",
    "assistant/gemma4/compacting",
    "model/gemma3_text",
    "model/gemma3_text/compacting",
    "model/mamba",
    "model/qwen3_5",
    "dflash/qwen3_5",
    "dspark/qwen3_5",
    "plain/mamba",
    "plain/chunked",
]


def setup(pairs, case, monkeypatch):
    if case.endswith("/compacting"):  # the buffer drops old rows every few tokens
        monkeypatch.setattr(caches, "WINDOW_MARGIN", 7)
        monkeypatch.setattr(caches, "WINDOW_SLACK", 3)
        case = case.removesuffix("/compacting")
    return pairs(case)


def words(pair, text: str) -> list[int]:
    return pair.tokenizer.encode(text, add_special_tokens=False)


def run(pair, prompt, decoder=None, **kwargs):
    return generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=K, decoder=decoder, **kwargs)


def fresh(pair, prompt) -> list[int]:
    """The target alone on a new decoder."""
    return run(pair, prompt, use_draft=False).tokens


# ----------------------------------------------------------------------------- state helpers


def _skip(x) -> bool:
    plain = (str, bytes, int, float, bool, type(None), nn.Module)
    return isinstance(x, plain) or isinstance(x, types.MethodType | types.FunctionType)


def mutables(x, path="", found=None) -> dict[int, str]:
    """Every mutable object reachable from x (id -> a path to it): lists, dicts, sets, arrays
    and objects; tuples are looked through, models and the SHARED attributes left out."""
    found = {} if found is None else found
    if _skip(x) or id(x) in found:
        return found
    if isinstance(x, tuple):
        for i, v in enumerate(x):
            mutables(v, f"{path}[{i}]", found)
        return found
    found[id(x)] = path or type(x).__name__
    if isinstance(x, mx.array):
        return found
    if isinstance(x, dict):
        items = x.items()
    elif isinstance(x, list | set):
        items = enumerate(x)
    else:
        items = ((k, v) for k, v in getattr(x, "__dict__", {}).items() if k not in SHARED)
    for k, v in items:
        mutables(v, f"{path}.{k}" if not isinstance(k, int) else f"{path}[{k}]", found)
    return found


def assert_disjoint(a, b) -> None:
    """No mutable object is reachable from both: nothing one writes can reach the other."""
    mine, theirs = mutables(a), mutables(b)
    shared = sorted(mine[i] for i in mine.keys() & theirs.keys())
    assert not shared, f"shared with the fork: {shared[:8]}"


def state(x, skip=frozenset()):
    """Everything x holds, arrays as (dtype, shape, bytes): equal states are bit-identical
    (its random key too: a fork changes nothing of the decoder it copies)."""
    if isinstance(x, mx.array):
        a = np.array(x)
        return ("array", a.dtype.str, a.shape, a.tobytes())
    if _skip(x):
        return x if not isinstance(x, nn.Module | types.MethodType) else "shared"
    if isinstance(x, dict):
        return {k: state(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [state(v) for v in x]
    if isinstance(x, set):
        return sorted(x)
    return {k: state(v) for k, v in vars(x).items() if k not in SHARED | skip}


def first_difference(a, b, path="") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a.keys() ^ b.keys())}"
        for k in a:
            if (d := first_difference(a[k], b[k], f"{path}.{k}")) is not None:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (d := first_difference(x, y, f"{path}[{i}]")) is not None:
                return d
        return None
    return None if a == b else f"{path}: differs"


def assert_unchanged(decoder, before) -> None:
    difference = first_difference(before, state(decoder))
    assert difference is None, f"the original changed: {difference}"


# ----------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("case", CASES)
def test_a_fork_goes_on_losslessly_and_leaves_the_original_alone(pairs, case, monkeypatch):
    pair = setup(pairs, case, monkeypatch)
    prompt = words(pair, TEXT)
    decoder = make_decoder(pair)
    run(pair, prompt, decoder)
    if case.endswith("compacting"):
        assert any(c.dropped > 0 for c in decoder.cache if isinstance(c, caches.WindowedKVCache))
    control = decoder.fork()  # the original as it stands: what it would do without the forks
    assert_disjoint(decoder, control)
    before = state(decoder)
    sequence = list(decoder.sequence)
    held = len(sequence) - decoder.unfed
    extend = sequence + words(pair, " and then")
    branch = prompt[:-4] + words(pair, " Rome is")
    assert common_prefix_len(branch, sequence) == len(prompt) - 4  # the branch point
    # (a chunked cache keeps a margin beyond its chunk: it still holds the branch point's
    # chunk; one that had dropped its front once went back and decoded other tokens)
    rolls_back = not (decoder.recurrent or case.endswith("compacting"))
    follows = [(extend, held), (branch, len(prompt) - 4 if rolls_back else 0)]
    for follow, expected in follows:
        twin = decoder.fork()
        assert_disjoint(decoder, twin)
        assert twin.sequence == sequence and twin.unfed == decoder.unfed and not twin.active
        reusable = twin.reusable(follow)
        assert reusable == expected
        res = run(pair, follow, twin)
        assert res.stats.prompt_tokens_reused == reusable
        assert res.tokens == fresh(pair, follow)
        assert_unchanged(decoder, before)  # bit for bit, every cache and list it holds
    # the original's own next turn: what the copy taken before the forks makes, draft for draft
    follow = sequence + words(pair, " but")
    mine, theirs = run(pair, follow, decoder), run(pair, follow, control)
    assert mine.tokens == theirs.tokens == fresh(pair, follow)
    assert mine.rounds == theirs.rounds
    assert mine.stats.prompt_tokens_reused == theirs.stats.prompt_tokens_reused == held


def test_reusable_is_what_prefill_reuses(pairs):
    """Cases beyond the matrix's: a stale decoder (a prefill stopped midway), a reply decoded
    without the drafter (hidden_gap: the head needs the target's rows again from there), a
    recurrent state that cannot go back; reusable() itself changes nothing."""
    eagle = pairs("eagle3")
    prompt = words(eagle, TEXT)
    decoder = make_decoder(eagle)
    run(eagle, prompt, decoder)
    plain_turn = decoder.sequence + words(eagle, " and then")
    run(eagle, plain_turn, decoder, use_draft=False)
    assert decoder.hidden_gap is not None
    follow = decoder.sequence + words(eagle, " but")
    held = len(decoder.sequence) - decoder.unfed
    for use_draft in (True, False):
        twin = decoder.fork()
        assert twin.hidden_gap == decoder.hidden_gap
        offsets = [c.offset for c in twin.cache]
        reusable = twin.reusable(follow, use_draft=use_draft)
        assert [c.offset for c in twin.cache] == offsets and twin.sequence == decoder.sequence
        assert reusable == (decoder.hidden_gap if use_draft else held) and reusable < len(follow)
        assert twin.prefill(follow, use_draft=use_draft) == reusable
    assert decoder.hidden_gap < held  # the gap cost the drafting prefill some reuse

    # stale: a prefill stopped by abort() leaves the caches unknown; the next one starts over
    twin = decoder.fork()
    with pytest.raises(Aborted):
        twin.prefill(prompt[:5] + words(eagle, " Rome is the capital"), abort=lambda: True)
    assert twin.stale and not twin.active
    stale = twin.fork()
    assert stale.stale and stale.reusable(follow) == 0 == stale.prefill(follow)
    assert twin.reusable(follow) == 0 == twin.prefill(follow)

    # recurrent: the state cannot go back, so only a prompt extending the held tokens reuses
    mamba = pairs("model/mamba")
    decoder = make_decoder(mamba)
    prompt = words(mamba, TEXT)
    run(mamba, prompt, decoder)
    held = len(decoder.sequence) - decoder.unfed
    cases = {
        tuple(decoder.sequence + [7]): held,
        tuple(decoder.sequence[:held]): 0,  # the last held token would have to be fed again
        tuple(prompt[:-2] + [9, 9]): 0,
    }
    for follow, expected in cases.items():
        twin = decoder.fork()
        assert twin.reusable(list(follow)) == expected == twin.prefill(list(follow))


def test_an_active_decoder_is_not_forked(pair):
    decoder = make_decoder(pair)
    events = stream(pair, "The quick brown fox", max_tokens=20, decoder=decoder)
    next(events)
    assert decoder.active
    key = np.array(decoder.key)
    with pytest.raises(SpecError, match="while a stream is using it"):
        decoder.fork()
    assert np.array_equal(np.array(decoder.key), key)  # refused before anything changed
    events.close()
    assert not decoder.active
    twin = decoder.fork()
    assert twin.epoch == 0 and not twin.active
    assert not np.array_equal(np.array(twin.key), np.array(decoder.key))  # its own key


def test_a_drafter_kind_without_fork_is_refused(tiny_models):
    from example_kind import RepeatLast

    pair = load_pair(target=str(tiny_models.target))
    decoder = Decoder(pair.target, RepeatLast(), pair.tokenizer.eos_token_ids, seed=0)
    decoder.prefill([5, 6, 7])
    key = np.array(decoder.key)
    with pytest.raises(SpecError, match="RepeatLast drafter cannot be forked"):
        decoder.fork()
    assert np.array_equal(np.array(decoder.key), key)


def test_a_fork_runs_on_another_thread(pair):
    """Nothing lazy crosses: MLX evaluates an array only on the thread that built it."""
    decoder = make_decoder(pair)
    prompt = words(pair, TEXT)
    run(pair, prompt, decoder)
    twin = decoder.fork()
    follow = decoder.sequence + words(pair, " and then")
    out = {}

    def work():
        try:
            out["tokens"] = run(pair, follow, twin).tokens
        except Exception as err:  # reported below
            out["error"] = err

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in out, out.get("error")
    assert out["tokens"] == fresh(pair, follow)


# ----------------------------------------------------------------------------- caches.copy


def kv(n: int, seed: int, dim: int = 8) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 2, n, dim), key=mx.random.key(seed))
    return k, k + 1


def held(c) -> list[np.ndarray]:
    """What a layer holds, as numpy arrays."""
    if isinstance(c, CacheList):
        return [a for x in c.caches for a in held(x)]
    if isinstance(c, ArraysCache):
        return [np.array(a) for a in c.cache if a is not None]
    if isinstance(c, ChunkedKVCache):
        return [np.array(a) for a in c.keys_and_values()]
    k, v = c.keys_and_values()
    if isinstance(c, QuantizedKVCache):
        return [np.array(a) for a in (*k, *v)]
    if isinstance(c, caches.WindowedKVCache | KVCache):
        return [np.array(k[..., : c.size(), :]), np.array(v[..., : c.size(), :])]
    return [np.array(k[..., : c.offset, :]), np.array(v[..., : c.offset, :])]


def write(c, n: int, seed: int) -> None:
    if isinstance(c, CacheList):
        for i, x in enumerate(c.caches):
            write(x, n, seed + i)
    elif isinstance(c, ArraysCache):
        for i in range(len(c.cache)):
            c[i] = mx.random.normal((1, 4), key=mx.random.key(seed + i))
    else:
        dim = 64 if isinstance(c, QuantizedKVCache) else 8
        c.update_and_fetch(*kv(n, seed, dim))
    caches.eval_state([c])


def same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def layers():
    windowed = caches.WindowedKVCache(4, margin=2, slack=2)
    arrays = ArraysCache(2, left_padding=[1])
    arrays.lengths = mx.array([3])
    return {
        "KVCache": KVCache(),
        "WindowedKVCache": windowed,
        "QuantizedKVCache": QuantizedKVCache(group_size=32, bits=4),
        "ConcatenateKVCache": ConcatenateKVCache(),
        "ChunkedKVCache": ChunkedKVCache(6),
        "MarginChunkedKVCache": caches.MarginChunkedKVCache(6, margin=1, slack=1),
        "ArraysCache": arrays,
        "CacheList": CacheList(KVCache(), ArraysCache(1)),
    }


def scalars(c) -> dict:
    return {k: v for k, v in vars(c).items() if isinstance(v, int | float | str | type(None))}


@pytest.mark.parametrize("name", list(layers()))
def test_a_copied_layer_keeps_everything_and_shares_nothing(name):
    """Same attributes, same content; then each side writes (past its end, and after a trim
    into its own buffer, where the copy's shares memory) and the other does not see it."""
    c = layers()[name]
    write(c, 5, seed=0)
    write(c, 4, seed=1)  # the window drops rows: dropped > 0
    if isinstance(c, ChunkedKVCache):
        c.maybe_trim_front()  # the chunk's start moves: start_position > 0
    (twin,) = caches.copy([c])
    assert type(twin) is type(c) and vars(twin).keys() == vars(c).keys()
    # offset, step, window, margin, slack, dropped, group_size, bits, start_position...
    assert scalars(twin) == scalars(c)
    assert_disjoint([c], [twin])
    if name == "WindowedKVCache":
        assert c.dropped > 0
    if isinstance(c, ChunkedKVCache):
        assert c.start_position > 0
    if name == "ArraysCache":
        assert np.array_equal(np.array(twin.left_padding), [1])
        assert np.array_equal(np.array(twin.lengths), [3])
        twin.advance(1)  # `lengths -= 1`: in place, on the copy's own array objects
        assert np.array_equal(np.array(c.lengths), [3])
    original = held(c)
    assert same(held(twin), original)
    assert 0 < caches.nbytes([twin]) <= caches.nbytes([c])
    write(twin, 3, seed=2)
    assert same(held(c), original)
    twin_held = held(twin)
    write(c, 2, seed=3)  # in place, into the buffer the copy's slices were taken from
    assert same(held(twin), twin_held)
    if name not in ("ArraysCache", "CacheList", "ConcatenateKVCache"):  # those cannot trim
        (other,) = caches.copy([c])
        now = held(c)
        assert other.trim(1) == 1
        write(other, 1, seed=4)  # in place, into the slice that shares the original's memory
        assert same(held(c), now)
        assert not same(held(other), now)


def test_a_cache_kind_copy_does_not_know_is_refused():
    class Mine(KVCache):  # a subclass may keep state of its own
        pass

    for layer in (RotatingKVCache(8, keep=4), Mine(), CacheList(KVCache(), Mine())):
        with pytest.raises(caches.CacheCopyError, match="cannot be copied"):
            caches.copy([KVCache(), layer])
