"""The prompt cache's disk tier (server/disk_cache.py) on real `mlx-spec serve` processes:
entries survive a clean stop and `kill -9`, an entry the RAM budget evicted is loaded from
disk, a reloaded entry continues exactly as without one (greedy text equal to
`mlx_spec.generate`) for a plain, a sliding-window and a hybrid (recurrent) target with a
draft model and with prompt lookup, another key never reads a key's entries, a corrupt or
truncated file is removed with one log line (never loaded), and a bad --cache-dir is one line
and exit code 2.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import tiny
from conftest import VOCAB
from test_server import KEY, metrics, start_server, stop_server

from mlx_spec import generate, load_pair

OTHER, ADMIN = "other-key", "admin-key"
SYSTEM = " ".join(f"Rule {i}: answer in one word and name the file." for i in range(12))
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which file?"}]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    """(target, draft) per target kind: plain KV, sliding window, hybrid recurrent."""
    root = tmp_path_factory.mktemp("disk_models")
    families = ("llama", "llama_sliding", "qwen3_5")
    return tiny.family_pairs(root, tiny_models.tokenizer, VOCAB, families)


class Server:
    def __init__(self, args: list[str], log: Path):
        self.log = log
        self.file = open(log, "a")
        self.proc, self.url = start_server(args, self.file)
        self.client = openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=60)

    def ask(self, messages=ASK, key: str = KEY, max_tokens: int = 8):
        client = self.client if key == KEY else self.client.with_options(api_key=key)
        r = client.chat.completions.create(
            model=self.model(), messages=messages, max_tokens=max_tokens, temperature=0
        )
        return r.choices[0].message.content, r.usage

    def model(self) -> str:
        return self.client.models.list().data[0].id

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        else:
            stop_server(self.proc)
        self.file.close()


def args_for(target, draft, drafter: str, cache_dir: Path, *extra) -> list[str]:
    args = ["--target", str(target), "--api-key", KEY, "--api-key", OTHER, "--cache-dir",
            str(cache_dir), "--drafter", drafter, "--num-draft-tokens", "3"]  # fmt: skip
    args += ["--draft", str(draft)] if "model" in drafter else []
    return args + list(extra)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def wait_for_files(folder: Path, n: int = 1, timeout: float = 30) -> list[Path]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = sorted(p for p in folder.rglob("*.safetensors") if not p.name.startswith("."))
        if len(files) >= n:
            return files
        time.sleep(0.1)
    raise AssertionError(f"no cache file appeared in {folder}")


def wait_for_writes(server: Server, timeout: float = 30) -> dict:
    """/metrics once the disk tier has written something (the file is then indexed too)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        figures = metrics(server.url, key=ADMIN)
        if figures["mlx_spec_disk_cache_written_bytes_total"] > 0:
            return figures
        time.sleep(0.1)
    raise AssertionError("the disk tier wrote nothing")


@pytest.mark.parametrize(
    "family, drafter",
    [
        ("llama", "ngram+model"),
        ("llama", "ngram"),
        ("llama_sliding", "model"),
        ("qwen3_5", "model"),
    ],  # fmt: skip
)
def test_a_restart_reuses_the_prompt_and_continues_exactly(models, tmp_path, family, drafter):
    target, draft = models[family]
    pair = load_pair(target=str(target), draft=str(draft) if "model" in drafter else None)
    pair = pair.configured(drafter=drafter) if drafter == "ngram" else pair
    expected = generate(pair, ASK, max_tokens=8, temperature=0.0, num_draft_tokens=3)
    args = args_for(target, draft, drafter, tmp_path / "cache")
    first = Server(args, tmp_path / "a.log")
    text, usage = first.ask()
    first.stop()  # a clean stop: the queued writes finish before the exit
    assert cached(usage) == 0 and text == expected.text
    second = Server(args, tmp_path / "b.log")
    try:
        text, usage = second.ask()
    finally:
        second.stop()
    assert text == expected.text
    assert cached(usage) >= 0.9 * usage.prompt_tokens, (usage, (tmp_path / "b.log").read_text())


