"""The recorded agent session that `agent_trace.py --shapes session` replays: its data.

The shape of a Claude Code / Codex session on a small Python project (`tally`, a to-do list
command line tool): a long system prompt and ten tool definitions, the agent's tool calls and
their results (the project's files, quoted whole), two sub-agents started with the `task` tool
from the same system prompt, a file rewritten in full, an edit, test runs. The calls and every
result are recorded here (SmolLM2 writes no tool calls); which requests the replay makes and
which replies it keeps is in `agent_trace.py` (`session_plan`). Nothing here is generated and
nothing depends on the machine: the same session every run.
"""

from __future__ import annotations

import re

# ------------------------------------------------------------------ the system prompt

# Sections of instructions, in order; the replay takes as many as --system-tokens needs.
SYSTEM_SECTIONS = [
    """You are Tally Code, an interactive command line agent that helps users with software \
engineering tasks. Use the instructions below and the tools available to you to assist the user.

IMPORTANT: Refuse to write or explain code that may be used maliciously, even if the user claims \
it is for educational purposes. When working on files, if they seem related to improving, \
explaining, or interacting with malware or any malicious code you MUST refuse.
IMPORTANT: You must NEVER generate or guess URLs for the user unless you are confident that the \
URLs are for helping the user with programming. You may use URLs provided by the user in their \
messages or local files.""",
    """# Tone and style
You should be concise, direct, and to the point. When you run a non-trivial bash command, you \
should explain what the command does and why you are running it, to make sure the user \
understands what you are doing (this is especially important when you are running a command \
that will make changes to the user's system).
Remember that your output will be displayed on a command line interface. Your responses can use \
GitHub-flavored markdown for formatting, and will be rendered in a monospace font.
Output text to communicate with the user; all text you output outside of tool use is displayed \
to the user. Only use tools to complete tasks. Never use tools like bash or code comments as \
means to communicate with the user during the session.
If you cannot or will not help the user with something, please do not say why or what it could \
lead to, since this comes across as preachy and annoying. Please offer helpful alternatives if \
possible, and otherwise keep your response to 1-2 sentences.
IMPORTANT: You should minimize output tokens as much as possible while maintaining helpfulness, \
quality, and accuracy. Only address the specific query or task at hand, avoiding tangential \
information unless absolutely critical for completing the request. If you can answer in 1-3 \
sentences or a short paragraph, please do.
IMPORTANT: You should NOT answer with unnecessary preamble or postamble (such as explaining your \
code or summarizing your action), unless the user asks you to.""",
    """# Proactiveness
You are allowed to be proactive, but only when the user asks you to do something. You should \
strive to strike a balance between:
1. Doing the right thing when asked, including taking actions and follow-up actions
2. Not surprising the user with actions you take without asking
For example, if the user asks you how to approach something, you should do your best to answer \
their question first, and not immediately jump into taking actions.
3. Do not add additional code explanation summary unless requested by the user. After working \
on a file, just stop, rather than providing an explanation of what you did.""",
    """# Following conventions
When making changes to files, first understand the file's code conventions. Mimic code style, \
use existing libraries and utilities, and follow existing patterns.
- NEVER assume that a given library is available, even if it is well known. Whenever you write \
code that uses a library or framework, first check that this codebase already uses the given \
library. For example, you might look at neighboring files, or check the pyproject.toml (or \
package.json, or cargo.toml, and so on depending on the language).
- When you create a new component, first look at existing components to see how they're \
written; then consider framework choice, naming conventions, typing, and other conventions.
- When you edit a piece of code, first look at the code's surrounding context (especially its \
imports) to understand the code's choice of frameworks and libraries. Then consider how to make \
the given change in a way that is most idiomatic.
- Always follow security best practices. Never introduce code that exposes or logs secrets and \
keys. Never commit secrets or keys to the repository.

# Code style
- IMPORTANT: DO NOT ADD ***ANY*** COMMENTS unless asked""",
    """# Task management
You have access to the todo_write tool to help you manage and plan tasks. Use it very \
frequently to ensure that you are tracking your tasks and giving the user visibility into your \
progress. It is also extremely helpful for planning tasks, and for breaking down larger complex \
tasks into smaller steps. If you do not use this tool when planning, you may forget to do \
important tasks - and that is unacceptable.
It is critical that you mark todos as completed as soon as you are done with a task. Do not \
batch up multiple tasks before marking them as completed.

# Doing tasks
The user will primarily request you perform software engineering tasks. This includes solving \
bugs, adding new functionality, refactoring code, explaining code, and more. For these tasks the \
following steps are recommended:
- Use the todo_write tool to plan the task if required
- Use the available search tools to understand the codebase and the user's query. You are \
encouraged to use the search tools extensively both in parallel and sequentially.
- Implement the solution using all tools available to you
- Verify the solution if possible with tests. NEVER assume specific test framework or test \
script. Check the README or search codebase to determine the testing approach.
- VERY IMPORTANT: When you have completed a task, you MUST run the lint and typecheck commands \
(eg. ruff check, mypy) with bash if they were provided to you to ensure your code is correct.
NEVER commit changes unless the user explicitly asks you to.""",
    """# Tool usage policy
- When doing file search, prefer to use the task tool in order to reduce context usage.
- You should proactively use the task tool with specialized agents when the task at hand \
matches the agent's description.
- You have the capability to call multiple tools in a single response. When multiple \
independent pieces of information are requested, batch your tool calls together for optimal \
performance. When making multiple bash tool calls, you MUST send a single message with multiple \
tools calls to run the calls in parallel.
- Use specialized tools instead of bash commands when possible, as this provides a better user \
experience. For file operations, use dedicated tools: read_file for reading files instead of \
cat/head/tail, edit for editing instead of sed/awk, and write_file for creating files instead of \
cat with heredoc or echo redirection.

# Code references
When referencing specific functions or pieces of code include the pattern `file_path:line_number` \
to allow the user to easily navigate to the source code location.""",
    """# Committing changes with git
When the user asks you to create a new git commit, follow these steps carefully:
1. Run the following bash commands in parallel: a git status command to see all untracked files; \
a git diff command to see both staged and unstaged changes that will be committed; a git log \
command to see recent commit messages, so that you can follow this repository's commit message \
style.
2. Analyze all staged changes (both previously staged and newly added) and draft a commit \
message: summarize the nature of the changes (eg. new feature, enhancement to an existing \
feature, bug fix, refactoring, test, docs, etc.); check for any sensitive information that \
shouldn't be committed; draft a concise (1-2 sentences) commit message that focuses on the \
"why" rather than the "what".
3. Add relevant untracked files to the staging area, create the commit, and run git status to \
make sure the commit succeeded.
4. If the commit fails due to pre-commit hook changes, retry the commit ONCE to include these \
automated changes. If it fails again, it usually means a pre-commit hook is preventing the \
commit.
Important notes: NEVER update the git config; NEVER run additional commands to read or explore \
code, besides git bash commands; DO NOT push to the remote repository unless the user \
explicitly asks you to do so; never use git commands with the -i flag (like git rebase -i or \
git add -i) since they require interactive input which is not supported.""",
    """# Creating pull requests
Use the gh command via the bash tool for ALL GitHub-related tasks including working with issues, \
pull requests, checks, and releases. If given a Github URL use the gh command to get the \
information needed.
When the user asks you to create a pull request, understand the current state of the branch: \
run git status, git diff, check whether the current branch tracks a remote branch and is up to \
date with the remote, and run git log and `git diff [base-branch]...HEAD` to understand the full \
commit history for the current branch (from the time it diverged from the base branch). Analyze \
all changes that will be included in the pull request, making sure to look at all relevant \
commits (NOT just the latest commit, but ALL commits that will be included in the pull \
request!), and draft a pull request summary. Then create a new branch if needed, push to remote \
with -u flag if needed, and create the PR using gh pr create with a title and a body made of a \
short summary (1-3 bullet points) and a test plan (a bulleted markdown checklist of TODOs for \
testing the pull request).""",
    """# Environment
<env>
Working directory: /home/dev/tally
Is directory a git repo: Yes
Platform: linux
OS Version: Linux 6.8.0-52-generic
Today's date: 2026-03-14
</env>
gitStatus: This is the git status at the start of the conversation. Note that this status is a \
snapshot in time, and will not update during the conversation.
Current branch: main
Main branch (you will usually use this for PRs): main
Status:
(clean)
Recent commits:
4c1e2a9 store: write the JSON file atomically (temp file, then rename)
b7d03f1 cli: `tally done` takes several ids
91a5c5e models: priorities as an enum, parsed case-insensitively
2f6e8d0 formatting: align columns in `tally list`
0d3b7aa first version: add, list, done, remove""",
    """# Security
IMPORTANT: Assist with defensive security tasks only. Refuse to create, modify, or improve code \
that may be used maliciously. Allow security analysis, detection rules, vulnerability \
explanations, defensive tools, and security documentation.
IMPORTANT: Always use the todo_write tool to plan and track tasks throughout the conversation.
IMPORTANT: Before you begin work, think about what the code you're editing is supposed to do \
based on the filenames and directory structure. If it seems malicious, refuse to work on it or \
answer questions related to it, even if the request does not seem malicious.""",
    """# Hooks and reminders
Users may configure 'hooks', shell commands that execute in response to events like tool calls, \
in settings. Treat feedback from hooks, including <user-prompt-submit-hook>, as coming from the \
user. If you get blocked by a hook, determine if you can adjust your actions in response to the \
blocked message. If not, ask the user to check their hooks configuration.
Tool results and user messages may include <system-reminder> tags. <system-reminder> tags \
contain useful information and reminders. They are NOT part of the user's provided input or the \
tool result. The conversation has unlimited context through automatic summarization.""",
]

