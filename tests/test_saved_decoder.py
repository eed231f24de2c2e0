"""`mlx_spec.save_decoder` / `load_decoder`: a conversation's caches written to a file and read
back, in this process and in another one, so the next turn prefills only what is new; the
reply stays the target's own (greedy equality) for a plain, a sliding-window and a hybrid
target with a draft model, and for prompt lookup; with each head kind (EAGLE-3, DFlash,
DFlash2, DSpark, MTP, Gemma 4's assistant) the loaded head drafts on as the never-saved one. A
file of other models, a damaged one or a head state of another kind or shape is refused in one
line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tiny
from conftest import VOCAB
from test_heads_surfaces import head_pair, target_of, write_heads

import mlx_spec
from mlx_spec import (
    SamplingParams,
    SpecError,
    generate,
    load_decoder,
    load_pair,
    make_decoder,
    save_decoder,
)

TURN1 = [{"role": "user", "content": "Tell me a story about a file"}]


def prompt_ids(pair) -> list[int]:
    return pair.tokenizer.apply_chat_template(TURN1, add_generation_prompt=True)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    """(target, draft) per target kind: plain KV, sliding window, hybrid recurrent."""
    root = tmp_path_factory.mktemp("saved_models")
    families = ("llama", "llama_sliding", "qwen3_5")
    return tiny.family_pairs(root, tiny_models.tokenizer, VOCAB, families)


def turn2(pair, first) -> list[int]:
    """The next turn as token ids: the first prompt, its reply, more (a recurrent state only
    continues a sequence it holds exactly; text would be re-tokenized)."""
    return first.prompt_ids + first.tokens + pair.tokenizer.encode(" And then?")


def ask(pair, prompt, **kw):
    result = generate(pair, prompt, max_tokens=12, temperature=0.0, **kw)
    result.prompt_ids = list(prompt) if isinstance(prompt[0], int) else None
    return result


@pytest.mark.parametrize(
    "family, drafter",
    [
        ("llama", "model"),
        ("llama", "ngram"),
        ("llama_sliding", "model"),
        ("qwen3_5", "model"),
    ],  # fmt: skip
)
def test_a_saved_conversation_continues_exactly(models, tmp_path, family, drafter):
    target, draft = models[family]
    pair = load_pair(target=str(target), draft=str(draft) if drafter == "model" else None)
    pair = pair.configured(drafter="ngram") if drafter == "ngram" else pair
    decoder = make_decoder(pair)
    first = ask(pair, prompt_ids(pair), decoder=decoder)
    path = save_decoder(decoder, tmp_path / "conversation.safetensors")
    if family == "llama":  # the rows the KV caches hold, not their 256-position buffers
        held = sum(c.keys[..., : c.offset, :].nbytes * 2 for c in decoder.cache)
        drafted = decoder.drafter.held_cache()
        held += sum(c.keys[..., : c.offset, :].nbytes * 2 for c in (drafted or [[]])[0])
        assert held < path.stat().st_size < 1.1 * held + 65536, (path.stat().st_size, held)
    loaded = load_decoder(pair, path)
    second = ask(pair, turn2(pair, first), decoder=loaded)
    fresh = ask(pair, turn2(pair, first))
    assert second.tokens == fresh.tokens
    assert second.stats.prompt_tokens_reused >= first.stats.prompt_tokens  # turn 1's prompt


HEADS = ["eagle3", "dflash", "dflash2", "dspark", "mtp", "assistant"]


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    """A tiny Qwen3.5 target with a head of each kind, Gemma 4 with its assistant."""
    return write_heads(tmp_path_factory.mktemp("saved_heads"), tiny_models.tokenizer, HEADS)


def proposal(decoder, k: int = 3) -> list[int]:
    """The tokens the decoder's drafter would propose now, greedy (on a copy: the decoder
    itself is left as it was)."""
    tokens, _ = decoder.fork().drafter.propose(k, SamplingParams(), None)
    return tokens.tolist()


@pytest.mark.parametrize("kind", HEADS)
def test_a_saved_conversation_with_a_head_drafts_on_as_before(heads, tmp_path, kind):
    """A head's state (Drafter.disk_state) goes to the file and comes back whole: the loaded
    head proposes what the kept one proposes, the next turn drafts and accepts round for
    round as the never-saved decoder does, and its tokens are the target's alone."""
    pair = head_pair(heads, kind)
    decoder = make_decoder(pair)
    first = ask(pair, prompt_ids(pair), decoder=decoder)
    path = save_decoder(decoder, tmp_path / "conversation.safetensors")
    loaded = load_decoder(pair, path)
    assert loaded.hidden_gap is None
    assert proposal(loaded) == proposal(decoder) and len(proposal(decoder)) > 0
    prompt = turn2(pair, first)
    second = ask(pair, prompt, decoder=loaded)
    kept = ask(pair, prompt, decoder=decoder)
    alone = ask(load_pair(target=str(target_of(heads, kind))), prompt)
    assert second.tokens == kept.tokens == alone.tokens
    assert second.accepted == kept.accepted  # round for round the same proposals kept
    assert (second.stats.drafted, second.stats.accepted) == (kept.stats.drafted,
                                                             kept.stats.accepted)  # fmt: skip
    assert second.stats.drafted > 0
    assert second.stats.prompt_tokens_reused == kept.stats.prompt_tokens_reused
    assert second.stats.prompt_tokens_reused >= first.stats.prompt_tokens


