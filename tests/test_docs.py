"""The docs cannot drift from the code: README.md and docs/*.md are checked here.

- Every ```python block runs, in a fresh temp dir, as a script of its own (or under the command
  of a ``<!-- run: ... -->`` comment right above it, e.g. ``elastictk-run ... {file}``), unless
  a ``<!-- not run: why -->`` comment says why not; ``<!-- needs: etcd -->`` runs it only where
  the binary is installed (``make test`` installs it). A block under ``<!-- excerpt: PATH -->``
  is part of a file the suite runs: each of its lines (but ``...`` and comments) is a line of
  PATH, in the file's order, so the excerpt cannot drift from what runs.
- Every ``elastictk-run``/``elastictk-chaos`` command line in a shell block parses; every
  ``$ command`` in a ```console block runs and prints what the block shows.
- Every ``--flag`` in docs/launcher.md's text is in ``elastictk-run --help`` or is refused as the
  page says (docs/chaos.md: either program's flags).
- Every relative link (and its #anchor) and every repository path in backticks points to a
  file that exists and is not an old, redirecting module path.
- Every dotted ``elastictk.x.y`` name imports; in the old → new table of CHANGELOG.md each old
  path no longer imports and each new one does.
- docs/architecture.md: its layers are pyproject.toml's, it names every module, and every
  function its store-key table and its change map name exists in the file they name.
- docs/metrics.md lists every event kind; every ``python -m bench NAME`` is a benchmark.
- README.md has at most 150 lines and shows ``make demo`` and ``make test`` first.

Python blocks run two at a time (most of each is importing torch): about 20 s on 2 cores.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_PY = ROOT / ".venv" / "bin" / "python"
PY = str(VENV_PY if VENV_PY.exists() else Path(sys.executable))
PROGRAMS = {"elastictk-run": [PY, "-m", "elastictk.run"], "elastictk-chaos": [PY, "-m", "elastictk.chaos"]}
BLOCK_TIMEOUT = 240  # a hang guard: beside CPU hogs a block's own pytest run took 77 s, and ran out of 120
MAX_NOT_RUN = 3  # blocks marked "not run" across all pages: keep them rare
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
# Repository paths in backticks that must exist (placeholders such as <name> never match).
REPO_PATH = re.compile(r"`((?:elastictk|tests|examples|bench|contrib|docs)/[\w./-]*\w/?)`")
DOTTED = re.compile(r"(?<![\w./-])elastictk(?:\.[A-Za-z_]\w*)+(?![\w/-])")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    notes: list[str] = field(default_factory=list)  # the HTML comments right above the fence

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def note(self, key: str) -> str | None:
        for n in self.notes:
            if n.startswith(key + ":"):
                return n[len(key) + 1:].strip()
        return None


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        notes: list[str] = []
        j = i - 1
        while j >= 0 and re.match(r"^<!--.*-->$", lines[j].strip()):
            notes.insert(0, lines[j].strip()[4:-3].strip())
            j -= 1
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", notes))
        i = end + 1
    return out


ALL_BLOCKS = [b for p in PAGES for b in blocks(p)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]


def prose(page: Path) -> str:
    """The page without its fenced blocks' content."""
    text = page.read_text()
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def region(text: str, name: str) -> tuple[str, str]:
    """(the text between ``<!-- name: begin -->`` and ``<!-- name: end -->``, the rest)."""
    m = re.search(rf"<!-- {name}: begin -->(.*?)<!-- {name}: end -->", text, re.S)
    assert m is not None, f"no <!-- {name}: begin/end --> region"
    return m.group(1), text[:m.start()] + text[m.end():]


def workdir(tmp: Path) -> Path:
    """A temp dir that sees the repository's examples, tests and bench at their usual paths."""
    for name in ("examples", "tests", "bench", "contrib", "docs"):
        (tmp / name).symlink_to(ROOT / name)
    return tmp


