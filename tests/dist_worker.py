"""One rank of a group started by `mlx.launch` (tests/test_distributed.py).

Loads the tiny target sharded over the group (load_pair finds the group mlx.launch started),
runs every case of the cases file and writes what it got to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx_spec


def main(cases_file: str, out_dir: str) -> None:
    spec = json.loads(Path(cases_file).read_text())
    pairs = {
        "model": mlx_spec.load_pair(target=spec["target"], draft=spec["draft"]),
        "ngram": mlx_spec.load_pair(target=spec["target"], drafter="ngram"),
    }
    link = pairs["model"].link
    results = {}
    for name, case in spec["cases"].items():
        kwargs = dict(case["kwargs"])
        pair = pairs[case["pair"]]
        if kwargs.pop("fork", False):  # a copy of a decoder that generated, sampling unseeded
            decoder = mlx_spec.make_decoder(pair)
            mlx_spec.generate(pair, case["prompt"], max_tokens=4, decoder=decoder)
            kwargs["decoder"] = decoder.fork()
        res = mlx_spec.generate(pair, case["prompt"], **kwargs)
        results[name] = {"tokens": res.tokens, "stats": res.stats.to_json()}
    report = {
        "rank": link.rank,
        "size": link.size,
        "per_pass": link.per_pass,
        "results": results,
    }
    Path(out_dir, f"rank{link.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
