"""The server's prompt cache (server/prompt_cache.py): a trie of kept decoders that hands out
copies, keeps every branch, checkpoints caches that cannot roll back, and evicts in mlx-lm's
order."""

from __future__ import annotations

import random

import numpy as np
import pytest
from mlx_lm.utils import common_prefix_len

from mlx_spec import GenerationConfig
from mlx_spec.decode.generate import generate, make_decoder
from mlx_spec.decode.prompts import encode_prompt
from mlx_spec.server.prompt_cache import Entry, PromptCache, PromptTrie, trim

# ----------------------------------------------------------------------------- the trie


def brute_search(kept: dict, tokens: list[int]) -> tuple[set, int, set]:
    """What PromptTrie.search must answer, from the definition."""
    along = {k for k in kept if len(k) <= len(tokens) and list(k) == tokens[: len(k)]}
    depth = max((common_prefix_len(list(k), tokens) for k in kept), default=0)
    below = {k for k in kept if common_prefix_len(list(k), tokens) == depth and len(k) > depth}
    return along, depth, below


def test_trie_agrees_with_brute_force_on_random_operations():
    rng = random.Random(0)
    trie, kept = PromptTrie(), {}
    for _ in range(3000):
        base = rng.choice(list(kept)) if kept and rng.random() < 0.7 else ()
        cut = rng.randint(0, len(base))
        tokens = list(base[:cut]) + [rng.randint(0, 3) for _ in range(rng.randint(0, 5))]
        op = rng.random()
        if op < 0.45 and tokens:
            previous = trie.add(tokens, tuple(tokens))
            assert previous == kept.get(tuple(tokens))
            kept[tuple(tokens)] = tuple(tokens)
        elif op < 0.75 and kept:
            victim = rng.choice(list(kept))
            assert trie.pop(list(victim)) == victim
            del kept[victim]
        else:
            along, depth, below = trie.search(tokens)
            want_along, want_depth, want_below = brute_search(kept, tokens)
            assert [len(v) for v in along] == sorted(len(v) for v in along)  # shortest first
            assert set(along) == want_along
            assert depth == want_depth  # no path is left where no kept sequence runs
            assert set(below) == want_below
        assert trie.size == len(kept)
        assert sorted(trie.values()) == sorted(kept.values())


def test_trie_pop_refuses_what_it_does_not_hold_and_prunes():
    trie = PromptTrie()
    trie.add([1, 2, 3, 4], "long")
    trie.add([1, 2, 9], "branch")
    with pytest.raises(KeyError):
        trie.pop([1, 2])  # a node where they part, holding nothing
    with pytest.raises(KeyError):
        trie.pop([1, 2, 3])  # inside a run
    assert trie.pop([1, 2, 9]) == "branch"
    # the parting node is gone: one edge holds the whole remaining sequence
    assert list(trie.root.edges.values())[0][0] == (1, 2, 3, 4)
    assert trie.search([1, 2, 3, 4, 5]) == (["long"], 4, [])


# ----------------------------------------------------------------------- eviction order


class Kept:
    """Just what `trim` reads of a decoder: its tokens."""

    def __init__(self, tokens):
        self.sequence = tokens


def test_trim_evicts_assistant_before_user_before_system_unless_outnumbered():
    cache = PromptCache(None, 0, None)
    made = {}
    for i, (segment, t) in enumerate(
        [("system", 1), ("user", 2), ("assistant", 3), ("assistant", 4), ("user", 5)]
    ):
        entry = Entry(Kept([i]), segment, 10, last_used=float(t))
        cache.trie.add([i], entry)
        cache.bytes += 10
        made[i] = entry
    order = []
    for budget in (40, 30, 20, 10, 0):
        trim([cache], budget)
        order += [i for i, e in made.items() if e not in cache.trie.values() and i not in order]
    # two assistant, two user: the oldest assistant; then one assistant < two users: the
    # oldest user; then the last assistant; then user (1 user >= 1 system); then system
    assert order == [2, 1, 3, 4, 0]
    assert cache.bytes == 0


# --------------------------------------------------------------- decoders: every branch kept


def ids(pair, text):
    return encode_prompt(pair.tokenizer, text)


def held(decoder):
    """The target cache's keys, as numbers (to tell whether anything wrote into them)."""
    return [np.array(c.keys[..., : c.offset, :]) for c in decoder.cache]


