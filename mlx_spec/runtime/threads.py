"""One thread owns the models.

MLX's default streams are per thread (MLX >= 0.31.2 on Metal, >= 0.32 on the CPU): an array
that is not evaluated yet remembers the stream of the thread that built it, and evaluating it
on another thread raises `There is no Stream(cpu, 0) in current thread`. Evaluated arrays are
fine anywhere. So every surface loads and generates on one long-lived thread (`ModelThread`),
and, belt and braces, nothing lazy outlives the call that built it:

- after loading, every array a model holds is evaluated, private ones included: mlx-lm's
  `Llama3RoPE`, `YarnRoPE`, `SuScaledRoPE` keep `_freqs`, which `mlx_lm.load` never evaluates
  (names starting with `_` are not parameters);
- at the end of each reply the decoder evaluates its key, caches and drafter state
  (`Decoder.settle`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

T = TypeVar("T")


def _any_array(module, key, value) -> bool:
    return isinstance(value, mx.array | dict | list | tuple)


def held_arrays(model: nn.Module) -> list[mx.array]:
    """Every array the model holds: parameters, buffers and private (`_`) attributes."""
    tree = model.filter_and_map(_any_array)
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]


def materialize(*models) -> None:
    """Evaluate everything the models hold, so they can be used from any thread."""
    arrays = [a for m in models if m is not None for a in held_arrays(m)]
    if arrays:
        mx.eval(arrays)


class ModelThread:
    """One long-lived daemon thread that runs the calls given to it, in order.

    Not a `ThreadPoolExecutor(max_workers=1)`: an executor's threads are joined at interpreter
    exit, so a reply still running would hold the exit up; this thread is a daemon, and the
    app stops its reply between rounds (or the process ends with `os._exit`).
    """

    def __init__(self, name: str = "mlx-spec-models"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.closed = False

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # handed to whoever waits on the future
                future.set_exception(err)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        if self.closed:  # its future would never resolve
            raise RuntimeError("this ModelThread is closed")
        if not self.thread.is_alive():  # started by the first call: an unused one costs nothing
            self.thread.start()
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the thread; awaits its result (or its exception) without blocking the
        event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def close(self) -> None:
        """End the thread after the calls already given to it."""
        self.closed = True
        self._jobs.put(None)