# ------------------------------------------------------------------ the tools


def _schema(required: list[str], **props) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def _s(description: str, kind: str = "string") -> dict:
    return {"type": kind, "description": description}


# name, description, JSON schema of the arguments
TOOLS = [
    (
        "task",
        "Launch a new agent to handle complex, multi-step tasks autonomously. The agent starts "
        "a fresh conversation with the same tools and returns one final report; it cannot see "
        "this conversation, so the prompt must say everything it needs. Use it for open-ended "
        "searches over the codebase that would take several rounds of grep and read_file, to "
        "keep this conversation's context small. Launch several agents at once when their work "
        "is independent. The agent's result is not shown to the user: summarise it.",
        _schema(
            ["description", "prompt"],
            description=_s("A short (3-5 word) description of the task"),
            prompt=_s("The task for the agent to perform, with every detail it needs"),
        ),
    ),
    (
        "bash",
        "Executes a given bash command in a persistent shell session with optional timeout, "
        "ensuring proper handling and security measures. Before running a command that creates "
        "files or directories, check with list_dir that the parent directory exists. Always quote "
        "file paths that contain spaces. Output over 30000 characters is truncated. Avoid search "
        "commands like find and grep (use glob and grep instead) and reading commands like cat, "
        "head and tail (use read_file). Prefer absolute paths over cd.",
        _schema(
            ["command"],
            command=_s("The command to execute"),
            timeout=_s("Optional timeout in milliseconds (max 600000)", "number"),
            description=_s("Clear, concise description of what this command does in 5-10 words"),
        ),
    ),
    (
        "glob",
        "Fast file pattern matching tool that works with any codebase size. Supports glob "
        'patterns like "**/*.js" or "src/**/*.ts". Returns matching file paths sorted by '
        "modification time. Use this tool when you need to find files by name patterns.",
        _schema(
            ["pattern"],
            pattern=_s("The glob pattern to match files against"),
            path=_s("The directory to search in; the current working directory if omitted"),
        ),
    ),
    (
        "grep",
        "A powerful search tool built on ripgrep. ALWAYS use grep for search tasks, never grep "
        'or rg through bash. Supports full regex syntax (e.g. "log.*Error", "function\\s+\\w+"). '
        'Filter files with the glob parameter (e.g. "*.js") or the type parameter (e.g. "py"). '
        'Output modes: "content" shows matching lines, "files_with_matches" only file paths '
        '(the default), "count" match counts.',
        _schema(
            ["pattern"],
            pattern=_s("The regular expression pattern to search for in file contents"),
            path=_s("File or directory to search in (rg PATH); defaults to the working directory"),
            glob=_s('Glob pattern to filter files (e.g. "*.js", "*.{ts,tsx}")'),
            output_mode=_s('"content", "files_with_matches" or "count"'),
            n=_s("Show line numbers in the output (content mode only)", "boolean"),
        ),
    ),
    (
        "list_dir",
        "Lists files and directories in a given path. The path parameter must be an absolute "
        "path, not a relative path. You can optionally provide an array of glob patterns to "
        "ignore. Prefer glob and grep when you know which directories to search.",
        _schema(
            ["path"],
            path=_s("The absolute path to the directory to list"),
            ignore={"type": "array", "items": {"type": "string"}, "description": "Globs to skip"},
        ),
    ),
    (
        "read_file",
        "Reads a file from the local filesystem. The file_path parameter must be an absolute "
        "path. By default it reads up to 2000 lines from the beginning of the file; you can "
        "give a line offset and limit for long files. Any lines longer than 2000 characters are "
        "truncated. You must read a file before you edit or overwrite it. It is always better to "
        "speculatively read multiple files as a batch that are potentially useful.",
        _schema(
            ["file_path"],
            file_path=_s("The absolute path to the file to read"),
            offset=_s("The line number to start reading from", "number"),
            limit=_s("The number of lines to read", "number"),
        ),
    ),
    (
        "edit",
        "Performs exact string replacements in files. You must use read_file at least once in "
        "the conversation before editing. When editing text from read_file output, preserve the "
        "exact indentation (tabs/spaces) as it appears. The edit will FAIL if old_string is not "
        "unique in the file: either provide a larger string with more surrounding context to "
        "make it unique or use replace_all to change every instance of old_string.",
        _schema(
            ["file_path", "old_string", "new_string"],
            file_path=_s("The absolute path to the file to modify"),
            old_string=_s("The text to replace"),
            new_string=_s("The text to replace it with (must be different from old_string)"),
            replace_all=_s("Replace all occurences of old_string (default false)", "boolean"),
        ),
    ),
    (
        "write_file",
        "Writes a file to the local filesystem, overwriting the existing file if there is one. "
        "If this is an existing file, you MUST use read_file first to read its contents. ALWAYS "
        "prefer editing existing files in the codebase. NEVER write new files unless explicitly "
        "required. NEVER proactively create documentation files (*.md) or README files.",
        _schema(
            ["file_path", "content"],
            file_path=_s("The absolute path to the file to write (must be absolute)"),
            content=_s("The content to write to the file"),
        ),
    ),
    (
        "todo_write",
        "Use this tool to create and manage a structured task list for your current coding "
        "session. This helps you track progress, organize complex tasks, and demonstrate "
        "thoroughness to the user. Use it for tasks of three or more steps; mark a task "
        "in_progress before beginning work on it and completed right after finishing it. Only "
        "one task should be in_progress at any time.",
        _schema(
            ["todos"],
            todos={
                "type": "array",
                "items": _schema(
                    ["content", "status", "id"],
                    content=_s("The task"),
                    status={"type": "string", "enum": ["pending", "in_progress", "completed"]},
                    id=_s("A unique id"),
                ),
            },
        ),
    ),
    (
        "web_fetch",
        "Fetches content from a specified URL and processes it using an AI model. Takes a URL "
        "and a prompt as input, fetches the URL content, converts HTML to markdown, and answers "
        "the prompt from it. The URL must be a fully-formed valid URL; HTTP URLs are upgraded "
        "to HTTPS. This tool is read-only and does not modify any files.",
        _schema(
            ["url", "prompt"],
            url=_s("The URL to fetch content from"),
            prompt=_s("The prompt to run on the fetched content"),
        ),
    ),
]

