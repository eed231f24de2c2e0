"""The prompt cache's disk tier: kept decoders written to safetensors files as they are kept, so
an entry the RAM budget evicts, every entry after a restart (a clean stop or `kill -9`) and a
swapped-out pair's entries are loaded again instead of prefilled.

The files are mlx-lm's `save_prompt_cache` format (core/cache_files.py: the caches' states
flattened into safetensors, `[metadata, classes, scalars]` in its metadata; one class of ours
added, `WindowedKVCache`). The metadata holds the token sequence and the folders the file was
written for, so a restart indexes the folder from the files' headers without loading an
array, and a file copied into another key's or model's folder is refused.

Layout: `<dir>/<model>/<partition>/<entry>.safetensors`. `<model>` hashes what makes a state
valid (the target's and draft's paths, weight file sizes and times, adapter, drafter kind);
`<partition>` is an HMAC of the API key's partition under a secret kept in the folder, never
the key; `<entry>` is a hash of the tokens and the file's own SHA-256, checked on every load.
Files are written to a unique temporary name, fsynced and renamed: a crash, `kill -9` or a
second server on the folder leaves a whole file or none. Anything that does not read back
(torn, corrupt, foreign, another format version) is removed with one log line, never loaded;
a folder that cannot be written (full, read-only) turns the tier off with one warning.

What goes to disk: the target's caches and a draft model's; a drafter that keeps nothing but
tokens (prompt lookup) is rebuilt from them; a head's per-sequence state through
`Drafter.disk_state`, for every head kind: EAGLE-3's KV cache and the fused features it holds,
DFlash's (DSpark's, DFlash2's) context KV cache of projected target features, MTP's KV cache
and the final-norm rows it has not fed yet, Gemma 4's assistant's one state row (the keys and
values it attends to are the target's own layers, stored as the target's). A head's entry is
written only when the head has every position's features (`Decoder.hidden_gap`: not after a
reply decoded without it); a loaded head drafts on exactly as the request that saved it would
have. A state of another kind or shape is refused (SpecError: the file is removed, not used).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import common_prefix_len

from ..core import caches
from ..core.cache_files import (
    caches_from_parts,
    decoder_file,
    file_digest,
    file_info,
    header_metadata,
    read_cache_file,
    restore_decoder,
    storable,
)
from ..errors import SpecError

log = logging.getLogger("mlx_spec.server")

SUFFIX = ".safetensors"
STALE_TMP_SECONDS = 3600  # a temporary file this old is no live server's write


def stored(root: Path) -> list[dict]:
    """What a cache folder holds, per model folder: {model, about, entries, bytes, used}."""
    out = []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        files = entry_files(folder, "*/*" + SUFFIX)
        stats = [f.stat() for f in files]
        try:
            about = json.loads((folder / "model.json").read_text())
        except (OSError, ValueError):
            about = {}
        out.append({
            "model": folder.name, "about": about, "entries": len(files),
            "partitions": len({f.parent for f in files}),
            "bytes": sum(st.st_size for st in stats),
            "used": max((st.st_mtime for st in stats), default=None),
        })  # fmt: skip
    return out


def entry_files(root: Path, pattern: str) -> list[Path]:
    """The entries' files under `root` matching `pattern`: never a temporary file (a dot name:
    another server may be writing it right now)."""
    return [p for p in Path(root).glob(pattern) if not p.name.startswith(".")]


def prune(root: Path, max_bytes: int | None, older_than: float | None = None):
    """Entries out, least recently used first, while the folder holds more than `max_bytes`
    (None: no bound) or they were last used before `older_than` (a time; None: any): (the
    paths removed, the bytes left). `serve`'s budget and `mlx-spec cache prune` alike."""
    files = []
    for path in entry_files(root, "*/*/*" + SUFFIX):
        try:
            st = path.stat()
        except OSError:  # (another server removed it)
            continue
        files.append((st.st_mtime, st.st_size, path))
    total, removed = sum(size for _, size, _ in files), []
    for mtime, size, path in sorted(files):
        old = older_than is not None and mtime < older_than
        if not (old or (max_bytes is not None and total > max_bytes)):
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        removed.append(path)
    return removed, total


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-spec" / "prompt-cache"


