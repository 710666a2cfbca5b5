"""Documentation that runs: every Python and shell block of README.md and docs/*.md, and every relative link.

Blocks fenced as ```python run in this process with a fresh namespace, in a temporary working directory; blocks
fenced as ```bash / ```sh / ```shell run with bash (-e -o pipefail) in a temporary directory that holds links to the
repository's top-level entries, so `python run_clm_gpa.py ...` works there and writes nothing into the checkout.
Blocks without a language, ```text, ```diff and the like are output or patches and are not run.

HTML comments on the lines right above a block's opening fence steer the test; they are invisible on GitHub:

- ``<!-- skip-test: REASON -->``: not run, reported as skipped with REASON (a GPU, the network, minutes of compute).
- ``<!-- test-args: ARGS -->`` (shell): ARGS is appended to every command of the block (before a trailing comment),
  to cap a long training command at a few tiny steps while running exactly the command the page shows.
- ``<!-- test-parse-only: REASON -->`` (shell): every command is ``[VAR=value ...] python SCRIPT ARGS`` of a script
  with ``parse_args(argv)``; the test parses ARGS with it (the flags exist and pass their checks) instead of
  training, for REASON.

Tests are parametrized by file and block number (``README.md:3``), so a failure names the block; the message also
gives its line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell"}
MARKER = re.compile(r"<!--\s*(skip-test|test-args|test-parse-only)\s*:\s*(.*?)\s*-->", re.DOTALL)
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SHELL_TIMEOUT_S = 300
# A shell block that would change the environment the tests run in is refused unless it is marked skip-test.
INSTALLS = re.compile(r"\bpip3?\s+(install|uninstall)\b|-m\s+pip\b|-m\s+venv\b|\bconda\s+install\b|\.ci/run\b")


@dataclass
class Block:
    page: Path
    index: int  # 0-based among the runnable blocks of its page
    lang: str
    line: int  # 1-based line of the opening fence
    code: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.index}"

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)} line {self.line} (block {self.index})"


def read_blocks(page: Path) -> list[Block]:
    """The runnable fenced blocks of one page, with the markers from the comment lines right above each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        lang, start = match.group(1).lower(), i
        end = start + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.relative_to(REPO)} line {start + 1}: a code block is never closed")
        if lang in PYTHON_LANGS | SHELL_LANGS:
            # The comment lines directly above the fence (a marker may span several lines).
            above = start
            while above > 0 and lines[above - 1].strip() and not lines[above - 1].startswith("```"):
                above -= 1
            comments = "\n".join(lines[above:start])
            markers = {key: value for key, value in MARKER.findall(comments)}
            code = "\n".join(lines[start + 1 : end]) + "\n"
            blocks.append(Block(page, len(blocks), lang, start + 1, code, markers))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in read_blocks(page)]


def logical_commands(code: str) -> list[str]:
    """The block's commands, backslash continuations joined; blank and comment-only lines dropped."""
    commands, current = [], ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current)
        current = ""
    return commands


def with_args(command: str, args: str) -> str:
    """`command` with `args` appended, before its trailing comment (a '#' after whitespace) if it has one."""
    parts = re.split(r"(?<=\s)(?=#)", command, maxsplit=1)
    code, comment = parts[0], (parts[1] if len(parts) > 1 else "")
    return f"{code.rstrip()} {args}" + (f"  {comment}" if comment else "")