# ------------------------------------------------------------------ the project's files

ROOT = "/home/dev/tally"

FILES = {
    "tally/models.py": '''"""The task model: what a to-do item is, and how it is stored as JSON."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timezone


class Priority(enum.Enum):
    LOW = 1
    NORMAL = 2
    HIGH = 3

    @classmethod
    def parse(cls, text: str) -> Priority:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            raise ValueError(f"unknown priority {text!r} (expected one of: {names})") from None


@dataclass
class Task:
    id: int
    title: str
    priority: Priority = Priority.NORMAL
    done: bool = False
    tags: list[str] = field(default_factory=list)
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    def matches(self, tag: str | None) -> bool:
        return tag is None or tag in self.tags

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "priority": self.priority.name.lower(),
            "done": self.done,
            "tags": list(self.tags),
            "created": self.created.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Task:
        return cls(
            id=int(data["id"]),
            title=str(data["title"]),
            priority=Priority.parse(data.get("priority", "normal")),
            done=bool(data.get("done", False)),
            tags=[str(t) for t in data.get("tags", [])],
            created=datetime.fromisoformat(data["created"]),
        )
''',
    "tally/store.py": '''"""Tasks kept in one JSON file, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .models import Priority, Task

DEFAULT_PATH = Path.home() / ".tally.json"


class StoreError(Exception):
    pass


class JsonStore:
    def __init__(self, path: Path = DEFAULT_PATH):
        self.path = Path(path)
        self.tasks: dict[int, Task] = {}
        self.load()

    def load(self) -> None:
        if not self.path.exists():
            self.tasks = {}
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise StoreError(f"{self.path} is not valid JSON: {err}") from None
        self.tasks = {t.id: t for t in map(Task.from_dict, data.get("tasks", []))}

    def save(self) -> None:
        payload = {"version": 1, "tasks": [t.to_dict() for t in self.tasks.values()]}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tally-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        os.replace(tmp, self.path)

    def next_id(self) -> int:
        return max(self.tasks, default=0) + 1

    def add(self, title: str, priority: Priority = Priority.NORMAL, tags=()) -> Task:
        task = Task(id=self.next_id(), title=title, priority=priority, tags=list(tags))
        self.tasks[task.id] = task
        self.save()
        return task

    def get(self, task_id: int) -> Task:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise StoreError(f"no task with id {task_id}") from None

    def complete(self, *task_ids: int) -> list[Task]:
        tasks = [self.get(i) for i in task_ids]
        for task in tasks:
            task.done = True
        self.save()
        return tasks

    def remove(self, task_id: int) -> Task:
        task = self.get(task_id)
        del self.tasks[task_id]
        self.save()
        return task

    def list(self, tag: str | None = None, include_done: bool = False) -> list[Task]:
        tasks = [t for t in self.tasks.values() if t.matches(tag)]
        if not include_done:
            tasks = [t for t in tasks if not t.done]
        return sorted(tasks, key=lambda t: (-t.priority.value, t.created))
''',
    "tally/cli.py": '''"""The `tally` command line: add, list, done, remove."""

from __future__ import annotations

import argparse
import sys

from .formatting import table
from .models import Priority
from .store import JsonStore, StoreError


def cmd_add(store: JsonStore, args) -> int:
    task = store.add(" ".join(args.title), Priority.parse(args.priority), args.tag or [])
    print(f"added {task.id}: {task.title}")
    return 0


def cmd_list(store: JsonStore, args) -> int:
    tasks = store.list(tag=args.tag, include_done=args.all)
    if not tasks:
        print("nothing to do")
        return 0
    print(table(tasks))
    return 0


def cmd_done(store: JsonStore, args) -> int:
    for task in store.complete(*args.ids):
        print(f"done {task.id}: {task.title}")
    return 0


def cmd_remove(store: JsonStore, args) -> int:
    task = store.remove(args.id)
    print(f"removed {task.id}: {task.title}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tally", description="A small to-do list.")
    p.add_argument("--file", help="the JSON file (default: ~/.tally.json)")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a task")
    add.add_argument("title", nargs="+")
    add.add_argument("-p", "--priority", default="normal")
    add.add_argument("-t", "--tag", action="append")
    add.set_defaults(run=cmd_add)
    ls = sub.add_parser("list", help="list open tasks")
    ls.add_argument("-t", "--tag")
    ls.add_argument("-a", "--all", action="store_true", help="include done tasks")
    ls.set_defaults(run=cmd_list)
    done = sub.add_parser("done", help="mark tasks done")
    done.add_argument("ids", nargs="+", type=int)
    done.set_defaults(run=cmd_done)
    rm = sub.add_parser("remove", help="delete a task")
    rm.add_argument("id", type=int)
    rm.set_defaults(run=cmd_remove)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        store = JsonStore(args.file) if args.file else JsonStore()
        return args.run(store, args)
    except (StoreError, ValueError) as err:
        print(f"tally: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
''',
    "tally/formatting.py": '''"""Tasks as an aligned text table for the terminal."""

from __future__ import annotations

from datetime import datetime, timezone

from .models import Priority, Task

MARKS = {Priority.HIGH: "!", Priority.NORMAL: " ", Priority.LOW: "."}


def age(created: datetime, now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    days = (now - created).days
    if days <= 0:
        return "today"
    if days == 1:
        return "yesterday"
    return f"{days}d ago"


def row(task: Task, now: datetime | None = None) -> list[str]:
    status = "x" if task.done else " "
    tags = " ".join(f"#{t}" for t in task.tags)
    mark = MARKS[task.priority]
    return [f"[{status}]", str(task.id), mark, task.title, tags, age(task.created, now)]


def table(tasks: list[Task], now: datetime | None = None) -> str:
    rows = [row(t, now) for t in tasks]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [cell.ljust(width) for cell, width in zip(r, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\\n".join(lines)
''',
    "tests/test_store.py": """from datetime import datetime, timezone

import pytest

from tally.models import Priority, Task
from tally.store import JsonStore, StoreError


@pytest.fixture
def store(tmp_path):
    return JsonStore(tmp_path / "tasks.json")


def test_add_assigns_increasing_ids(store):
    a = store.add("write report")
    b = store.add("call the bank")
    assert (a.id, b.id) == (1, 2)


def test_tasks_survive_a_reload(store):
    store.add("water plants", Priority.LOW, ["home"])
    again = JsonStore(store.path)
    [task] = again.list()
    assert task.title == "water plants"
    assert task.priority is Priority.LOW
    assert task.tags == ["home"]


def test_complete_hides_tasks_unless_all(store):
    a = store.add("one")
    store.add("two")
    store.complete(a.id)
    assert [t.title for t in store.list()] == ["two"]
    assert len(store.list(include_done=True)) == 2


def test_list_orders_by_priority_then_age(store):
    store.add("low", Priority.LOW)
    store.add("high", Priority.HIGH)
    store.add("normal")
    assert [t.title for t in store.list()] == ["high", "normal", "low"]


def test_unknown_id_is_a_store_error(store):
    with pytest.raises(StoreError, match="no task with id 7"):
        store.get(7)


def test_invalid_json_is_reported(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        JsonStore(path)


def test_round_trip_keeps_created_time():
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    task = Task(id=3, title="x", created=when)
    assert Task.from_dict(task.to_dict()).created == when
""",
    "pyproject.toml": """[project]
name = "tally"
version = "0.3.0"
description = "A small to-do list for the terminal"
requires-python = ">=3.10"
dependencies = []

[project.optional-dependencies]
dev = ["pytest>=8", "ruff>=0.6"]

[project.scripts]
tally = "tally.cli:main"

[tool.ruff]
line-length = 100

[tool.pytest.ini_options]
testpaths = ["tests"]
""",
    "README.md": """# tally

A small to-do list for the terminal, kept in one JSON file (`~/.tally.json`, or `--file`).

```console
$ tally add -p high -t work write the quarterly report
added 1: write the quarterly report
$ tally add -t home water the plants
added 2: water the plants
$ tally list
[ ]  1  !  write the quarterly report  #work  today
[ ]  2     water the plants            #home  today
$ tally done 1
done 1: write the quarterly report
```

Priorities: `low`, `normal` (the default), `high`. Tags filter the list (`tally list -t home`);
`tally list --all` shows finished tasks too.

## Development

`pip install -e '.[dev]'`, then `pytest` and `ruff check`.
""",
}