def test_kill_9_loses_nothing_kept_and_another_key_reads_nothing(models, tmp_path):
    target, draft = models["llama"]
    args = args_for(target, draft, "ngram+model", tmp_path / "cache")
    first = Server(args, tmp_path / "a.log")
    text, _ = first.ask()
    wait_for_files(tmp_path / "cache")  # the reply's entry (it makes the prompt's redundant)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    second = Server(args, tmp_path / "b.log")
    try:
        other_text, other = second.ask(key=OTHER)
        again, usage = second.ask()
    finally:
        second.stop()
    assert cached(other) == 0 and other_text == text  # another key: its own prefill
    assert cached(usage) >= 0.9 * usage.prompt_tokens and again == text
    # on disk: no key, files 0600 in 0700 folders
    for path in (tmp_path / "cache").rglob("*"):
        assert KEY not in path.name and OTHER not in path.name
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_an_entry_evicted_from_ram_is_loaded_from_disk(models, tmp_path):
    target, draft = models["llama"]
    args = args_for(target, draft, "ngram+model", tmp_path / "cache", "--prompt-cache", "1K",
                    "--admin-key", ADMIN)  # fmt: skip
    server = Server(args, tmp_path / "a.log")
    try:
        text, _ = server.ask()
        wait_for_writes(server)
        again, usage = server.ask()  # the RAM budget (1K) kept nothing
        figures = metrics(server.url, key=ADMIN)
    finally:
        server.stop()
    assert figures["mlx_spec_disk_cache_hits_total"] == 1
    assert figures["mlx_spec_disk_cache_read_bytes_total"] > 0
    assert again == text and cached(usage) >= 0.9 * usage.prompt_tokens


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_file_is_removed_never_loaded(models, tmp_path, damage):
    target, draft = models["llama"]
    args = args_for(target, draft, "ngram+model", tmp_path / "cache")
    first = Server(args, tmp_path / "a.log")
    text, _ = first.ask()
    first.stop()
    files = wait_for_files(tmp_path / "cache", 1)
    damaged = {}
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "corrupt":
            data[-100] ^= 0xFF  # inside the arrays: the header still reads
        else:
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))
        damaged[path.name] = bytes(data)
    second = Server(args, tmp_path / "b.log")
    try:
        again, usage = second.ask()
    finally:
        second.stop()
    assert again == text
    assert cached(usage) < 0.5 * usage.prompt_tokens  # nothing damaged was loaded
    assert "prompt cache on disk: removed" in (tmp_path / "b.log").read_text()
    # what is on disk now is whole again (the reply's entry written anew)
    for path in (tmp_path / "cache").rglob("*.safetensors"):
        assert path.read_bytes() != damaged.get(path.name)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache-dir", "FILE"], "is not a directory"),
        (["--cache-disk-bytes", "0"], "--cache-disk-bytes"),
    ],  # fmt: skip
)
def test_a_bad_cache_folder_is_one_line_and_exit_2(models, tmp_path, flags, message):
    target, _ = models["llama"]
    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    r = subprocess.run(
        [sys.executable, "-m", "mlx_spec", "serve", "--target", str(target), "--port", "0",
         *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_spec", "cache", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_cache_command_lists_prunes_and_removes(models, tmp_path):
    target, draft = models["llama"]
    folder = tmp_path / "cache"
    server = Server(args_for(target, draft, "ngram+model", folder), tmp_path / "a.log")
    server.ask()
    server.ask([{"role": "user", "content": "Something else entirely"}])
    server.stop()
    listed = cli("ls", "--cache-dir", str(folder))
    assert listed.returncode == 0, listed.stderr
    assert "2 entries" in listed.stdout and str(target) in listed.stdout  # (model.json)
    model = listed.stdout.splitlines()[1].split()[0]
    assert (folder / model).is_dir()
    files = sorted(folder.rglob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    pruned = cli("prune", "--cache-dir", str(folder), "--max-bytes", str(files[-1].stat().st_size))
    assert pruned.returncode == 0 and "removed 1 entries" in pruned.stdout, pruned
    assert [p.exists() for p in files] == [False, True]  # the least recently used went
    bad = cli("rm", "--cache-dir", str(folder))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert cli("rm", model, "--cache-dir", str(folder)).returncode == 0
    assert not (folder / model).exists() and (folder / "secret").exists()


def test_two_servers_on_one_folder_share_it_whole(models, tmp_path):
    """Two servers write the same folder at once: every file reads back (unique temporary
    names, atomic renames), and each finds the other's entries after a restart."""
    target, draft = models["llama"]
    folder = tmp_path / "cache"
    args = args_for(target, draft, "ngram+model", folder)
    a, b = Server(args, tmp_path / "a.log"), Server(args, tmp_path / "b.log")
    asks = [[{"role": "user", "content": f"Question number {i} about files"}] for i in range(4)]
    try:
        texts = {}
        for i, ask in enumerate(asks):
            texts[i] = (a if i % 2 else b).ask(ask)[0]
    finally:
        a.stop()
        b.stop()
    c = Server(args, tmp_path / "c.log")
    try:
        for i, ask in enumerate(asks):
            text, usage = c.ask(ask)
            assert text == texts[i] and cached(usage) >= 0.9 * usage.prompt_tokens
    finally:
        c.stop()
    assert "removed" not in (tmp_path / "c.log").read_text()


def test_a_full_disk_turns_the_tier_off_and_requests_go_on(models, tmp_path):
    """Writes past a file-size limit fail (EFBIG, as a full disk's ENOSPC): one warning, RAM
    only from then on, every request answered."""
    import resource

    target, draft = models["llama"]
    args = args_for(target, draft, "ngram+model", tmp_path / "cache")
    limit = (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)  # inherited by the server process
    try:
        server = Server(args, tmp_path / "a.log")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    try:
        text, _ = server.ask()
        time.sleep(1)  # (the write fails on the writer thread)
        again, usage = server.ask()
    finally:
        server.stop()
    assert again == text and cached(usage) >= 0.9 * usage.prompt_tokens  # from RAM
    log = (tmp_path / "a.log").read_text()
    assert log.count("prompt cache on disk turned off (RAM only)") == 1, log
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    assert not list((tmp_path / "cache").rglob(".tmp-*"))


def test_another_servers_temporary_file_is_left_alone(models, tmp_path):
    """A write in progress (another server's, or one `kill -9` cut) is a dot-named temporary
    file: the index neither loads nor removes it (it removed a live server's temporary file,
    whose rename then failed)."""
    target, draft = models["llama"]
    args = args_for(target, draft, "ngram+model", tmp_path / "cache")
    first = Server(args, tmp_path / "a.log")
    first.ask()
    first.stop()
    (entry,) = wait_for_files(tmp_path / "cache")
    partial = entry.with_name(".tmp-1-abc.safetensors")
    partial.write_bytes(entry.read_bytes()[:100])
    second = Server(args, tmp_path / "b.log")
    try:
        _, usage = second.ask()
    finally:
        second.stop()
    assert cached(usage) >= 0.9 * usage.prompt_tokens
    assert partial.exists() and "removed" not in (tmp_path / "b.log").read_text()


def test_a_pair_swap_finds_the_other_pairs_entries_on_disk(models, tiny_models, tmp_path):
    """--allow-swap drops the swapped-out pair's RAM caches; its entries stay on disk and the
    next request for it reads them back."""
    target, draft = models["llama"]
    catalog = tmp_path / "models.toml"
    catalog.write_text(
        f'[pairs."tiny2"]\ntarget = "{tiny_models.target2}"\ndraft = "{tiny_models.draft2}"\n'
    )
    args = args_for(target, draft, "ngram+model", tmp_path / "cache", "--allow-swap")
    with open(tmp_path / "a.log", "w") as log:
        proc, url = start_server(args, log, env={"MLX_SPEC_MODELS": str(catalog)})
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)

    def ask(model):
        r = client.chat.completions.create(model=model, messages=ASK, max_tokens=8,
                                           temperature=0)  # fmt: skip
        return r.choices[0].message.content, r.usage

    try:
        text, _ = ask("llama")
        ask("tiny2")  # the swap: llama's RAM entries are gone
        again, usage = ask("llama")  # and back
    finally:
        stop_server(proc)
    assert again == text and cached(usage) >= 0.9 * usage.prompt_tokens


def test_a_file_copied_into_another_keys_folder_is_refused(models, tmp_path):
    """The partition folders are an HMAC of the key; a file moved into another key's folder
    (or another model's) says so in its own metadata and is removed, never loaded."""
    import shutil

    from mlx_spec.core.cache_files import file_info, header_metadata

    target, draft = models["llama"]
    args = args_for(target, draft, "ngram+model", tmp_path / "cache")
    first = Server(args, tmp_path / "a.log")
    first.ask()
    first.ask([{"role": "user", "content": "Hi"}], key=OTHER)
    first.stop()
    files = wait_for_files(tmp_path / "cache", 2)
    size = {p: len(file_info(header_metadata(p))["tokens"]) for p in files}
    mine, others = max(files, key=size.get), min(files, key=size.get)
    assert mine.parent != others.parent
    stolen = others.parent / mine.name
    shutil.copy(mine, stolen)
    mine.unlink()  # (KEY's own entry gone: only the stolen copy could serve the prompt)
    second = Server(args, tmp_path / "b.log")
    try:
        _, usage = second.ask(key=OTHER)
    finally:
        second.stop()
    assert cached(usage) < 0.5 * usage.prompt_tokens
    assert "another key's or model's folder" in (tmp_path / "b.log").read_text()


def test_an_entry_is_found_while_its_file_is_still_being_written(models, tmp_path):
    """An entry the RAM budget evicts at once is found before its write ends (the writer
    thread held here): loaded from the arrays waiting to be written, the same state the file
    then holds. Before, a turn whose last entry was still queued prefilled again (697 tokens
    where 149 were new, in the agent trace with a 100M budget)."""
    import threading

    from mlx_spec import make_decoder
    from mlx_spec.core.cache_files import model_identity
    from mlx_spec.server.disk_cache import DiskStore

    target, draft = models["llama"]
    pair = load_pair(target=str(target), draft=str(draft))
    prompt = pair.tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    decoder = make_decoder(pair)
    expected = generate(pair, prompt, max_tokens=6, temperature=0.0, decoder=decoder)
    store = DiskStore(tmp_path / "cache", 1 << 30)
    folder = store.folder(model_identity(pair), "a-key")
    hold = threading.Event()
    store.writer.submit(hold.wait, 30)  # the writer busy: the write below waits
    store.write(folder, decoder, "assistant")
    follow = prompt + expected.tokens + pair.tokenizer.encode(" Next?")
    found, reuse = store.best(folder, follow, True)
    assert found is not None and found.parts is not None and reuse >= len(prompt)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # (not written yet)
    loaded = store.load(found, make_decoder(pair))
    hold.set()
    store.flush()
    (written,) = list(store.entries(folder).values())
    assert written.parts is None and written.path.exists()
    from_file = store.load(written, make_decoder(pair))
    for d in (loaded, from_file):
        assert d.reusable(follow) >= len(prompt)
        again = generate(pair, follow, max_tokens=6, temperature=0.0, decoder=d)
        assert again.tokens == generate(pair, follow, max_tokens=6, temperature=0.0).tokens


def test_a_decoder_loaded_from_disk_starts_from_what_auto_measured(models, tmp_path):
    """A file keeps no draft-length policy; a decoder loaded from one takes a copy of the
    partition's last kept decoder's (auto's measured costs and acceptance). Without it every
    turn of an agent session whose entries came from disk started auto afresh: 1.00 tokens a
    pass where the same session drafted 2.05 (agent trace, --prompt-cache 100M)."""
    from mlx_spec.server.disk_cache import DiskStore
    from mlx_spec.server.prompt_cache import PromptCache

    target, draft = models["llama"]
    pair = load_pair(target=str(target), draft=str(draft))
    prompt = pair.tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    store = DiskStore(tmp_path / "cache", 1 << 30)
    cache = PromptCache(pair, 1, None, store, "a-key")  # a 1-byte RAM budget
    decoder = cache.new()
    reply = generate(pair, prompt, max_tokens=8, temperature=0.0, decoder=decoder)
    assert decoder._policy is not None
    cache.save(decoder, "assistant")
    store.flush()
    cache.trim()
    assert cache.trie.size == 0  # evicted from RAM: only the file serves
    got = cache.fetch(prompt + reply.tokens + pair.tokenizer.encode(" Next?"))
    assert got is not None and got._policy_key == decoder._policy_key
    assert got._policy is not None and got._policy is not decoder._policy