@pytest.mark.parametrize("kind", ["dflash", "assistant", "suffix+eagle3", "suffix+dflash"])
def test_a_batch_rows_head_state_is_saved_and_drafts_on(heads, tmp_path, kind):
    """A row leaving a batch (the server's kept entry of a batched request: `into_decoder`)
    holds its head's state as the batch made it (the assistant's keys and values as arrays,
    not the target's layers): saved and loaded, it proposes and drafts as the row's own.
    A `suffix+<head>` row's head becomes its decoder's suffix drafter's inner one (its
    features all there: no prefill again)."""
    from mlx_spec import GenerationConfig
    from mlx_spec.decode.batch_rows import into_decoder
    from mlx_spec.decode.generate import make_batch_decoder

    pair = head_pair(heads, kind.removeprefix("suffix+"))
    pair = pair.configured(drafter=kind) if kind.startswith("suffix+") else pair
    config = GenerationConfig(max_tokens=10, temperature=0.0, num_draft_tokens=3)
    batch = make_batch_decoder(pair, 2)
    prompt = prompt_ids(pair)
    row = batch.add(prompt, config, keep=True)
    batch.add(prompt[:-3] + pair.tokenizer.encode(" other"), config)
    tokens, state = [], None
    while len(batch):
        for rid, u in batch.step().items():
            if rid == row:
                tokens += u.tokens
                state = u.state if u.done else state
    kept = into_decoder(make_decoder(pair), state)
    assert kept.hidden_gap is None
    loaded = load_decoder(pair, save_decoder(kept, tmp_path / "row.safetensors"))
    assert proposal(loaded) == proposal(kept) and len(proposal(kept)) > 0
    follow = prompt + tokens + pair.tokenizer.encode(" And then?")
    second, again = ask(pair, follow, decoder=loaded), ask(pair, follow, decoder=kept)
    assert second.tokens == again.tokens
    if not kind.startswith("suffix+"):  # (a lookup round's length follows the timings)
        assert second.accepted == again.accepted
    assert second.stats.prompt_tokens_reused >= len(prompt)