GLOB_PY = "\n".join(
    f"{ROOT}/{p}"
    for p in (
        "tally/__init__.py",
        "tally/cli.py",
        "tally/formatting.py",
        "tally/models.py",
        "tally/store.py",
        "tests/test_store.py",
        "tests/test_formatting.py",
        "tests/conftest.py",
    )
)

PYTEST_BEFORE = """============================= test session starts ==============================
platform linux -- Python 3.12.3, pytest-8.3.4, pluggy-1.5.0
rootdir: /home/dev/tally
configfile: pyproject.toml
testpaths: tests
collected 11 items

tests/test_formatting.py ....                                            [ 36%]
tests/test_store.py .......                                              [100%]

============================== 11 passed in 0.09s =============================="""

PYTEST_AFTER = (
    PYTEST_BEFORE.replace("collected 11", "collected 13")
    .replace(
        "tests/test_store.py .......                                              [100%]",
        "tests/test_store.py .........                                            [100%]",
    )
    .replace("11 passed in 0.09s", "13 passed in 0.11s")
)

# ------------------------------------------------------------------ the task and sub-tasks

TASK = (
    "Tasks need due dates. Add an optional due date to a task (stored as an ISO date in the "
    "JSON file; files written before this change must still load), show it in `tally list`, "
    "and add `tally list --overdue` that shows only open tasks whose due date has passed. Add "
    "tests for the new behaviour."
)