def test_a_branch_and_its_parent_both_reuse_the_shared_part(pair):
    cache = PromptCache(pair, 1 << 30, None)
    system = ids(pair, "You are a careful assistant. " * 12)
    parent = system + ids(pair, " Fix the parser in parse.py please.")
    first = cache.take(parent)
    generate(pair, parent, max_tokens=12, decoder=first)
    cache.save(first, "assistant")
    parent_seq = list(first.sequence)
    entry_keys = held(first)

    # a sub-task: the same system prompt, then another conversation
    sub = system + ids(pair, " List the files under src/.")
    branch = cache.fetch(sub)
    assert branch is not first and branch.sequence == parent_seq  # a copy, not the entry
    want = generate(pair, sub, max_tokens=12, decoder=make_decoder(pair)).tokens
    got = generate(pair, sub, max_tokens=12, decoder=branch)
    assert got.tokens == want  # lossless from a copy rolled back to where they part
    assert got.stats.prompt_tokens_reused >= len(system) - 1
    cache.save(branch, "assistant")
    assert all((a == b).all() for a, b in zip(held(first), entry_keys, strict=True))  # untouched

    # the parent's next turn still finds its own conversation, whole
    follow = parent_seq + ids(pair, " Now add a test.")
    again = cache.fetch(follow)
    assert again.sequence == parent_seq
    done = generate(pair, follow, max_tokens=8, decoder=again)
    assert done.stats.prompt_tokens_reused == len(parent_seq) - 1
    assert done.tokens == generate(pair, follow, max_tokens=8, decoder=make_decoder(pair)).tokens
    assert cache.trie.size == 2  # parent and sub-task, each one leaf


def test_a_saved_sequence_replaces_the_prefixes_it_extends(pair):
    cache = PromptCache(pair, 1 << 30, None)
    prompt = ids(pair, "Once upon a time")
    d = cache.take(prompt)
    generate(pair, prompt, max_tokens=6, decoder=d)
    cache.save(d, "assistant")
    longer = cache.take(d.sequence + ids(pair, " and then"))
    generate(pair, d.sequence + ids(pair, " and then"), max_tokens=6, decoder=longer)
    cache.save(longer, "assistant")
    assert [e.decoder for e in cache.entries] == [longer]  # plain KV: the longer serves both
    assert cache.bytes == cache.entries[0].bytes


def test_a_decoder_left_mid_round_is_not_kept(pair):
    cache = PromptCache(pair, 1 << 30, None)
    prompt = ids(pair, "Once upon a time")
    d = cache.take(prompt)
    generate(pair, prompt, max_tokens=6, decoder=d)
    d.active = True  # as after an exception inside a round
    cache.save(d, "assistant")
    assert cache.trie.size == 0 and cache.bytes == 0


def test_recurrent_caches_are_kept_at_the_segment_ends(tiny_models):
    from mlx_spec import load_pair

    pair = load_pair(target=str(tiny_models.mamba), draft=None, drafter="ngram")
    cache = PromptCache(pair, 1 << 30, None)
    assert not cache.freely
    system = ids(pair, "You are a careful assistant. " * 8)
    parent = system + ids(pair, " Fix the parser.")
    marks = cache.marks(parent, len(system))
    assert marks == (len(system), len(parent) - 1)
    d = cache.take(parent)

    def keep(mark):
        cache.keep_copy(d, "user" if mark == len(parent) - 1 else "system")

    from mlx_spec.decode.generate import stream_rounds

    for _ in stream_rounds(pair, parent, None, decoder=d, marks=marks, on_mark=keep):
        pass
    cache.save(d, "assistant")
    assert sorted(e.segment for e in cache.entries) == ["assistant", "system", "user"]

    sub = system + ids(pair, " List the files.")
    branch = cache.fetch(sub)  # the system checkpoint: a recurrent state cannot roll back
    got = generate(pair, sub, max_tokens=10, decoder=branch)
    assert got.stats.prompt_tokens_reused == len(system)
    assert got.tokens == generate(pair, sub, max_tokens=10, decoder=make_decoder(pair)).tokens

    # the reply re-rendered otherwise (a template that drops thinking): the prompt's end
    rerendered = parent + ids(pair, " Something else entirely.")
    resumed = cache.fetch(rerendered)
    got = generate(pair, rerendered, max_tokens=10, decoder=resumed)
    assert got.stats.prompt_tokens_reused == len(parent) - 1
    fresh = generate(pair, rerendered, max_tokens=10, decoder=make_decoder(pair))
    assert got.tokens == fresh.tokens


