"""The docs stay true: README.md and docs/*.md.

- Every relative link resolves to a file of the repository, and every `#anchor` (in the page or
  `page.md#anchor`) is a heading of the target page under GitHub's slug rules. External links
  (http, https, mailto) are not fetched.
- Every `mlx-spec ...` command shown in a fenced code block parses with the real argument parser,
  and every flag in it is one the parser defines, spelled out (argparse would accept an
  abbreviation; the docs should not show one). Checked: every line of a shell block (`bash`,
  `sh`, `shell`, `console`, `zsh` or no language) and the `$ ` lines of any other block. A
  usage synopsis (`[--opt]`) is not a command: it belongs in prose or a `text` block without `$`.
- README's test command is the last line of `.ci/run`.

The helpers take text, so `test_the_checker_finds_breakage` can show that they fail.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)=["']([^"']+)["']""")
EXTERNAL = ("http://", "https://", "mailto:")
OPERATORS = {"|", "||", "&&", ";", "&"}
REDIRECTS = {">", ">>", "<", "<<", ">&", "<&", "&>"}
NUMBER = re.compile(r"^-\d")
# --help and --version exit, with status 0, by design
EXITING_FLAGS = {"-h", "--help", "--version"}


def split_fences(
    text: str,
) -> tuple[list[tuple[int, str]], list[tuple[str, list[tuple[int, str]]]]]:
    """(prose lines, fenced blocks): lines as (line number, text); a block as (its language,
    its lines with the opening fence's indentation removed)."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            m = FENCE.match(line)
            if m:
                fence = (m.group(2)[0], len(m.group(2)), len(m.group(1)))
                blocks.append((m.group(3).lower(), []))
            else:
                prose.append((number, line))
            continue
        char, length, indent = fence
        stripped = line.strip()
        if stripped.startswith(char * length) and not stripped.strip(char):
            fence = None
            continue
        body = line[indent:] if line[:indent].strip() == "" else line.lstrip()
        blocks[-1][1].append((number, body))
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text lowercased, punctuation but `-`
    and `_` removed, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in split_fences(text)[0]:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the prose (not in code)."""
    found = []
    for number, line in split_fences(text)[0]:
        bare = CODE_SPAN.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK):
            found += [(number, m.group(1)) for m in pattern.finditer(bare)]
    return found


def link_problems(page: Path, text: str, root: Path = ROOT) -> tuple[int, list[str]]:
    """(relative links checked, what is wrong with them) for one page's text."""
    problems = []
    checked = 0
    for number, target in links(text):
        if target.startswith(EXTERNAL):
            continue
        checked += 1
        where = f"{page.relative_to(root)}:{number}: {target}"
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if root not in file.parents and file != root:
            problems.append(f"{where}: outside the repository")
            continue
        if path and not file.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and file.suffix == ".md":
            page_text = text if file == page else file.read_text(encoding="utf-8")
            if anchor not in anchors(page_text):
                problems.append(f"{where}: no heading with this anchor in {file.name}")
        elif anchor:
            problems.append(f"{where}: an anchor into a file that is not markdown")
    return checked, problems


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of the lines to read as commands: every line of a shell
    block, the `$ ` lines of other blocks; `\\` continuations joined, heredoc bodies left out."""
    found = []
    for language, lines in split_fences(text)[1]:
        shell = language in SHELL_FENCES
        pending: tuple[int, str] | None = None
        heredoc = None
        for number, line in lines:
            if heredoc is not None:
                if line.strip() == heredoc:
                    heredoc = None
                continue
            if pending is not None:
                start, joined = pending
                line = joined + " " + line.strip()
                number = start
                pending = None
            elif line.startswith("$ "):
                line = line[2:]
            elif not shell:
                continue
            if line.rstrip().endswith("\\"):
                pending = (number, line.rstrip()[:-1].rstrip())
                continue
            m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
            if m:
                heredoc = m.group(1)
            found.append((number, line))
        if pending is not None:
            found.append(pending)
    return found


def tokens(line: str) -> list[str]:
    """shlex.split's words, with `# comments` dropped and shell operators as words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def mlx_spec_argv(words: list[str]) -> list[str] | None:
    """The arguments of `mlx-spec` (or `python -m mlx_spec`) when `words`, one simple command,
    runs it: directly, after `VAR=value`s, under `flock FILE` or after `mlx.launch ... --`."""
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words = words[1:]
    if words[:1] == ["flock"]:
        words = words[2:]
    if words[:1] == ["mlx.launch"]:
        words = words[words.index("--") + 1 :] if "--" in words else []
    if not words:
        return None
    program = words[0].rsplit("/", 1)[-1]
    if program == "mlx-spec":
        return words[1:]
    if re.fullmatch(r"python3?(\.\d+)?", program) and words[1:3] == ["-m", "mlx_spec"]:
        return words[3:]
    return None


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of every mlx-spec command the page shows."""
    found = []
    for number, line in shell_lines(text):
        if "mlx-spec" not in line and "mlx_spec" not in line:
            continue
        words: list[str] = []
        redirected = False
        for word in [*tokens(line), ";"]:
            if word in OPERATORS:
                argv = mlx_spec_argv(words)
                if argv is not None:
                    found.append((number, argv))
                words, redirected = [], False
            elif word in REDIRECTS:
                redirected = True
            elif not redirected:
                words.append(word)
    return found


@cache
def parser() -> argparse.ArgumentParser:
    from mlx_spec.cli import build_parser

    return build_parser()


def subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def argv_problem(argv: list[str]) -> str | None:
    """Why the real parser refuses `argv`, or a flag in it that the parser does not define
    exactly (an abbreviation); None when it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser().parse_args(argv)
    except SystemExit as e:
        if not (e.code == 0 and EXITING_FLAGS & set(argv)):
            return err.getvalue().strip() or f"exit {e.code}"
    p = parser()
    for word in argv:
        if word == "--":
            break
        if word.startswith("-") and word != "-" and not NUMBER.match(word):
            name = word.split("=", 1)[0]
            if name not in {s for a in p._actions for s in a.option_strings}:
                return f"{name} is not a flag of {p.prog} (spell it out)"
        elif word in subcommands(p):
            p = subcommands(p)[word]
    return None


