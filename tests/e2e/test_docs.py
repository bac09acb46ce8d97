"""The guides match the code: README.md and docs/*.md are checked against what they describe.

* Every fenced ``python`` block runs. The blocks of one page run in order in one namespace, as a
  reader would paste them into one script (``__name__ == "__main__"``, the checkout as working
  directory); a block that cannot run here is marked in the page itself by an HTML comment on
  the line before it, ``<!-- fragment: why -->``, and a mark of the form ``fragment: the
  signature of vf.X`` makes the block a signature that is compared with the code instead.
  Pages whose blocks start worker processes run in one subprocess with a bounded timeout; the
  others run in this process.
* The launch-options table of docs/training.md is the one :func:`virtualflow.config.options.markdown_table`
  generates from :class:`virtualflow.LaunchOptions` (so a new option cannot be left out).
* Every ``--flag`` of a ``virtualflow ...`` command written in a page (in a shell block or an
  inline code span) is a flag of that command's parser.
* The ``simulate-spot`` output docs/bamboo.md shows is what the command prints from this checkout.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import os
import re
import runpy
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

import virtualflow as vf
from virtualflow.cli.main import build_parser
from virtualflow.config.options import LaunchOptions, markdown_table

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*fragment:\s*(.*?)\s*-->", re.S)
# A page whose blocks start processes (workers, graph servers) runs in the subprocess.
STARTS_PROCESSES = re.compile(r"\bvf\.(train|launch)\(|\btrain_dorylus\(")
SUBPROCESS_TIMEOUT_S = 420  # about 50 s on two quiet cores; a bound for a hang, not a speed check


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the line of the block's first code line (1-based)
    lang: str
    code: str
    fragment: str | None  # the reason given by a preceding <!-- fragment: ... --> mark

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, lang: str | None = "python") -> list[Block]:
    """The fenced blocks of ``page`` (of language ``lang``; None: all), with their marks."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if lang is not None and m.group(1) != lang:
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.fullmatch(before.strip())
        out.append(Block(page, text[:m.start()].count("\n") + 2, m.group(1), m.group(2),
                         mark.group(1) if mark else None))
    return out


def script_of(page: Path) -> str:
    """The runnable python blocks of ``page`` as one script whose line numbers are the page's, so
    that a traceback points at the page's own line."""
    lines: list[str] = []
    for b in blocks(page):
        if b.fragment is None:
            lines += [""] * (b.line - 1 - len(lines))
            lines += b.code.splitlines()
    return "\n".join(lines) + "\n"


def pages_with_code(processes: bool) -> list[Path]:
    return [p for p in PAGES if script_of(p).strip() and bool(STARTS_PROCESSES.search(script_of(p))) == processes]


def write_script(page: Path, directory: Path) -> Path:
    path = directory / (str(page.relative_to(ROOT)).replace("/", "__").replace(".md", "_md") + ".py")
    path.write_text(script_of(page))
    return path


# -- the snippets run ---------------------------------------------------------------------------
def test_fragments_are_few_and_say_why():
    """Marks are the exception: each gives a reason, and most blocks run."""
    every = [b for p in PAGES for b in blocks(p)]
    marked = [b for b in every if b.fragment is not None]
    assert all(len(b.fragment) >= 10 for b in marked), [str(b) for b in marked]
    assert len(marked) * 3 <= len(every), [f"{b}: {b.fragment}" for b in marked]
    # A mark that precedes no python block would be a stale mark.
    for page in PAGES:
        text = page.read_text()
        assert text.count("<!-- fragment:") == len([b for b in blocks(page) if b.fragment is not None]), page


@pytest.mark.parametrize("page", pages_with_code(processes=False), ids=lambda p: p.name)
def test_snippets_run(page, tmp_path, monkeypatch):
    """The page's python blocks (that start no process) run, in order, in this process."""
    monkeypatch.chdir(ROOT)
    with redirect_stdout(io.StringIO()):
        runpy.run_path(str(write_script(page, tmp_path)), run_name="__main__")


@pytest.mark.slow
@pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 30)
def test_snippets_that_start_workers_run(tmp_path):
    """The pages whose blocks train (worker processes) run, one page after the other, in one
    fresh interpreter started in the checkout, as ``python page.py`` would run them."""
    scripts = [str(write_script(p, tmp_path)) for p in pages_with_code(processes=True)]
    assert len(scripts) >= 4, scripts  # README, training, pipeline, elasticity, coconet, gnn
    runner = ("import runpy, sys, time\n"
              "for path in sys.argv[1:]:\n"
              "    start = time.monotonic()\n"
              "    print('running', path, flush=True)\n"
              "    runpy.run_path(path, run_name='__main__')\n"
              "    print(f'{path}: {time.monotonic() - start:.1f} s', flush=True)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", runner, *scripts], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