SUBTASK_A = (
    "Find how `tally list` is wired, from the argument parser to the printed table: which "
    "functions in tally/cli.py and tally/store.py take part, which arguments `list` accepts, "
    "and where a new flag would have to be added and passed down to filter the tasks. The "
    "project is at /home/dev/tally. Report the function names, file paths with line numbers, "
    "and a short plan; do not change any file."
)

SUBTASK_B = (
    "Check how dates are handled in /home/dev/tally: where datetimes are created, parsed, "
    "formatted or compared (tally/models.py, tally/formatting.py, the tests), whether they "
    "are timezone-aware, and what format the JSON file uses. Report what a new optional "
    "`due` date field should use to stay consistent; do not change any file."
)


def grep(pattern: str, paths: list[str]) -> str:
    """What ripgrep prints for `pattern` in these recorded files (path:line:text)."""
    found = re.compile(pattern)
    return "\n".join(
        f"{path}:{n}:{line}"
        for path in paths
        for n, line in enumerate(FILES[path].splitlines(), 1)
        if found.search(line)
    )


GREP_LIST_PATTERN = r"def cmd_list|\.list\(|def list|\"list\""
GREP_LIST = grep(GREP_LIST_PATTERN, ["tally/cli.py", "tally/store.py", "README.md"])
GREP_DATES_PATTERN = r"datetime|timezone|isoformat"
GREP_DATES = grep(
    GREP_DATES_PATTERN, ["tally/models.py", "tally/formatting.py", "tests/test_store.py"]
)