def test_copies_kept_while_a_seeded_reply_prefills_do_not_change_its_samples(tiny_models):
    """The server keeps copies (forks) of a recurrent target's decoder as its prompt is
    prefilled; a seeded sampled reply (a fixed k: `auto`'s choices follow the clock) then
    draws what it draws without them. (Each fork split
    the decoder's key: the first send of a seeded request differed from every later send,
    found by an adversarial run against a served Qwen3.5-shaped pair.)"""
    from mlx_spec import load_pair
    from mlx_spec.decode.generate import stream_rounds

    pair = load_pair(target=str(tiny_models.mamba), draft=None, drafter="ngram")
    cache = PromptCache(pair, 1 << 30, None)
    system = ids(pair, "You are a careful assistant. " * 8)
    prompt = system + ids(pair, " Tell me about giraffes in the snow.")
    marks = cache.marks(prompt, len(system))
    assert len(marks) == 2
    config = GenerationConfig(max_tokens=16, temperature=0.9, seed=42, num_draft_tokens=2)
    d = cache.take(prompt)
    kept = []

    def keep(mark):
        kept.append(mark)
        cache.keep_copy(d, "system")

    events = [e for batch in stream_rounds(pair, prompt, config, decoder=d, marks=marks,
                                          on_mark=keep) for e in batch]  # fmt: skip
    assert kept == list(marks)
    alone = generate(pair, prompt, config, decoder=make_decoder(pair))
    assert [e.token for e in events] == alone.tokens
    again = generate(pair, prompt, config, decoder=cache.fetch(prompt))  # from the kept copy
    assert again.tokens == alone.tokens


def test_a_recurrent_server_keeps_the_system_part_for_a_sub_task(tiny_models, tmp_path):
    """Through a real server process on a recurrent target (its state cannot roll back): the
    system prompt's end is found from the chat template and checkpointed as the parent's
    prompt is prefilled, so a sub-task reuses it; the parent's next turn reuses its whole
    conversation; every reply is the target's own."""
    import openai
    from test_server import serving

    from mlx_spec import load_pair
    from mlx_spec.server.prompts import system_end
    from mlx_spec.server.protocol import GenRequest

    pair = load_pair(target=str(tiny_models.mamba), draft=None, drafter="ngram")
    system = {"role": "system", "content": "You are a careful coding agent. " * 6}
    parent = [system, {"role": "user", "content": "Fix the parser in parse.py."}]
    sub = [system, {"role": "user", "content": "List every file under src."}]
    parent_ids = encode_prompt(pair.tokenizer, parent)
    shared = common_prefix_len(parent_ids, encode_prompt(pair.tokenizer, sub))
    req = GenRequest(kind="chat", model="m", prompt=parent, max_tokens=8)
    end = system_end(pair, req, parent_ids)
    assert 40 < end <= shared  # the system part, found by rendering it alone

    args = ["--target", str(tiny_models.mamba), "--drafter", "ngram", "--num-draft-tokens", "3"]
    with serving(args, tmp_path) as (_, url):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)

        model = client.models.list().data[0].id

        def ask(messages):
            r = client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0
            )
            want = generate(pair, messages, max_tokens=8, temperature=0).text
            assert r.choices[0].message.content == want
            return r

        # first (lookup then searches no earlier reply, as generate's): a seeded sampled reply
        # draws what generate draws, though its decoder is forked at the system part's end and
        # the prompt's as it prefills (each fork split its key: it drew other samples)
        seeded = [system, {"role": "user", "content": "Giraffes in the snow."}]
        settings = dict(max_tokens=8, temperature=0.9, seed=42)
        r = client.chat.completions.create(model=model, messages=seeded, **settings)
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # (its copies: made, not used)
        want = generate(pair, seeded, num_draft_tokens=3, **settings).text
        assert r.choices[0].message.content == want

        r1 = ask(parent)
        rs = ask(sub)
        assert rs.usage.prompt_tokens_details.cached_tokens == end
        turn2 = parent + [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "Now add a test."},
        ]
        r2 = ask(turn2)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1