# -- signatures ---------------------------------------------------------------------------------
def _documented_signatures() -> dict[str, inspect.Signature]:
    """``vf.NAME(...)`` lines of the blocks marked ``fragment: the signature(s) of ...``."""
    out: dict[str, inspect.Signature] = {}
    for page in PAGES:
        for b in blocks(page):
            if b.fragment is None or not b.fragment.startswith("the signature"):
                continue
            # One call per statement: join continuation lines, drop comments and return annotations.
            text = re.sub(r"#[^\n]*", "", b.code)
            for m in re.finditer(r"vf\.(\w+)\((.*?)\)\s*(?:->\s*\w+)?\s*(?=\n\s*vf\.|\Z)", text, re.S):
                fn = ast.parse(f"def f({m.group(2)}): pass").body[0]
                params = []
                args = fn.args
                defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
                for a, d in zip(args.args, defaults):
                    params.append(inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    default=inspect.Parameter.empty if d is None
                                                    else ast.literal_eval(d)))
                for a, d in zip(args.kwonlyargs, args.kw_defaults):
                    params.append(inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                                                    default=inspect.Parameter.empty if d is None
                                                    else ast.literal_eval(d)))
                if args.kwarg:
                    params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
                out[m.group(1)] = inspect.Signature(params)
    return out


def test_documented_signatures_are_the_code():
    """docs/training.md's ``vf.Job``, ``vf.train`` and ``vf.launch`` signatures: same parameters,
    kinds and defaults as the code (annotations aside)."""
    documented = _documented_signatures()
    assert {"Job", "train", "launch"} <= set(documented), sorted(documented)
    for name, sig in documented.items():
        code = inspect.signature(getattr(vf, name))
        code = code.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in code.parameters.values()],
                            return_annotation=inspect.Signature.empty)
        assert str(sig) == str(code), f"vf.{name}: documented {sig}, code {code}"


def test_job_table_lists_every_field():
    """The field table under docs/training.md's ``vf.Job`` signature has one row per field."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("## The job"):text.index("### How a job reaches the workers")]
    rows = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert rows == [f.name for f in dataclasses.fields(vf.Job)]


# -- the options table ----------------------------------------------------------------------------
def _options_table() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_options_table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gen_options_table.split_guide((ROOT / "docs" / "training.md").read_text())[1]


def test_options_table_is_generated_from_launch_options():
    """The table in docs/training.md is exactly what LaunchOptions generates: an option added,
    removed, or with a new default, flag or help text makes this fail until the table is
    regenerated with ``python scripts/gen_options_table.py``."""
    table = _options_table()
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert rows == [f.name for f in dataclasses.fields(LaunchOptions)], (
        "docs/training.md's options table is out of date: run python scripts/gen_options_table.py")
    assert table == markdown_table(), "docs/training.md's options table is out of date: run " \
                                      "python scripts/gen_options_table.py"


def test_options_table_covers_a_new_field():
    """The generator reads the dataclass, not a list: a field added to it gets a row."""
    extra = dataclasses.make_dataclass(
        "WithExtra", [("new_knob", int, dataclasses.field(default=3, metadata={
            "help": "a knob added later", "group": "training", "flag": "", "metavar": "K", "parse": None,
            "choices": None}))], bases=(LaunchOptions,), kw_only=True)
    import virtualflow.config.options as options

    saved = options.LaunchOptions, options._FIELDS
    options.LaunchOptions, options._FIELDS = extra, {f.name: f for f in dataclasses.fields(extra)}
    try:
        table = options.markdown_table()
    finally:
        options.LaunchOptions, options._FIELDS = saved
    assert "| `new_knob` | `--new-knob K` | `3` | a knob added later |" in table
    assert table != _options_table()


# -- command-line flags named in the pages ------------------------------------------------------------
def _commands() -> list[tuple[str, str]]:
    """(where, command) for every ``virtualflow VERB ...`` in a shell block or an inline code span."""
    found = []
    for page in PAGES:
        text = page.read_text()
        shell = [b for b in blocks(page, lang=None) if b.lang in ("", "bash", "sh", "console", "shell")]
        for b in shell:
            joined = re.sub(r"\\\n\s*", " ", b.code)
            for line in joined.splitlines():
                line = re.sub(r"(^|\s)#.*", "", line).strip().removeprefix("$ ")
                for cmd in re.split(r"&&|;|\|\s+(?=[a-z])", line):
                    if cmd.strip().startswith("virtualflow "):
                        found.append((str(b), cmd.strip()))
        prose = FENCE.sub("", text)
        for m in re.finditer(r"`(virtualflow [^`]+)`", prose):
            found.append((f"{page.relative_to(ROOT)}", m.group(1)))
    return found


def _parser_for(words: list[str]):
    """The (sub)parser a command line reaches, and the words naming it."""
    import argparse

    parser, path = build_parser(), ["virtualflow"]
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser, path = subs[0].choices[word], path + [word]
    return parser, path


def test_flags_in_the_pages_exist():
    commands = _commands()
    assert len(commands) > 50, len(commands)
    bad = []
    for where, cmd in commands:
        words = cmd.split()[1:]
        if not re.fullmatch(r"[a-z][a-z-]*", words[0] if words else ""):
            continue  # quoted output such as "virtualflow cluster: error: ...", not a command
        parser, path = _parser_for(words)
        if len(path) == 1:
            bad.append(f"{where}: `{cmd}`: no verb {words[0]!r}")
            continue
        known = set(parser._option_string_actions)
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z](?![\w-]))", cmd):
            if flag not in known:
                bad.append(f"{where}: `{cmd}`: {' '.join(path)} has no {flag}")
    assert not bad, "\n".join(bad)


# -- simulate-spot's output in docs/bamboo.md -------------------------------------------------------
def test_simulate_spot_output_is_what_the_command_prints(tmp_path, monkeypatch):
    """Each ``$ virtualflow simulate-spot ...`` output docs/bamboo.md shows is the first lines the
    command prints from this checkout, character for character (the measured constants of
    bench/results, and the defaults through the page's ``defaults.json`` holding ``{}``)."""
    from virtualflow.cli.main import main

    shown_runs = [b.code for b in blocks(ROOT / "docs" / "bamboo.md", lang="text")
                  if b.code.startswith("$ virtualflow simulate-spot ")]
    assert len(shown_runs) == 2, shown_runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "defaults.json").write_text("{}")
    for code in shown_runs:
        command, *shown = code.rstrip("\n").splitlines()
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(command.split()[2:]) == 0, command
        assert len(shown) >= 5, command  # the trace line, the header and the three strategies at least
        assert shown == out.getvalue().splitlines()[:len(shown)], (
            f"docs/bamboo.md shows stale output of `{command[2:]}` (new constants in bench/results?): paste "
            f"what it prints now and check the figures quoted beside it")