def _sandbox(tmp_path: Path) -> Path:
    """A working directory that sees the repository's files (as links) but keeps what commands write."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {".git", "outputs"} and not entry.name.startswith(".venv"):
            (work / entry.name).symlink_to(entry)
    return work


def _shell_env() -> dict[str, str]:
    # The commands take the foreach path rather than the fused CPU kernel, so that none waits for the kernel's first
    # build (about 40 s, or longer behind another process's build); the kernel is tests/test_kernels.py's business.
    env = {**os.environ, **OFFLINE, "TOKENIZERS_PARALLELISM": "false", "HF_GPA_DISABLE_CPU_KERNEL": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python`, `accelerate`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _parse_only(block: Block) -> None:
    for command in logical_commands(block.code):
        words = shlex.split(command, comments=True)
        while words and re.match(r"^\w+=", words[0]):
            words.pop(0)
        assert len(words) >= 2 and words[0] == "python", f"{block.where()}: not `python SCRIPT ...`: {command}"
        module = _load_script(REPO / words[1])
        with patch.dict(os.environ, OFFLINE):
            module.parse_args(words[2:])


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[block.name for block in ALL_BLOCKS])
def test_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Python and shell block of the README and docs/ runs as written (or as its marker says)."""
    if "skip-test" in block.markers:
        pytest.skip(f"{block.where()}: {block.markers['skip-test']}")
    if block.lang in PYTHON_LANGS:
        assert set(block.markers) <= {"skip-test"}, f"{block.where()}: only skip-test applies to Python blocks"
        monkeypatch.chdir(tmp_path)
        for name, value in OFFLINE.items():
            monkeypatch.setenv(name, value)
        exec(compile(block.code, f"<{block.where()}>", "exec"), {"__name__": "__main__"})
        return
    if "test-parse-only" in block.markers:
        _parse_only(block)
        return
    code = block.code
    assert not INSTALLS.search(code), f"{block.where()} installs packages or environments: mark it skip-test"
    if "test-args" in block.markers:
        args = " ".join(block.markers["test-args"].split())
        code = "\n".join(with_args(command, args) for command in logical_commands(code)) + "\n"
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=_sandbox(tmp_path),
        env=_shell_env(),
        capture_output=True,
        text=True,
        timeout=SHELL_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{block.where()} exited with {result.returncode}\n--- ran\n{code}\n--- output (tail)\n"
        f"{(result.stdout + result.stderr)[-4000:]}"
    )


# ---- links ----

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (duplicates numbered as GitHub does), skipping code blocks."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not in_code:
            anchor = github_anchor(heading.group(1))
            n = counts.get(anchor, 0)
            found.add(anchor if n == 0 else f"{anchor}-{n}")
            counts[anchor] = n + 1
    return found