def command_problems(page: Path, text: str, root: Path = ROOT) -> tuple[int, list[str]]:
    """(commands checked, the ones the parser refuses) for one page's text."""
    problems = []
    shown = commands(text)
    for number, argv in shown:
        problem = argv_problem(argv)
        if problem:
            problems.append(
                f"{page.relative_to(root)}:{number}: mlx-spec {shlex.join(argv)}: {problem}"
            )
    return len(shown), problems


def test_relative_links_and_anchors_resolve():
    total, problems = 0, []
    for page in PAGES:
        checked, found = link_problems(page, page.read_text(encoding="utf-8"))
        total += checked
        problems += found
    assert not problems, "\n".join(problems)
    assert total >= 50, f"only {total} relative links found: is the link pattern still right?"


def test_every_command_shown_parses():
    total, problems = 0, []
    for page in PAGES:
        checked, found = command_problems(page, page.read_text(encoding="utf-8"))
        total += checked
        problems += found
    assert not problems, "\n".join(problems)
    assert total >= 40, f"only {total} commands found: is the command pattern still right?"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    shown = [
        line for _, block in split_fences((ROOT / "README.md").read_text())[1] for _, line in block
    ]
    assert ci in shown


def test_the_checker_finds_breakage(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## Second: part `two`\n\n## Second: part two\n"
    )
    page = tmp_path / "page.md"
    text = "\n".join(
        [
            "# A page",
            "[ok](#a-page) [ok](other.md#second-part-two-1) [ok](other.md) [web](https://x.invalid)",
            "[bad anchor](#no-such-heading) [bad file](missing.md) [bad](other.md#second)",
            "`[not a link](missing-in-code.md)`",
            "```bash",
            "mlx-spec generate --pair qwen3-8b --temp 0.7 PROMPT   # fine",
            "echo hi | .venv/bin/mlx-spec generate - > out.txt",
            "mlx-spec generate --no-such-flag x",
            "mlx-spec bench --max-tok 5 \\",
            "    --runs 2",
            "python -m mlx_spec serve --port not-a-number",
            "pipx inject mlx-spec something-else",
            "```",
            "```text",
            "mlx-spec [--pair NAME] synopsis, not checked",
            "$ mlx-spec probe --bogus",
            "```",
        ]
    )
    checked, problems = link_problems(page, text, root=tmp_path)
    assert checked == 6
    assert [p.split(": ", 1)[1] for p in problems] == [
        "#no-such-heading: no heading with this anchor in page.md",
        "missing.md: no such file",
        "other.md#second: no heading with this anchor in other.md",
    ]
    checked, problems = command_problems(page, text, root=tmp_path)
    assert checked == 6
    assert len(problems) == 4, problems
    assert "--no-such-flag" in problems[0] and "unrecognized arguments" in problems[0]
    assert "--max-tok is not a flag" in problems[1]
    assert "argument --port" in problems[2]
    assert "--bogus" in problems[3]
    assert slug("`mlx-spec serve [--pair NAME]` — the server (HTTP)") == (
        "mlx-spec-serve---pair-name--the-server-http"
    )