def test_run_synopsis_lists_every_flag():
    """docs/training.md's ``virtualflow run`` synopsis names every flag ``virtualflow run`` has."""
    from virtualflow.config.options import flag_of

    synopsis = next(b.code for b in blocks(ROOT / "docs" / "training.md", lang="bash")
                    if b.code.startswith("virtualflow run FILE.py"))
    shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", synopsis))
    flags = {flag_of(f.name) for f in dataclasses.fields(LaunchOptions)} - {None}
    assert flags | {"--no-progress"} == shown, (sorted(flags - shown), sorted(shown - flags))


# -- references -------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.*)$", FENCE.sub("", page.read_text()), re.M):
        base = anchor = _slug(m.group(1))
        i = 1
        while anchor in out:  # a repeated heading gets -1, -2, ...
            anchor, i = f"{base}-{i}", i + 1
        out.add(anchor)
    return out


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/*.md names a file of the project, and every
    #anchor into a page names one of its headings."""
    bad, count = [], 0
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            count += 1
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                bad.append(f"{page.name}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                bad.append(f"{page.name}: {target}: no heading with that anchor")
    assert count > 50, count
    assert not bad, "\n".join(bad)


def test_markdown_files_named_in_the_project_exist():
    """A ``NAME.md`` mentioned in code, tests, examples, benchmarks, scripts or the guides is a
    file of the project (the placeholder ``bench/results/NAME.md`` aside): no reference to notes
    that live outside it."""
    files = [p for p in ROOT.iterdir() if p.is_file()]
    for folder in ("src", "tests", "examples", "bench", "docs", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    names = {p.name for p in files}
    bad = []
    for p in files:
        rel = p.relative_to(ROOT)
        if p.suffix not in (".py", ".md", ".toml", ".sh", ".html", ".js", ".cfg", ".txt"):
            continue
        for m in re.finditer(r"[\w./-]+\.md\b", p.read_text(errors="replace")):
            name = m.group(0).rsplit("/", 1)[-1]
            if name not in names and name != "NAME.md":
                bad.append(f"{rel}: {m.group(0)}")
    assert not bad, "\n".join(bad)
