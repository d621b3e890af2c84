"""Outputs of the measurement scripts (scripts/*.py): the command that made them, and OUT.md,
OUT.json and OUT.png written side by side."""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Callable


def command_line(script: str, argv=None) -> str:
    """How the script was run, quoted so that it can be pasted back into a shell."""
    return f"python {script} " + shlex.join(sys.argv[1:] if argv is None else argv)


def save_figure(fig, path) -> None:
    """A matplotlib figure to `path` (tight layout, 120 dpi), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out, markdown: str, doc: dict, plot: Callable[[Path], None] | None = None) -> Path:
    """OUT.md <- markdown, OUT.json <- doc (+ the time), OUT.png <- plot(path); returns OUT."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(markdown)
    out.with_suffix(".json").write_text(json.dumps({**doc, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
    if plot is not None:
        plot(out.with_suffix(".png"))
    return out


def write_report(out, script: str, argv, title: str, body: str, doc: dict,
                 plot: Callable[[Path], None] | None = None) -> str:
    """The measurement scripts' report: OUT.md = title, the command that made it, body (which may
    name `{png}`, the plot's file name); OUT.json = doc + the command; OUT.png = plot. -> the markdown."""
    out = Path(out)
    cmd = command_line(script, argv)
    md = f"# {title}\n\nMade by:\n\n    {cmd}\n\n" + body.replace("{png}", out.with_suffix(".png").name)
    write_results(out, md, {"command": cmd, **doc}, plot)
    return md
