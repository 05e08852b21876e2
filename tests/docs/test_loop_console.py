"""``refit demo --loop``'s console: rows above the bar on a terminal, rows only (no redraws) off one."""

import io
import subprocess
import sys

from refit_core.tools.demo.console import StepConsole

ROWS = [f"{step:>4}  0.250  1.0e-13  row {step}" for step in range(1, 4)]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(bar_stream, rows):
    console = StepConsole(len(ROWS), bar_stream=bar_stream, rows=rows)
    for line in ROWS:
        console.row(line, reward="0.250")
    console.close()
    return console


def test_off_a_terminal_the_rows_are_written_and_no_bar_at_all():
    log = io.StringIO()
    run(log, log)
    assert log.getvalue() == "".join(line + "\n" for line in ROWS)


def test_on_a_terminal_the_bar_redraws_below_the_rows():
    terminal = Terminal()
    run(terminal, terminal)
    text = terminal.getvalue()
    assert "\r" in text and "3/3" in text and "reward=0.250" in text
    positions = [text.index(line) for line in ROWS]
    assert positions == sorted(positions)


def test_a_log_file_of_a_real_process_holds_only_the_table(tmp_path):
    """stdout and stderr both into one file, as `refit demo --loop > log 2>&1` does."""
    program = ("from refit_core.tools.demo.console import StepConsole\n"
               f"c = StepConsole({len(ROWS)})\n"
               f"for line in {ROWS!r}: c.row(line, reward='0.250')\n"
               "c.close()\n")
    log = tmp_path / "loop.log"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-c", program], stdout=out, stderr=subprocess.STDOUT, check=True,
                       timeout=60)
    assert log.read_text() == "".join(line + "\n" for line in ROWS)