REPORT_A = """`tally list` goes through three functions:

- tally/cli.py:49-52 — `parser()` adds the `list` sub-command with `-t/--tag` and `-a/--all` \
and sets `run=cmd_list`.
- tally/cli.py:19 — `cmd_list(store, args)` calls `store.list(tag=args.tag, \
include_done=args.all)` and prints `table(tasks)` (or "nothing to do").
- tally/store.py:70 — `JsonStore.list(tag, include_done)` filters with `Task.matches(tag)` and \
`done`, then sorts by priority (high first) and creation time.

Plan for `--overdue`: add `ls.add_argument("--overdue", action="store_true")` next to `--all`, \
pass `overdue=args.overdue` from `cmd_list` to `store.list`, and filter there on a \
`Task.is_overdue(now)` helper so the rule lives in the model. `table` in tally/formatting.py \
builds each row in `row()`; a due column would go there."""

REPORT_B = """Dates in tally are timezone-aware UTC datetimes throughout:

- tally/models.py:31 — `created` defaults to `datetime.now(timezone.utc)`; `to_dict` writes \
`created.isoformat()` and `from_dict` reads it back with `datetime.fromisoformat`.
- tally/formatting.py:12 — `age(created, now)` compares against `datetime.now(timezone.utc)`; \
`table`/`row` take an optional `now` so tests can pin the clock.
- tests/test_store.py:57 — the round-trip test builds `datetime(..., tzinfo=timezone.utc)`.

The JSON file holds ISO 8601 strings. For `due`, a calendar date fits better than a datetime: \
store `date.isoformat()` ("2026-03-20"), read it with `date.fromisoformat`, default to None and \
use `data.get("due")` so old files still load. Compare with `now.date()` from a timezone-aware \
`now`, and accept an injected `now` as formatting does."""

