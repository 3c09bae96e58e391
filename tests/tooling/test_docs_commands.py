"""Every code block of README.md and docs/*.md runs in the suite or says in the page's source why
it does not, so that what the guide shows cannot rot:

- a ```console block: each ``$ `` line runs and exits 0, from the repository's root with the
  project's venv first on PATH;
- a ```python block preceded by ``<!-- run: LAUNCH -->`` runs under that launcher (``python``,
  ``mpiexec -n N``, ``torchrun --nproc_per_node N``, ``collectives-elastic -n N --min M``; several
  separated by ``;``), after the comment's further lines, a hidden set-up that defines what a
  fragment leaves to the reader (``model``, ``x``). The blocks of one launcher run in one job, in
  page order, each in a namespace of its own (tests/tooling/doc_snippet_runner.py);
- a block preceded by ``<!-- run by tests/PATH.py -->`` is run by that test, which holds it
  verbatim or reads it from the page;
- any other block (```sh, ```bash, indented, a ```python fragment) is preceded by
  ``<!-- not run: REASON -->``: a GPU, several hosts, Slurm, an index to install from, a
  program of the reader's, minutes of benchmark;
- a ```text block is output, not code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNER = Path(__file__).with_name("doc_snippet_runner.py")

#: The launchers a ``<!-- run: ... -->`` block may name, and the command that starts the runner under each.
LAUNCHERS = {
    r"python": "{python}",
    r"mpiexec -n (\d+)": "mpiexec -n {0} {python}",
    r"torchrun --nproc_per_node (\d+)": "torchrun --nproc_per_node {0} --master_port {port}",
    r"collectives-elastic -n (\d+) --min (\d+)": "collectives-elastic -n {0} --min {1} {python}",
}


@dataclass(frozen=True)
class Block:
    page: str    # README.md, docs/elastic.md
    line: int    # the line of the opening fence, or of an indented block's first line
    kind: str    # the fence's language ("" for none), or "indented"
    code: str
    first: int   # the page's line number of the code's first line
    marker: str  # the HTML comment right above the block ("" when there is none)


def blocks(text: str, page: str = "page.md") -> list[Block]:
    """The code blocks of a Markdown page (fenced and indented; HTML comments skipped), each with
    the HTML comment that ends on the last non-blank line above it."""
    lines = text.splitlines()
    found: list[Block] = []
    comment_end = {}  # line index where a comment ends -> its text
    i, blank_before = 0, True
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!--"):
            j = i
            while "-->" not in lines[j]:
                j += 1
            comment_end[j] = "\n".join(lines[i:j + 1])
            i, blank_before = j + 1, False
            continue
        fence = re.match(r"```(\S*)", line)
        indented = line.startswith("    ") and line.strip() and blank_before
        if fence or indented:
            if fence:
                j = i + 1
                while not lines[j].startswith("```"):
                    j += 1
                body, first, after = lines[i + 1:j], i + 2, j + 1
            else:
                j = i
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                body, first, after = [b[4:] for b in lines[i:j]], i + 1, j
            above = i - 1
            while above >= 0 and not lines[above].strip():
                above -= 1
            found.append(Block(page, i + 1, fence.group(1) if fence else "indented",
                               "\n".join(body).rstrip() + "\n", first, comment_end.get(above, "")))
            i, blank_before = after, not fence
            continue
        blank_before = not line.strip()
        i += 1
    return found


def marker(block: Block) -> tuple[str, str]:
    """("run", launchers) with the hidden set-up after a newline, ("run by", path), ("not run",
    reason), or ("", "") for a block without a marker."""
    match = re.fullmatch(r"<!-- (run by|not run:|run:) ?(.*?)\s*-->", block.marker, re.S)
    return (match.group(1).rstrip(":"), match.group(2)) if match else ("", "")


def launches(block: Block) -> tuple[list[str], str]:
    """The launchers a ``run:`` block names, and its hidden set-up."""
    head, _, setup = marker(block)[1].partition("\n")
    return [launch.strip() for launch in head.split(";")], textwrap.dedent(setup)


ALL = [block for page in PAGES for block in blocks(page.read_text(), str(page.relative_to(ROOT)))]


def problems(block: Block) -> list[str]:
    kind, what = marker(block)
    where = f"{block.page}:{block.line} ({block.kind or 'no language'})"
    if block.kind in ("console", "text"):
        return [f"{where}: a {block.kind} block needs no marker"] if kind else []
    if block.kind == "":
        return [f"{where}: say what the block is: ```text for output, ```sh or ```python for code"]
    if not kind:
        return [f"{where}: run it (<!-- run: LAUNCH -->) or say why not (<!-- not run: REASON -->)"]
    if kind == "not run":
        return [] if what else [f"{where}: 'not run' without a reason"]
    if kind == "run by":
        test = ROOT / what
        if not test.is_file():
            return [f"{where}: {what} does not exist"]
        source = test.read_text()
        held = block.code.strip() in source or Path(block.page).name in source
        return [] if held else [f"{where}: {what} neither holds the block nor reads {block.page}"]
    if block.kind != "python":
        return [f"{where}: only ```python blocks run; a shell command goes in a ```console block"]
    names, setup = launches(block)
    wrong = [n for n in names if not any(re.fullmatch(pattern, n) for pattern in LAUNCHERS)]
    if wrong:
        return [f"{where}: unknown launcher(s) {wrong}; known: {list(LAUNCHERS)}"]
    try:
        compile(setup, where, "exec")
    except SyntaxError as e:
        return [f"{where}: its hidden set-up is not Python: {e}"]
    return []


def test_every_code_block_runs_or_says_why_not() -> None:
    assert [p for block in ALL for p in problems(block)] == []


PAGE = """intro
```python
a = 1
```