# ------------------------------------------------------------------ the store


@dataclass
class DiskMetrics:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    evictions: int = 0
    errors: int = 0


@dataclass(eq=False)
class DiskEntry:
    path: Path
    tokens: list[int]  # the decoder's sequence (its caches hold all but the last)
    segment: str
    bytes: int
    used: float = field(default_factory=time.time)
    # (arrays, metadata) while its write waits on the writer thread: loaded from memory, so an
    # entry the RAM budget evicts at once is found before its file exists
    parts: tuple | None = None


class DiskStore:
    """One cache folder, shared by every partition and model of this server."""

    def __init__(self, root: Path, max_bytes: int):
        if max_bytes <= 0:
            raise SpecError("--cache-disk-bytes must be positive")
        root = Path(root).expanduser()
        if root.exists() and not root.is_dir():
            raise SpecError(f"--cache-dir {root} is not a directory")
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.secret = self._secret(root)
        except OSError as err:
            raise SpecError(f"--cache-dir {root} cannot be used: {err.strerror or err}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise SpecError(f"--cache-dir {root} is not writable")
        self.root, self.max_bytes = root, max_bytes
        self.enabled = True
        self.metrics = DiskMetrics()
        self.lock = threading.Lock()  # the index, between the engine and the writer thread
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-spec-disk")
        self.folders: dict[Path, dict[str, DiskEntry]] = {}  # folder -> name -> entry
        # seconds a byte takes to load and a token to prefill, as measured (None: not yet)
        self.load_rate: float | None = None  # bytes per second
        self.prefill_rate: float | None = None  # tokens per second

    @staticmethod
    def _secret(root: Path) -> bytes:
        path = root / "secret"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            data = path.read_bytes()
            if len(data) != 32:
                raise SpecError(f"{path} is not this format's secret (remove the folder)") from None
            return data
        data = secrets.token_bytes(32)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return data

    def describe(self, model: str, pair) -> None:
        """`<model>/model.json`: what the hashed folder holds, for `mlx-spec cache ls`."""
        path = self.root / model / "model.json"
        if path.exists():
            return
        c = pair.config
        about = {"target": c.target, "draft": c.draft, "drafter": c.drafter, "head": c.head,
                 "name": c.name}  # fmt: skip
        try:
            (self.root / model).mkdir(mode=0o700, exist_ok=True)
            tmp = path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
            tmp.write_text(json.dumps(about))
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except OSError:  # (the writes will say so, once)
            pass

    def folder(self, model: str, partition: str) -> Path:
        keyed = hmac.new(self.secret, partition.encode(), "sha256").hexdigest()[:32]
        return self.root / model / keyed

    def entries(self, folder: Path) -> dict[str, DiskEntry]:
        """The folder's entries, indexed from the files' headers the first time it is asked."""
        with self.lock:
            known = self.folders.get(folder)
            if known is not None:
                return known
            known = self.folders[folder] = {}
        for path in sorted(entry_files(folder, "*" + SUFFIX)) if folder.is_dir() else []:
            entry = self._index(path)
            if entry is not None:
                with self.lock:
                    known[path.name] = entry
        return known

    def _index(self, path: Path) -> DiskEntry | None:
        try:
            info = file_info(header_metadata(path))
            if (info.get("model"), info.get("partition")) != (path.parent.parent.name,
                                                               path.parent.name):  # fmt: skip
                raise ValueError("written for another key's or model's folder")
            st = path.stat()
            tokens = [int(t) for t in info["tokens"]]
            return DiskEntry(path, tokens, str(info["segment"]), st.st_size, st.st_mtime)
        except Exception as err:  # noqa: BLE001 - whatever it is, it is not ours to load
            self.discard(path, f"unreadable header ({type(err).__name__}: {err})")
            return None

    def discard(self, path: Path, why: str) -> None:
        log.warning("prompt cache on disk: removed %s: %s", path.name, why)
        self.metrics.errors += 1
        with self.lock:
            self.folders.get(path.parent, {}).pop(path.name, None)
        try:
            path.unlink()
        except OSError:
            pass

    def best(self, folder: Path, tokens: list[int], freely: bool) -> tuple[DiskEntry | None, int]:
        """The entry that would reuse the most of `tokens`, and how many: a caches that roll
        back freely reuse any shared prefix; others only an entry wholly inside the prompt."""
        best, most = None, 0
        known = self.entries(folder)
        with self.lock:  # (the writer thread adds entries meanwhile)
            candidates = list(known.values())
        for entry in candidates:
            held = entry.tokens[:-1]
            shared = common_prefix_len(held, tokens)
            if not freely and shared < len(held):
                continue
            reuse = min(shared, len(tokens) - 1)
            if reuse > most or (best is not None and reuse == most and entry.used > best.used):
                best, most = entry, reuse
        return best, most

    def worth_loading(self, entry: DiskEntry, gain: int) -> bool:
        """Whether loading `entry` beats prefilling the `gain` tokens it saves, at the rates
        measured so far (loading first, when nothing is measured yet)."""
        if gain <= 0:
            return False
        if self.load_rate is None or self.prefill_rate is None:
            return True
        return entry.bytes / self.load_rate < gain / self.prefill_rate

    def note_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:  # (short prefills time the overhead, not the rate)
            rate = tokens / seconds
            self.prefill_rate = (
                rate if self.prefill_rate is None else 0.8 * self.prefill_rate + 0.2 * rate
            )

    def load(self, entry: DiskEntry, decoder):
        """`decoder` (a fresh one) holding the entry's state, checked against the file's
        digest; None (the file removed) when it does not read back."""
        begin = time.perf_counter()
        try:
            if entry.parts is not None:  # not written yet: the arrays it will hold
                cache, meta = caches_from_parts(*entry.parts)
            else:
                digest = entry.path.stem.rsplit("-", 1)[-1]
                if file_digest(entry.path)[: len(digest)] != digest:
                    raise ValueError("checksum mismatch")
                cache, meta = read_cache_file(entry.path)
            arrays = tree_flatten([c.state for c in caches._leaves(cache)])
            mx.eval([a for _, a in arrays if isinstance(a, mx.array)])
            restore_decoder(decoder, cache, file_info(meta))
        except FileNotFoundError:  # another server removed it
            with self.lock:
                self.folders.get(entry.path.parent, {}).pop(entry.path.name, None)
            return None
        except Exception as err:  # noqa: BLE001
            self.discard(entry.path, f"{type(err).__name__}: {err}")
            return None
        seconds = time.perf_counter() - begin
        self.metrics.hits += 1
        self.metrics.bytes_read += entry.bytes
        self.metrics.load_seconds += seconds
        rate = entry.bytes / max(seconds, 1e-6)
        self.load_rate = rate if self.load_rate is None else 0.8 * self.load_rate + 0.2 * rate
        entry.used = time.time()
        try:
            os.utime(entry.path)
        except OSError:
            pass
        log.debug("prompt cache on disk: loaded %s (%d bytes, %.3f s)", entry.path.name,
                  entry.bytes, seconds)  # fmt: skip
        return decoder

    def write(self, folder: Path, decoder, segment: str) -> None:
        """Queue a file for `decoder` (a kept entry: nothing generates with it). Its arrays are
        sliced and evaluated here, on the engine thread (a lazy array cannot be evaluated on
        another: threads.py); the writer thread only writes."""
        if not self.enabled or not storable(decoder):
            return
        tokens = list(decoder.sequence)
        name_hash = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24]
        known = self.entries(folder)  # (indexed first: the files a restart left count)
        with self.lock:
            if any(n.startswith(name_hash) for n in known):
                return  # (on disk, or on its way)
        try:
            arrays, meta, info = decoder_file(
                decoder, segment=segment, model=folder.parent.name, partition=folder.name
            )
            mx.eval(list(arrays.values()))
        except Exception as err:  # noqa: BLE001 - the request goes on; the entry stays in RAM
            self.metrics.errors += 1
            log.warning("prompt cache on disk: an entry cannot be written: %s: %s",
                        type(err).__name__, err)  # fmt: skip
            return
        size = sum(a.nbytes for a in arrays.values())
        pending = DiskEntry(folder / f"{name_hash}-pending{SUFFIX}", tokens, segment, size,
                            parts=(arrays, meta))  # fmt: skip
        with self.lock:
            self.folders.setdefault(folder, {})[pending.path.name] = pending
        self.writer.submit(self._write, folder, name_hash, arrays, meta, info)

    def _write(self, folder: Path, name_hash: str, arrays: dict, meta: dict, info: dict) -> None:
        try:
            self._write_file(folder, name_hash, arrays, meta, info)
        finally:  # written (then indexed as a file) or not: its arrays are let go
            with self.lock:
                self.folders.get(folder, {}).pop(f"{name_hash}-pending{SUFFIX}", None)

    def _write_file(
        self, folder: Path, name_hash: str, arrays: dict, meta: dict, info: dict
    ) -> None:
        if not self.enabled:  # (turned off while this one waited)
            return
        begin = time.perf_counter()
        tmp = folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
        try:
            for part in (folder.parent, folder):  # <model>/<partition>, both 0700
                part.mkdir(mode=0o700, exist_ok=True)
            mx.save_safetensors(str(tmp), arrays, meta)
            os.chmod(tmp, 0o600)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            path = folder / f"{name_hash}-{file_digest(tmp)[:32]}{SUFFIX}"
            os.replace(tmp, path)
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except Exception as err:  # noqa: BLE001 - a full disk, a read-only folder (OSError,
            # or MLX's RuntimeError from save_safetensors): RAM only from now on
            self.enabled = False
            log.warning("prompt cache on disk turned off (RAM only): %s: %s",
                        type(err).__name__, err)  # fmt: skip
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        size = path.stat().st_size
        entry = DiskEntry(path, info["tokens"], info["segment"], size)
        with self.lock:
            known = self.folders.setdefault(folder, {})
            known.pop(f"{name_hash}-pending{SUFFIX}", None)
            known[path.name] = entry
        self.metrics.bytes_written += size
        self.metrics.save_seconds += time.perf_counter() - begin
        log.debug("prompt cache on disk: wrote %s (%d bytes)", path.name, size)
        self.trim()

    def forget(self, folder: Path, tokens: list[int]) -> None:
        """Remove the file of exactly `tokens` (a RAM entry made redundant by a longer one)."""
        name_hash = hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:24]

        def remove():
            with self.lock:
                names = [n for n in self.folders.get(folder, {}) if n.startswith(name_hash)]
                for n in names:
                    self.folders[folder].pop(n)
            for n in names:
                try:
                    (folder / n).unlink()
                except OSError:
                    pass

        self.writer.submit(remove)  # after its write, on the same thread

    def trim(self) -> None:
        """Least recently used files out until the folder fits --cache-disk-bytes (every
        model's and partition's, this server's index and the files on disk alike)."""
        for path in self.root.glob("*/*/.tmp-*"):  # a write `kill -9` cut, long ago
            try:
                if time.time() - path.stat().st_mtime > STALE_TMP_SECONDS:
                    path.unlink()
            except OSError:
                pass
        removed, _ = prune(self.root, self.max_bytes)
        self.metrics.evictions += len(removed)
        with self.lock:
            for path in removed:
                self.folders.get(path.parent, {}).pop(path.name, None)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued writes (tests, shutdown)."""
        self.writer.submit(lambda: None).result(timeout)
