"""A target sharded over a 2-rank ring group on localhost (`mlx.launch --backend ring -n 2`).

The ranks run for real (two processes, TCP between them); their output is compared with the
single-process run in this process and across ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_spec
from mlx_spec.errors import SpecError
from mlx_spec.models import distributed

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 180
PROMPT = "Paris is the capital of"
REPEATING = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_TOKENS = 32

CASES = {
    "plain": ("model", PROMPT, {"use_draft": False}),
    "k1": ("model", PROMPT, {"num_draft_tokens": 1}),
    "k4": ("model", PROMPT, {"num_draft_tokens": 4}),
    "auto": ("model", PROMPT, {"num_draft_tokens": "auto"}),
    "lookup": ("ngram", REPEATING, {"num_draft_tokens": 4}),
    "k4 temp 1": ("model", PROMPT, {"num_draft_tokens": 4, "temperature": 1.0, "seed": 5}),
    "lookup temp 1": ("ngram", REPEATING, {"num_draft_tokens": 4, "temperature": 1.0, "seed": 5}),
    "temp 1 no seed": ("model", PROMPT, {"num_draft_tokens": 4, "temperature": 1.0}),
    # `auto` chooses k from timings, so only the ranks (which share rank 0's) must agree
    "auto temp 1": ("model", PROMPT, {"num_draft_tokens": "auto", "temperature": 1.0, "seed": 5}),
    # a fork of a decoder that generated (dist_worker.py): its fresh key is rank 0's
    "fork temp 1": ("model", PROMPT, {"num_draft_tokens": 4, "temperature": 1.0, "fork": True}),
}
ACROSS_RANKS_ONLY = ("temp 1 no seed", "auto temp 1", "fork temp 1")


def free_port() -> int:
    """A port the ring can listen on (rank r listens on port + r)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring -n 2` on localhost; its exit status is 0 even when a rank
    fails, so callers check what the ranks wrote. A hung group is killed whole."""
    argv = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "-p", str(free_port())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*argv, *command],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the 2-rank group did not finish in {LAUNCH_TIMEOUT} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def ranks(tiny_models, tmp_path_factory):
    """Every case run once on a 2-rank group: one report per rank."""
    tmp = tmp_path_factory.mktemp("ranks")
    spec = {
        "target": str(tiny_models.target),
        "draft": str(tiny_models.draft),
        "cases": {
            name: {"pair": pair, "prompt": prompt, "kwargs": {**kw, "max_tokens": MAX_TOKENS}}
            for name, (pair, prompt, kw) in CASES.items()
        },
    }
    (tmp / "cases.json").write_text(json.dumps(spec))
    run = launch(
        ["--python", sys.executable, str(HERE / "dist_worker.py"), "cases.json", str(tmp)], tmp
    )
    reports = []
    for rank in (0, 1):
        path = tmp / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing:\n{run.stderr[-3000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.fixture(scope="module")
def single(tiny_models):
    """The same cases in this process, on the whole target."""
    pairs = {
        "model": mlx_spec.load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft)),
        "ngram": mlx_spec.load_pair(target=str(tiny_models.target), drafter="ngram"),
    }
    assert pairs["model"].link is None  # not launched: today's path
    return {
        name: mlx_spec.generate(pairs[pair], prompt, max_tokens=MAX_TOKENS, **kw)
        for name, (pair, prompt, kw) in CASES.items()
        if name not in ACROSS_RANKS_ONLY
    }


def test_the_group_has_two_ranks_and_a_sharded_target(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["size"] == 2 for r in ranks)
    # llama: every block ends in two all-reduces (attention o_proj, MLP down_proj); 4 blocks
    assert all(r["per_pass"] == 2 * 4 for r in ranks)


@pytest.mark.parametrize("case", ["plain", "k1", "k4", "auto", "lookup"])
def test_greedy_equals_the_single_process_run(ranks, single, case):
    expected = single[case].tokens
    assert len(expected) == MAX_TOKENS
    for report in ranks:
        assert report["results"][case]["tokens"] == expected


@pytest.mark.parametrize("case", ["k4 temp 1", "lookup temp 1"])
def test_seeded_sampling_equals_the_single_process_run(ranks, single, case):
    expected = single[case].tokens
    assert ranks[0]["results"][case]["tokens"] == expected
    assert ranks[1]["results"][case]["tokens"] == expected
    # sampling really happened: not the greedy reply
    greedy = "lookup" if case.startswith("lookup") else "k4"
    assert expected != single[greedy].tokens


@pytest.mark.parametrize("case", ACROSS_RANKS_ONLY)
def test_sampling_agrees_across_ranks(ranks, case):
    """No seed: rank 0 draws one for every rank. `auto`: every rank's controller applies rank
    0's timings, so all choose the same k and draw the same keys."""
    a, b = (r["results"][case] for r in ranks)
    assert a["tokens"] == b["tokens"]  # (a sample may end early: not always MAX_TOKENS long)
    for key in ("target_passes", "drafted", "accepted", "finish_reason"):
        assert a["stats"][key] == b["stats"][key]


def test_auto_controllers_stay_equal_across_ranks(ranks):
    for case in ("auto", "auto temp 1"):
        a, b = (r["results"][case]["stats"] for r in ranks)
        assert a["controller"] == b["controller"]  # timings included: rank 0's on both
        assert a["chosen_k_histogram"] == b["chosen_k_histogram"]


def test_every_rank_makes_the_same_decisions(ranks):
    for case in CASES:
        a, b = (r["results"][case]["stats"] for r in ranks)
        for key in ("target_passes", "drafted", "accepted", "collectives", "chosen_k_histogram"):
            assert a[key] == b[key], (case, key)


def test_collectives_per_token_plain_against_speculative(ranks):
    per_pass = ranks[0]["per_pass"]
    plain = ranks[0]["results"]["plain"]["stats"]
    k4 = ranks[0]["results"]["k4"]["stats"]
    lookup = ranks[0]["results"]["lookup"]["stats"]
    # plain decoding: one set of all-reduces per token
    assert plain["collectives"] == per_pass * plain["generated_tokens"]
    assert plain["collectives_per_token"] == per_pass
    # speculative: one set per round, whatever k (the draft is replicated: none of its own)
    for stats in (k4, lookup):
        assert stats["group_size"] == 2
        assert stats["collectives"] == per_pass * stats["target_passes"]
        assert stats["target_passes"] < stats["generated_tokens"]
        assert stats["collectives_per_token"] < plain["collectives_per_token"]
        assert stats["collective_seconds"] > 0
    # `auto`: one small broadcast of rank 0's timings per decision on top
    auto = ranks[0]["results"]["auto"]["stats"]
    extra = auto["collectives"] - per_pass * auto["target_passes"]
    assert 0 < extra <= auto["target_passes"]


def test_the_cli_prints_once_on_rank_zero(tiny_models, tmp_path):
    args = ["--target", str(tiny_models.target), "--draft", str(tiny_models.draft)]
    args += ["--num-draft-tokens", "4", "--max-tokens", "16", "--raw", "--json", PROMPT]
    run = launch([str(BIN / "mlx-spec"), "generate", *args], tmp_path)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout + run.stderr[-3000:]
    got = json.loads(lines[0])
    pair = mlx_spec.load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    expected = mlx_spec.generate(pair, PROMPT, max_tokens=16, num_draft_tokens=4)
    assert got["tokens"] == expected.tokens
    assert got["stats"]["group_size"] == 2
    assert got["stats"]["collectives"] == 8 * got["stats"]["target_passes"]


def test_bench_on_a_group(tiny_models, tmp_path):
    """mlx-lm's runs and ours interleave on the sharded target: each must be exact (mlx-lm
    leaves a look-ahead step running; its all-reduces must not meet the next run's)."""
    (tmp_path / "prompts.txt").write_text(PROMPT + "\n")
    args = ["--target", str(tiny_models.target), "--draft", str(tiny_models.draft)]
    args += ["--prompts", "prompts.txt", "--k", "3", "--temps", "0", "--runs", "2"]
    run = launch([str(BIN / "mlx-spec"), "bench", *args, "--max-tokens", "12", "--json"], tmp_path)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout + run.stderr[-3000:]
    rows = json.loads(lines[0])["rows"]
    assert {(r["config"], r["k"]) for r in rows} == {
        ("mlx-lm", 0),
        ("mlx-spec", 0),
        ("mlx-lm speculative", 3),
        ("mlx-spec", 3),
    }
    for r in rows:
        if r["config"] != "mlx-lm":
            assert r["same_output"] is True, r
        if r["config"] == "mlx-spec":
            assert r["collectives_per_token"] > 0
    plain, k3 = sorted((r for r in rows if r["config"] == "mlx-spec"), key=lambda r: r["k"])
    assert plain["collectives_per_token"] == 8 >= k3["collectives_per_token"]  # one set a round


def test_chat_and_probe_refuse_a_group(tiny_models, tmp_path):
    run = launch([str(BIN / "mlx-spec"), "probe", "--target", str(tiny_models.target)], tmp_path)
    message = "mlx-spec probe: error: probe runs in one process; under mlx.launch use generate"
    assert run.stderr.count(message) == 2, run.stderr[-3000:]  # one line from each rank
    assert run.stdout == ""


# ------------------------------------------------------------------ a group of one, in process


def test_alone_is_todays_path(pair, monkeypatch):
    for name in distributed.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert distributed.world() is None
    assert pair.link is None
    stats = mlx_spec.generate(pair, PROMPT, max_tokens=8, num_draft_tokens=2).stats.to_json()
    assert (stats["group_size"], stats["collectives"], stats["collective_seconds"]) == (1, 0, 0)


def test_launched_alone_is_todays_path(tmp_path, monkeypatch):
    """`mlx.launch -n 1` leaves an empty ring hostfile, which mx.distributed.init cannot parse."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("\n")
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert distributed.world() is None


def test_heads_that_do_not_split_are_refused():
    config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3}
    with pytest.raises(SpecError, match="num_key_value_heads .3. does not divide by .* 2"):
        distributed.check_divisible(config, 2)
    distributed.check_divisible({**config, "num_key_value_heads": 2}, 2)


def test_a_model_mlx_lm_cannot_shard_is_refused(tiny_models):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, config = load_model(tiny_models.mamba, lazy=True)
    with pytest.raises(SpecError, match="cannot split a mamba model tensor-parallel"):
        distributed.shard(model, config, mx.distributed.init())
