"""Every Python block of the documentation runs here, or says why it cannot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from docs_snippets import HARNESSES, ROOT, page_snippets, pages, run_page, snippets

RUNNABLE = [p for p in pages() if any(s.runs for s in page_snippets(p))]


def test_the_docs_have_pages_and_runnable_blocks():
    assert len(pages()) > 10 and len(RUNNABLE) >= 5
    names = {str(p.relative_to(ROOT)) for p in RUNNABLE}
    assert {"docs/quickstart.md", "docs/migration/verl.md"} <= names


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_page_runs(page):
    """Each page in a process of its own: a page may start a process group, and a failing one must not
    leave it to the next."""
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    program = f"from docs_snippets import run_page; from pathlib import Path; print(run_page(Path({str(page)!r})))"
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0


def test_every_after_block_of_the_migration_guides_runs():
    """Issue 27: before and after, side by side, each "after" block executed by a test (the "before"
    blocks are the peers' own APIs, on GPUs)."""
    guides = sorted((ROOT / "docs" / "migration").glob("*.md"))
    after = [s for page in guides for s in page_snippets(page) if s.code.startswith("# after")]
    assert len(guides) == 4 and len(after) >= 6, [s.where for s in after]
    assert all(s.reason is None for s in after), [f"{s.where}: {s.reason}" for s in after if s.reason]


def test_verl_after_block_switches_bitwise():
    """The ``verl-switch`` block (``verl_switch.py``): set up, wake the weights, one step, wake the KV cache."""
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(Path(here) / "verl_switch.py")], env=env, capture_output=True,
                          text=True, timeout=180)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result == {"woken": [["weights"], ["kv_cache"]], "differed_before": True, "bitwise_equal": True}


def test_markers_are_read_and_must_say_why():
    page = ("text\n\n<!-- not-run: needs a GPU and NCCL -->\n\n```python\nraise SystemExit\n```\n\n"
            "```python\nx = 1\n```\n\n  ```python\n  y = 2\n  ```\n```bash\nls\n```\n")
    blocks = snippets(page, "p.md")
    assert [(b.line, b.runs, b.code) for b in blocks] == [(6, False, "raise SystemExit"), (10, True, "x = 1"),
                                                           (14, True, "y = 2")]
    assert blocks[0].reason == "needs a GPU and NCCL"
    with pytest.raises(ValueError, match="must say why"):
        snippets("<!-- not-run: gpu -->\n```python\npass\n```\n", "p.md")
    with pytest.raises(ValueError, match="never closes"):
        snippets("```python\npass\n", "p.md")


def test_run_with_names_a_harness_that_runs_the_block_instead_of_its_page():
    block, = snippets("<!-- run-with: vllm-engine -->\n```python\nllm = LLM(model)\n```\n", "p.md")
    assert (block.runs, block.reason, block.harness) == (False, None, "vllm-engine")
    with pytest.raises(ValueError, match="no harness 'vllm-engin' runs blocks"):
        snippets("<!-- run-with: vllm-engin -->\n```python\npass\n```\n", "p.md")


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_every_harness_has_blocks_and_a_test_that_names_it(harness):
    blocks = [s for p in pages() for s in page_snippets(p) if s.harness == harness]
    assert blocks, f"no page has a block for harness {harness}"
    test = ROOT / HARNESSES[harness]
    assert test.is_file() and f'"{harness}"' in test.read_text(), f"{test} does not run harness {harness}"


def test_a_broken_block_fails_its_page(tmp_path):
    page = tmp_path / "broken.md"
    page.write_text("```python\nfrom refit_core import NoSuchThing\n```\n")
    with pytest.raises(ImportError):
        run_page(page)