def relative_links(page: Path) -> list[tuple[int, str]]:
    links, in_code = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append((number, target))
    return links


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link of the README and docs/ names an existing file, and an existing heading after '#'."""
    broken = []
    for number, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        target_path = (page.parent / path_part).resolve() if path_part else page
        if not target_path.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and target_path.suffix == ".md" and anchor not in anchors(target_path):
            broken.append(f"line {number}: {target} (no heading with anchor #{anchor})")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_docs_are_found() -> None:
    """The docs test sees the README and the docs/ pages, and they hold runnable blocks (so it cannot pass empty)."""
    assert (REPO / "docs").is_dir() and len(PAGES) > 1
    assert any(block.page.name == "README.md" for block in ALL_BLOCKS)
    assert {block.lang for block in ALL_BLOCKS} & PYTHON_LANGS and {block.lang for block in ALL_BLOCKS} & SHELL_LANGS


# ---- what the pages and the code say is for users ----

TRACKER_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_internal_tracker_numbers():
    """The README, docs/, the package, the example scripts and the CI files speak to users: no internal tracker
    numbers ("issue 23"), which a reader cannot look up."""
    files = [*PAGES, *sorted((REPO / "hf_gpa").rglob("*.py")), *sorted(REPO.glob("run_*.py"))]
    files += [path for path in sorted((REPO / ".ci").iterdir()) if path.is_file()]
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if TRACKER_NUMBER.search(line)
    ]
    assert not found, "\n".join(found)


def test_default_runs_state_the_thread_count_of_their_figures():
    """Every mention of a default example run whose figures the docs give (`run_clm_gpa.py --output_dir
    outputs/clm-gpa`, `run_vit_gpa.py --output_dir outputs/vit-gpa`) runs it with OMP_NUM_THREADS=1, as the figures
    were measured: under load two threads took 10 minutes where one took 37 seconds."""
    command = re.compile(r"(\S*\s*)python run_(clm|vit)_gpa\.py --output_dir outputs/(clm|vit)-gpa\b")
    unstated = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        for match in command.finditer(line)
        if "OMP_NUM_THREADS=1" not in match.group(1)
    ]
    assert not unstated, "\n".join(unstated)


# ---- figures the pages state that the code decides ----

#: How the pages state the unset outer lr of GPA across workers: "unset outer lr 6.0 (across workers, mu_x 0.9,
#: mu_y 0.9)". One phrase, so that every such figure can be checked against the code.
UNSET_OUTER_LR = re.compile(
    r"unset outer lr (\d+(?:\.\d+)?) \((one worker|across workers), mu_x (\d+(?:\.\d+)?),\s+mu_y (\d+(?:\.\d+)?)\)"
)
#: Ways of stating such a figure outside the phrase ("7.0 at mu_x = mu_y = 0.9", "6.0 across workers and 7.0 for
#: one"): any left once the phrases are taken out is a figure the test cannot check. GPA's unset outer lr is above 1
#: at any mu_x, mu_y (at least 0.6 (1 + 0.9)); DiLoCo's own (0.6 across workers, 0.7 for one) are below.
UNCHECKED_OUTER_LR = re.compile(
    r"\d+(?:\.\d+)?\s+(?:at|for|with)\s+mu_x\s*=\s*mu_y|\b[1-9]\d*\.\d+\s+(?:across workers|for one\b)",
    re.IGNORECASE,
)


def test_the_unset_outer_lrs_the_page_states_are_the_code_s() -> None:
    """Every unset outer lr of GPA across workers that the README and docs/ state is
    `hf_gpa.optim.default_gpa_outer_lr` at the stated workers, mu_x and mu_y (to the decimals stated), and none is
    stated in another form."""
    from hf_gpa.optim import default_gpa_outer_lr

    stated, wrong, unchecked = 0, [], []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for match in UNSET_OUTER_LR.finditer(text):
            figure, workers, mu_x, mu_y = match.groups()
            expected = default_gpa_outer_lr(1 if workers == "one worker" else None, float(mu_x), float(mu_y))
            decimals = len(figure.partition(".")[2])
            stated += 1
            if round(expected, decimals) != float(figure):
                wrong.append(f"{page.relative_to(REPO)}: {match.group(0)!r}, the code gives {expected:.6g}")
        rest = UNSET_OUTER_LR.sub("", text)
        unchecked += [f"{page.relative_to(REPO)}: {m.group(0)!r}" for m in UNCHECKED_OUTER_LR.finditer(rest)]
    assert stated >= 3, "the pages state the unset outer lr in the checked phrase (one worker and across workers)"
    assert not wrong, "\n".join(wrong)
    phrase = "unset outer lr X (across workers, mu_x A, mu_y B)"
    assert not unchecked, f"state these as {phrase!r}:\n" + "\n".join(unchecked)


#: Blocks that once warned, each found by its page and a line of its code: the step inside backward with an LR
#: scheduler (torch warned "lr_scheduler.step() before optimizer.step()", as the steps ran in backward hooks it does
#: not see) and the Trainer example (torch warned that pin_memory was set without an accelerator).
QUIET_BLOCKS = [
    ("docs/memory.md", "hooks = step_in_backward(optimizer)"),
    ("docs/trainer.md", "trainer = GPATrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])"),
]


@pytest.mark.parametrize("page, line", QUIET_BLOCKS, ids=[page for page, _ in QUIET_BLOCKS])
def test_blocks_run_without_warnings(page: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """These blocks run without a warning (hf_gpa's notice that its C++ kernel is turned off aside): a reader who
    copies them sees none."""
    found = [block for block in read_blocks(REPO / page) if block.lang in PYTHON_LANGS and line in block.code]
    assert len(found) == 1, f"{page}: {len(found)} Python blocks hold {line!r}"
    monkeypatch.chdir(tmp_path)
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(found[0].code, f"<{found[0].where()}>", "exec"), {"__name__": "__main__"})
    shown = [f"{w.category.__name__}: {w.message}" for w in caught if "CPU kernel" not in str(w.message)]
    assert not shown, f"{found[0].where()} warns:\n" + "\n".join(shown)


# ---- pages a reader can take in ----

README_MAX_LINES = 130
PAGE_MAX_LINES = 350
CELL_MAX_CHARS = 250


def table_cells(page: Path) -> list[tuple[int, str]]:
    """(line, text) of every cell of the page's Markdown tables, outside code blocks."""
    cells, in_code = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("|"):
            cells += [(number, cell.strip()) for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    return cells


def test_the_readme_is_a_landing_page() -> None:
    """The README stays short (at most `README_MAX_LINES` lines) and its tables hold one short line per cell (at most
    `CELL_MAX_CHARS` characters): the evidence lives in docs/."""
    readme = REPO / "README.md"
    lines = len(readme.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
    number, longest = max(table_cells(readme), key=lambda cell: len(cell[1]), default=(0, ""))
    assert len(longest) <= CELL_MAX_CHARS, f"README.md line {number}: a cell of {len(longest)} characters: {longest}"


@pytest.mark.parametrize("page", PAGES[1:], ids=[str(page.relative_to(REPO)) for page in PAGES[1:]])
def test_every_docs_page_is_at_most_350_lines(page: Path) -> None:
    """A docs/ page a reader picks by situation is at most `PAGE_MAX_LINES` lines; a longer one is split by topic."""
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= PAGE_MAX_LINES, f"{page.relative_to(REPO)} has {lines} lines (at most {PAGE_MAX_LINES})"