REWRITE = (
    "Rewrite tally/models.py in full with the due date: an optional `due: date | None = None` "
    "field on Task, written by `to_dict` as an ISO date (None when unset) and read by "
    '`from_dict` with `data.get("due")` so that old files still load, and a method '
    "`is_overdue(self, today: date) -> bool` that is true for open tasks whose due date is "
    "before `today`. Keep everything else as it is. Reply with the complete file in one "
    "```python code block and nothing else."
)

CLI_OLD = """    tasks = store.list(tag=args.tag, include_done=args.all)
    if not tasks:"""

CLI_NEW = """    tasks = store.list(tag=args.tag, include_done=args.all)
    if args.overdue:
        today = date.today()
        tasks = [t for t in tasks if t.is_overdue(today)]
    if not tasks:"""

EDIT_RESULT = """The file /home/dev/tally/tally/cli.py has been updated. Here's the result of \
running `cat -n` on a snippet of the edited file:
    18
    19\tdef cmd_list(store: JsonStore, args) -> int:
    20\t    tasks = store.list(tag=args.tag, include_done=args.all)
    21\t    if args.overdue:
    22\t        today = date.today()
    23\t        tasks = [t for t in tasks if t.is_overdue(today)]
    24\t    if not tasks:
    25\t        print("nothing to do")
    26\t        return 0"""

TESTS_ADDED = """

def test_due_date_round_trips_and_old_files_load():
    task = Task(id=4, title="pay rent", due=date(2026, 3, 31))
    assert Task.from_dict(task.to_dict()).due == date(2026, 3, 31)
    old = {"id": 5, "title": "old", "created": "2026-01-02T03:04:05+00:00"}
    assert Task.from_dict(old).due is None


def test_is_overdue_only_for_open_tasks_past_due():
    task = Task(id=6, title="x", due=date(2026, 3, 10))
    assert task.is_overdue(date(2026, 3, 14))
    assert not task.is_overdue(date(2026, 3, 10))
    task.done = True
    assert not task.is_overdue(date(2026, 3, 14))
"""

# The user's first message after `/clear` (Claude Code, Codex `/new`): a new conversation with
# the same system prompt and tools, and none of the earlier turns.
CLEARED = (
    "Continue the due-date work in /home/dev/tally: the Task model already has an optional "
    "`due` field. Finish `tally list --overdue` and its tests."
)

FINAL = "All tests pass. Summarise what changed for the user in two or three sentences."