def environment(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_", "PYTEST_"))}
    env.update(TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1", COLUMNS="80",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for name in ("ELASTICTK_ETCD", "ELASTICTK_PROMETHEUS"):
        if name in os.environ:
            env[name] = os.environ[name]
    env["PATH"] = os.pathsep.join([str(Path(PY).parent), env.get("PATH", "")])
    return env


def command(words: list[str]) -> list[str]:
    return PROGRAMS.get(words[0], [words[0]]) + words[1:]


def installed(daemon: str) -> bool:
    from elastictk.testing import EtcdNotInstalled, PrometheusNotInstalled, find_etcd, find_prometheus

    finder, missing = {"etcd": (find_etcd, EtcdNotInstalled),
                       "prometheus": (find_prometheus, PrometheusNotInstalled)}[daemon]
    try:
        finder()
    except missing:
        return False
    return True


# -- python blocks -----------------------------------------------------------------------------

@dataclass
class Ran:
    command: str
    returncode: int | None  # None: timed out
    stdout: str
    stderr: str


# Pages whose blocks run in order, as a reader pastes them, by their own test (not here too).
IN_ORDER = {ROOT / "docs" / "quickstart.md": "tests/test_docs_quickstart.py"}


def skip_reason(block: Block) -> str | None:
    if block.page in IN_ORDER:
        return f"run in its page's order by {IN_ORDER[block.page]}"
    why = block.note("not run")
    if why is not None:
        return f"not run: {why}"
    source = block.note("excerpt")
    if source is not None:
        return f"an excerpt of {source}, checked by test_excerpts_are_lines_of_their_file"
    needs = block.note("needs")
    if needs is not None and not installed(needs):
        return f"{needs} is not installed here"
    return None


def run_block(block: Block, tmp: Path) -> Ran:
    cwd = workdir(tmp)
    script = cwd / "test_docblock.py"  # a test_ name, so a block may also run under pytest
    script.write_text(block.text)
    run = block.note("run") or "{python} {file}"
    argv = command([w.replace("{python}", PY).replace("{file}", str(script)) for w in shlex.split(run)])
    try:
        r = subprocess.run(argv, cwd=cwd, env=environment(tmp), capture_output=True, text=True,
                           timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return Ran(run, None, str(e.stdout or ""), str(e.stderr or ""))
    return Ran(run, r.returncode, r.stdout, r.stderr)


@pytest.fixture(scope="session")
def examples_ran(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every selected example, run two at a time (most of each is importing torch)."""
    wanted = {getattr(item, "callspec").params["block"].id for item in request.session.items
              if getattr(item, "originalname", "") == "test_python_example_runs"}
    todo = [b for b in PYTHON_BLOCKS if b.id in wanted and skip_reason(b) is None]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {b.id: pool.submit(run_block, b, tmp_path_factory.mktemp("docblock")) for b in todo}
    return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_example_runs(block: Block, examples_ran: dict[str, Ran]) -> None:
    why = skip_reason(block)
    if why is not None:
        assert block.note("not run") != "", f"{block.id}: say why the block is not run: <!-- not run: why -->"
        pytest.skip(why)
    r = examples_ran[block.id]
    assert r.returncode is not None, f"{block.id}: `{r.command}` did not finish in {BLOCK_TIMEOUT}s: {r.stderr[-3000:]}"
    assert r.returncode == 0, (f"{block.id}: `{r.command}` exited {r.returncode}\n--- stdout\n{r.stdout[-3000:]}"
                               f"\n--- stderr\n{r.stderr[-5000:]}")


def _code_line(line: str) -> str:
    """A line without its comment and with its spaces collapsed (a comment's column may differ)."""
    return " ".join(re.sub(r"\s+#.*$|^\s*#.*$", "", line).split())


def excerpt_misses(text: str, source: str) -> list[str]:
    """The block's code lines that are not lines of ``source`` in order; ``...`` marks an elision."""
    have = [_code_line(x) for x in source.splitlines()]
    at, missing = 0, []
    for raw in text.splitlines():
        line = _code_line(raw)
        if not line or "..." in line:
            continue
        try:
            at = have.index(line, at) + 1
        except ValueError:
            missing.append(raw)
    return missing


EXCERPTS = [b for b in PYTHON_BLOCKS if b.note("excerpt") is not None]


@pytest.mark.parametrize("block", EXCERPTS, ids=lambda b: b.id)
def test_excerpts_are_lines_of_their_file(block: Block) -> None:
    name = str(block.note("excerpt")).split(" ")[0]  # what follows the path is for the reader
    assert (ROOT / name).is_file(), f"{block.id}: <!-- excerpt: {name} --> names no file"
    missing = excerpt_misses(block.text, (ROOT / name).read_text())
    assert not missing, f"{block.id}: not lines of {name} (in its order): {missing}"


def test_the_excerpt_check_sees_drift() -> None:
    source = "a = 1\nb = f(a)  # why\nc = 3\n"
    assert excerpt_misses("a = 1\n...\nc = 3   # other words\n", source) == []
    assert excerpt_misses("a = 2\n", source) == ["a = 2"]
    assert excerpt_misses("c = 3\na = 1\n", source) == ["a = 1"]  # out of the file's order


def test_blocks_not_run_are_rare_and_say_why() -> None:
    skipped = [b for b in PYTHON_BLOCKS if b.note("not run") is not None]
    assert all(b.note("not run") for b in skipped), [b.id for b in skipped if not b.note("not run")]
    assert len(skipped) <= MAX_NOT_RUN, f"{len(skipped)} blocks are not run: {[b.id for b in skipped]}"
    assert len(PYTHON_BLOCKS) - len(skipped) >= 10, "most examples must run"


# -- command lines -----------------------------------------------------------------------------

def shell_lines(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, ``$ `` prompts dropped."""
    out: list[str] = []
    pending = ""
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if block.lang == "console":
            if not (line.startswith("$ ") or pending):
                continue
            line = line[2:] if line.startswith("$ ") else line
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((pending + line).strip())
        pending = ""
    return [s for s in out if s]


def words_of(line: str) -> list[str]:
    return [w for w in shlex.split(line, comments=True) if w != "..."]


SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL_LANGS]
# Console blocks are run as they stand (below); the other shell blocks' commands must parse.
LAUNCH_LINES = [(b, line) for b in SHELL_BLOCKS if b.lang != "console" for line in shell_lines(b)
                if line.split()[0] in PROGRAMS]


@pytest.mark.parametrize("block, line", LAUNCH_LINES, ids=[f"{b.id}:{ln.split()[0]}" for b, ln in LAUNCH_LINES])
def test_documented_command_lines_parse(block: Block, line: str) -> None:
    from elastictk.cli import UsageError, parse_args

    words = words_of(line)
    try:
        if words[0] == "elastictk-run":
            parse_args(words[1:], environ={}, check=False)
        else:
            from elastictk.chaos.cli import parse

            ns, launcher, cmd = parse(words[1:])
            extra = ["--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "chaos"] if ns.nodes > 1 else []
            parse_args([*launcher, *extra, *cmd], environ={}, check=False)
    except (UsageError, SystemExit) as e:
        pytest.fail(f"{block.id}: `{line}` is refused: {e}")


CONSOLE_BLOCKS = [b for b in SHELL_BLOCKS if b.lang == "console"]


@pytest.mark.parametrize("block", CONSOLE_BLOCKS, ids=lambda b: b.id)
def test_console_sessions_print_what_they_show(block: Block, tmp_path: Path) -> None:
    """``$ cmd`` lines run; each output line the block shows (but ``...``) is in the output."""
    session: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            session.append((line[2:], []))
        elif session and line.strip() and "..." not in line:
            session[-1][1].append(" ".join(line.split()))
    assert session, f"{block.id}: a console block shows `$ command` lines"
    cwd = workdir(tmp_path)
    for cmd, shown in session:
        r = subprocess.run(command(words_of(cmd)), cwd=cwd, env=environment(tmp_path), capture_output=True,
                           text=True, timeout=60)
        got = {" ".join(ln.split()) for ln in (r.stdout + r.stderr).splitlines()}
        missing = [s for s in shown if s not in got]
        assert not missing, f"{block.id}: `{cmd}` (exit {r.returncode}) did not print {missing}:\n{r.stdout}{r.stderr}"


def test_benchmark_names_exist() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import available
    finally:
        sys.path.remove(str(ROOT))
    names = set(available())
    for page in PAGES:
        for m in re.finditer(r"python -m bench((?: [a-z]\w*)+)", page.read_text()):
            unknown = set(m.group(1).split()) - names
            assert not unknown, f"{page.name}: `python -m bench{m.group(1)}`: no benchmark {unknown}"


# -- flags -------------------------------------------------------------------------------------

def help_flags(program: str) -> set[str]:
    r = subprocess.run([*PROGRAMS[program], "--help"], capture_output=True, text=True, timeout=60,
                       env=environment(ROOT))
    assert r.returncode == 0, r.stderr
    return set(FLAG.findall(r.stdout))


def test_every_launcher_flag_in_the_docs_exists() -> None:
    from elastictk.cli import UsageError, parse_args

    page = ROOT / "docs" / "launcher.md"
    known = help_flags("elastictk-run")
    # In prose; flags in command lines are checked by parsing them (a script's own come last).
    for flag in sorted(set(FLAG.findall(prose(page))) - known):
        lines = [ln for ln in page.read_text().splitlines() if flag in ln]
        assert any("refused" in ln or "error:" in ln for ln in lines), \
            f"docs/launcher.md names {flag}, which `elastictk-run --help` does not list: fix the page"
        with pytest.raises(UsageError, match="not supported"):
            parse_args([flag, "x", "train.py"], environ={}, check=False)


def test_every_chaos_flag_in_the_docs_exists() -> None:
    page = ROOT / "docs" / "chaos.md"
    known = help_flags("elastictk-chaos") | help_flags("elastictk-run")
    unknown = sorted(set(FLAG.findall(prose(page))) - known)
    assert not unknown, f"docs/chaos.md names flags neither elastictk-chaos nor elastictk-run has: {unknown}"


# -- links and paths ---------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", prose(page), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_paths_exist(page: Path) -> None:
    text = prose(page)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"link {target}: no file {dest}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"link {target}: {dest.name} has no heading #{frag}")
    for path in REPO_PATH.findall(page.read_text()):
        if not (ROOT / path).exists():
            broken.append(f"path `{path}` does not exist")
    assert not broken, f"{page.name}: " + "; ".join(broken)


# -- dotted names ------------------------------------------------------------------------------

RESOLVE = textwrap.dedent('''
    import importlib, json, sys, warnings

    def resolve(name):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError as e:
                if e.name is None or not ".".join(parts[:cut]).startswith(e.name):
                    raise
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
        raise ImportError(name)

    out = {}
    for name in json.load(sys.stdin):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                resolve(name)
                error = None
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        moved = [str(w.message) for w in caught
                 if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]
        out[name] = {"error": error, "moved": moved}
    print(json.dumps(out))
''')


@dataclass
class Resolved:
    error: str | None  # why the name does not import
    moved: list[str]  # the "X moved to Y" DeprecationWarnings its import gave


def resolve_all(names: list[str]) -> dict[str, Resolved]:
    r = subprocess.run([PY, "-c", RESOLVE], input=json.dumps(names), capture_output=True, text=True,
                       timeout=120, env=environment(ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return {k: Resolved(v["error"], v["moved"]) for k, v in json.loads(r.stdout.splitlines()[-1]).items()}


def doc_names() -> dict[str, str]:
    """Dotted names in the docs, each with the first page naming it."""
    names: dict[str, str] = {}
    for page in PAGES:
        for name in DOTTED.findall(page.read_text()):
            names.setdefault(name, page.name)
    return names


def moved_rows() -> list[list[str]]:
    """CHANGELOG.md's old → new table: [old, new, ...] per row."""
    table, _ = region((ROOT / "CHANGELOG.md").read_text(), "moved-paths")
    return [re.findall(r"`(elastictk[\w.]*)`", ln) for ln in table.splitlines() if ln.startswith("| `")]


@pytest.fixture(scope="module")
def resolved() -> dict[str, Resolved]:
    """Every name resolved in one interpreter; the old paths last, after every new one, so each
    old path's warning is its own (an old path warns only the first time it is used)."""
    rows = moved_rows()
    news = [n for row in rows for n in row[1:]]
    return resolve_all(list(dict.fromkeys([*sorted(doc_names()), *news, *(row[0] for row in rows)])))


def test_every_dotted_name_in_the_docs_imports_from_its_current_path(
        resolved: dict[str, Resolved]) -> None:
    names = doc_names()
    assert len(names) > 30
    bad = []
    for name in sorted(names):
        r = resolved[name]
        if r.error:
            bad.append(f"{names[name]}: {name} does not import ({r.error})")
        elif r.moved:
            bad.append(f"{names[name]}: {name} is an old path: {r.moved[0]}")
    assert not bad, "\n".join(bad)


def test_the_changelogs_old_paths_are_gone_and_their_new_ones_import(
        resolved: dict[str, Resolved]) -> None:
    rows = moved_rows()
    assert len(rows) >= 15
    for old, *new in rows:
        got = resolved[old]
        assert got.error is not None and ("ModuleNotFoundError" in got.error or "AttributeError" in got.error), \
            f"{old} still imports ({got}): it was removed in 0.3"
        for n in new:
            assert resolved[n].error is None and not resolved[n].moved, f"{n}: {resolved[n]}"


# -- architecture.md ---------------------------------------------------------------------------

ARCH = ROOT / "docs" / "architecture.md"


def pyproject_layers() -> list[str]:
    """The layers of the import-linter contract (tomllib is 3.11+; the list is plain strings)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^type = "layers"$.*?^layers = \[(.*?)^\]', text, re.S | re.M)
    assert m is not None, "no layers contract in pyproject.toml's [tool.importlinter]"
    return re.findall(r'"([^"]+)"', m.group(1))


def test_the_layers_are_pyprojects() -> None:
    layers = pyproject_layers()
    block = next(b for b in blocks(ARCH) if b.note("layers") is not None)
    shown = [ln.strip() for ln in block.text.splitlines() if ln.strip()]
    assert shown == [" | ".join(p.strip() for p in layer.split("|")) for layer in layers], \
        "docs/architecture.md's layers differ from [tool.importlinter] in pyproject.toml"


def test_architecture_names_every_module() -> None:
    sections = re.split(r"^### ", prose(ARCH), flags=re.M)
    by_package: dict[str, str] = {}
    for s in sections[1:]:
        heading = s.splitlines()[0]
        m = re.match(r"elastictk(?:/(\w+))?", heading)
        if m:
            by_package[m.group(1) or ""] = s
    missing = []
    for path in sorted((ROOT / "elastictk").rglob("*.py")):
        rel = path.relative_to(ROOT / "elastictk")
        if path.name == "__main__.py" and len(rel.parts) == 1 or "__pycache__" in rel.parts:
            continue
        if path.name == "__init__.py" and len(rel.parts) > 1:
            continue
        package = rel.parts[0] if len(rel.parts) > 1 else ""
        inside = "/".join(rel.parts[1:]) if package else rel.name
        if inside.endswith("/__init__.py"):
            continue
        section = by_package.get(package)
        if section is None:
            missing.append(f"a section `### elastictk/{package}`")
        elif f"`{inside}`" not in section:
            missing.append(f"elastictk/{rel}")
    assert not missing, "docs/architecture.md does not describe: " + ", ".join(missing)


def _names(body: list[ast.stmt]) -> set[str]:
    """Functions, classes and assigned names (fields, constants) of one body."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def defined(path: Path) -> set[str]:
    """Qualified names defined at module level and one class level down (``Class.method``)."""
    tree = ast.parse(path.read_text())
    names = _names(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{n}" for n in _names(node.body))
    return names


def test_the_store_key_table_names_real_functions() -> None:
    table, _ = region(ARCH.read_text(), "store-keys")
    refs = re.findall(r"`((?:\w+/)+\w+\.py): ([\w.]+(?:, [\w.]+)*)`", table)
    assert len(refs) > 40
    wrong = []
    for rel, names in refs:
        path = ROOT / "elastictk" / rel
        if not path.exists():
            wrong.append(f"elastictk/{rel} does not exist")
            continue
        have = defined(path)
        wrong += [f"elastictk/{rel} defines no {n}" for n in names.split(", ") if n not in have]
    everywhere = set().union(*(defined(p) for p in (ROOT / "elastictk").rglob("*.py")))
    for name in re.findall(r"`([A-Z]\w+\.\w+)`", table):  # bare `Class.method` mentions
        if name not in everywhere:
            wrong.append(f"no {name} in elastictk")
    assert not wrong, "docs/architecture.md's store-key table: " + "; ".join(wrong)


def test_metrics_page_lists_every_event_kind() -> None:
    from elastictk.metrics.kinds import EventKind

    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [k.value for k in EventKind if f"`{k.value}`" not in text]
    assert not missing, f"docs/metrics.md does not list the event kinds {missing}"


def test_the_change_map_names_real_functions() -> None:
    """``elastictk/x.py`` (`name`, ...) in "where to change what": each name is defined there."""
    table, _ = region(ARCH.read_text(), "change-map")
    wrong, seen = [], 0
    for rel, inside in re.findall(r"`(elastictk/[\w/]+\.py)` \(([^)]*)\)", table):
        have = defined(ROOT / rel)
        for name in re.findall(r"`(\w+)`", inside):
            seen += 1
            if name not in have and not any(h.endswith("." + name) for h in have):
                wrong.append(f"{rel} defines no {name}")
    assert seen > 10
    assert not wrong, "docs/architecture.md's change map: " + "; ".join(wrong)


# -- README ------------------------------------------------------------------------------------

def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:10])
    assert "make demo" in head and "make test" in head
