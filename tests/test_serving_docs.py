"""The serving benchmark's pages and files are where make and the docs say.

docs/serving.md is the one page of current figures and the plots; the log of
runs, the full tables and the results files live in bench/serving/history/,
which the ``make serving-report*`` targets (mk/serving.mk) read and write.
These checks read the real Makefile fragment and run the real report writer
(``python -m bench.serving.report``, the command those targets run) on the
committed results files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIST = ROOT / "bench" / "serving" / "history"
LOG = HIST / "README.md"
PAGE = ROOT / "docs" / "serving.md"
MK = (ROOT / "mk" / "serving.mk").read_text()


def _section(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, name
    return text[text.index(begin) : text.index(end)]


def test_docs_hold_no_results_files_and_the_page_no_generated_tables() -> None:
    assert sorted((ROOT / "docs").glob("*.json")) == []
    assert "<!--" not in PAGE.read_text()  # the tables are the log's, not the page's


def test_every_results_file_make_names_is_in_the_history() -> None:
    assert re.search(r"^SERVING_HIST\s*\?=\s*bench/serving/history$", MK, re.M)
    assert re.search(r"^SERVING_MD\s*\?=\s*\$\(SERVING_HIST\)/README\.md$", MK, re.M)
    named = re.findall(r"\$\(SERVING_HIST\)/([\w.-]+\.json)", MK)
    loop = re.search(r"for f in ([^;]+); do", MK)
    assert loop is not None
    pairs = [item.split(":") for item in loop.group(1).replace("\\", " ").split()]
    named += [f"serving-evict-{stem}-results.json" for _, stem in pairs]
    assert len(named) >= 12
    missing = [n for n in named if not (HIST / n).is_file()]
    assert missing == []
    assert "docs/serving.md" not in re.findall(r"--md (\S+)", MK)


def test_report_writes_the_committed_tables_into_the_history(tmp_path: Path) -> None:
    """``make serving-report`` on the committed results reproduces the
    committed tables: the log's tables are what its data files give."""
    log = tmp_path / "README.md"
    shutil.copy(LOG, log)
    before = LOG.read_text()
    for results, section in (
        ("serving-results.json", "tables"),
        ("serving-sglang-results.json", "sglang-tables"),
        ("serving-hybrid-results.json", "hybrid-tables"),
        ("serving-evict-llmd-results.json", "evict-llmd-tables"),
    ):
        # Blank the section first, so a writer that wrote nothing would fail.
        text = log.read_text()
        old = _section(text, section)
        log.write_text(text.replace(old, f"<!-- {section}:begin -->\n"))
        cmd = [sys.executable, "-m", "bench.serving.report", str(HIST / results)]
        r = subprocess.run(
            [*cmd, "--md", str(log), "--section", section],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert _section(log.read_text(), section) == _section(before, section), section


def test_every_figure_is_shown_with_where_it_ran() -> None:
    """Each docs/serving-*.png is on the page, and each image's caption (the
    italic paragraph after it) names the machine: none of them ran on a GPU."""
    page = PAGE.read_text()
    shown = re.findall(r"!\[[^\]]*\]\((serving-[\w-]+\.png)\)\n\n\*([^*]+)\*", page)
    assert sorted(f for f, _ in shown) == sorted(p.name for p in PAGE.parent.glob("serving-*.png"))
    for f, caption in shown:
        assert "2-vCPU development machine, no GPU" in " ".join(caption.split()), f
        assert re.search(r"20\d\d-\d\d-\d\d", caption), f