def test_a_head_without_a_plain_replys_features_is_not_saved_until_it_drafts(heads, tmp_path):
    """After a reply decoded without the head (`use_draft=False`) the head lacks its features
    (Decoder.hidden_gap): no file is written then; the next drafting turn fills them in."""
    pair = head_pair(heads, "dflash")
    decoder = make_decoder(pair)
    first = ask(pair, prompt_ids(pair), decoder=decoder)
    plain = ask(pair, turn2(pair, first), decoder=decoder, use_draft=False)
    with pytest.raises(SpecError, match="lacks the features"):
        save_decoder(decoder, tmp_path / "c.safetensors")
    prompt = turn2(pair, first) + plain.tokens + pair.tokenizer.encode(" More?")
    ask(pair, prompt, decoder=decoder)
    loaded = load_decoder(pair, save_decoder(decoder, tmp_path / "c.safetensors"))
    assert proposal(loaded) == proposal(decoder)


@pytest.mark.parametrize("kind", ["dflash", "mtp", "assistant"])
def test_a_head_state_of_another_kind_or_shape_is_refused(heads, tmp_path, kind):
    """A file whose head state is not this head's (another kind's figures, a layer missing,
    an array of another shape) is refused in one line, never continued from."""
    from mlx_lm.models.cache import ArraysCache

    from mlx_spec.core.cache_files import file_info, header_metadata, read_cache_file
    from mlx_spec.core.cache_files import restore_decoder as restore

    pair = head_pair(heads, kind)
    decoder = make_decoder(pair)
    ask(pair, prompt_ids(pair), decoder=decoder)
    path = save_decoder(decoder, tmp_path / "c.safetensors")
    info = file_info(header_metadata(path))
    layers, _ = read_cache_file(path)
    other = dict(info, head=dict(info["head"], kind="EagleDrafter"))
    with pytest.raises(SpecError, match="is a 'EagleDrafter' one"):
        restore(make_decoder(pair), layers, other)
    with pytest.raises(SpecError, match="stored .* holds layers"):
        restore(make_decoder(pair), layers[:-1], dict(info, draft=info["draft"] - 1))
    last = layers[-1]
    if isinstance(last, ArraysCache):
        last.cache = [None if a is None else a[..., :-1] for a in last.cache]
    else:
        last.keys = last.keys[..., :-1]
    with pytest.raises(SpecError, match="stored .* shape|stored .* keys"):
        restore(make_decoder(pair), layers, info)


def test_another_process_continues_from_the_file(models, tmp_path):
    target, draft = models["llama"]
    pair = load_pair(target=str(target), draft=str(draft))
    decoder = make_decoder(pair)
    first = ask(pair, prompt_ids(pair), decoder=decoder)
    save_decoder(decoder, tmp_path / "c.safetensors")
    script = f"""
import json, mlx_spec
pair = mlx_spec.load_pair(target={str(target)!r}, draft={str(draft)!r})
d = mlx_spec.load_decoder(pair, {str(tmp_path / "c.safetensors")!r})
r = mlx_spec.generate(pair, {json.dumps(turn2(pair, first))}, max_tokens=12, temperature=0.0,
                      decoder=d)
print(json.dumps({{"tokens": r.tokens, "reused": r.stats.prompt_tokens_reused}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    fresh = ask(pair, turn2(pair, first))
    assert got["tokens"] == fresh.tokens and got["reused"] >= first.stats.prompt_tokens


def test_other_models_or_a_damaged_file_are_refused(models, tmp_path):
    target, draft = models["llama"]
    pair = load_pair(target=str(target), draft=str(draft))
    decoder = make_decoder(pair)
    generate(pair, TURN1, max_tokens=4, temperature=0.0, decoder=decoder)
    path = save_decoder(decoder, tmp_path / "c.safetensors")
    other = load_pair(target=str(models["llama_sliding"][0]))
    with pytest.raises(SpecError, match="saved for other models"):
        load_decoder(other, path)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(SpecError, match="cannot be loaded|is not a saved decoder"):
        load_decoder(pair, path)
    with pytest.raises(SpecError, match="holds nothing"):
        save_decoder(make_decoder(pair), tmp_path / "empty.safetensors")
    assert mlx_spec.load_decoder is load_decoder