<!-- run: mpiexec -n 2; python
x = 3
-->
```python
print(x)
```
text

    indented code

<!-- not run: needs a GPU -->

    nvidia-smi
- a list item
    continued, not code
```console
$ echo one
```
"""


def test_the_reader_finds_blocks_and_their_markers() -> None:
    found = blocks(PAGE)
    assert [(b.line, b.kind, b.code, b.first) for b in found] == [
        (2, "python", "a = 1\n", 3), (9, "python", "print(x)\n", 10), (14, "indented", "indented code\n", 14),
        (18, "indented", "nvidia-smi\n", 18), (21, "console", "$ echo one\n", 22)]
    assert [marker(b)[0] for b in found] == ["", "run", "", "not run", ""]
    assert launches(found[1]) == (["mpiexec -n 2", "python"], "x = 3")
    assert [p.split(": ", 1)[1] for b in found for p in problems(b)] == [
        "run it (<!-- run: LAUNCH -->) or say why not (<!-- not run: REASON -->)",
        "run it (<!-- run: LAUNCH -->) or say why not (<!-- not run: REASON -->)"]


def test_a_marker_that_cannot_hold_is_a_problem() -> None:
    bad = ["<!-- run: srun -n 2 -->\n```python\npass\n```\n",
           "<!-- run: python\nx = (\n-->\n```python\npass\n```\n",
           "<!-- run: python -->\n```sh\nls\n```\n",
           "<!-- not run: -->\n```sh\nls\n```\n",
           "<!-- run by tests/nowhere.py -->\n```python\npass\n```\n",
           "```\nsome output\n```\n"]
    for text in bad:
        assert [problems(b) for b in blocks(text)] != [[]], text


# -- ```console blocks ----------------------------------------------------------------------------

def console_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every ``$ `` line inside a ```console block."""
    return [(block.first + offset, line[2:]) for block in blocks(text) if block.kind == "console"
            for offset, line in enumerate(block.code.splitlines()) if line.startswith("$ ")]


COMMANDS = [(page, number, command) for page in PAGES for number, command in console_commands(page.read_text())]


def test_the_reader_finds_the_commands_of_a_console_block() -> None:
    text = "intro\n```console\n$ echo one\noutput\n$ echo two\n```\n```sh\nnot run\n```\n"
    assert console_commands(text) == [(3, "echo one"), (5, "echo two")]


def test_the_guide_has_commands_to_run() -> None:
    assert len(COMMANDS) >= 5


def user_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.timeout(200)
@pytest.mark.parametrize("page, number, command", COMMANDS,
                         ids=[f"{p.name}:{n}" for p, n, _ in COMMANDS])
def test_the_command_runs(page: Path, number: int, command: str) -> None:
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=user_environment(), capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{page.name}:{number}: {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


# -- ```python blocks marked <!-- run: ... --> -----------------------------------------------------

GROUPS: dict[str, list[Block]] = {}
for _block in ALL:
    if _block.kind == "python" and marker(_block)[0] == "run":
        for _launch in launches(_block)[0]:
            GROUPS.setdefault(_launch, []).append(_block)


def test_the_guide_has_python_to_run() -> None:
    assert sum(map(len, GROUPS.values())) >= 8 and len(GROUPS) >= 3


def command(launch: str, blocks_file: Path) -> str:
    from collectives.testing.launch import free_port

    for pattern, template in LAUNCHERS.items():
        match = re.fullmatch(pattern, launch)
        if match:
            return f"{template.format(*match.groups(), python='python', port=free_port())} {RUNNER} {blocks_file}"
    raise AssertionError(f"unknown launcher {launch!r}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch", sorted(GROUPS))
def test_the_python_blocks_run(launch: str, tmp_path: Path) -> None:
    chosen = GROUPS[launch]
    blocks_file = tmp_path / "blocks.json"
    blocks_file.write_text(json.dumps([{"page": b.page, "line": b.line, "first": b.first, "code": b.code,
                                        "setup": launches(b)[1]} for b in chosen]))
    env = {**user_environment(), "COLLECTIVES_TIMEOUT": "120"}
    done = subprocess.run(["bash", "-c", command(launch, blocks_file)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=220, stdin=subprocess.DEVNULL)
    ran = sorted(set(re.findall(r"^ran (\S+)$", done.stdout, re.M)))
    assert done.returncode == 0 and ran == sorted(f"{b.page}:{b.line}" for b in chosen), \
        f"{launch}: ran {ran}\n{done.stdout[-3000:]}{done.stderr[-4000:]}"
