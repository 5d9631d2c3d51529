"""Shared helpers of the benchmark tools: machine description, CPU load, BENCHMARKS.md sections."""

from __future__ import annotations

import argparse
import os
import platform
import re
from pathlib import Path


def machine() -> dict:
    import jax
    import jaxlib

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, AttributeError):
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    dev = jax.devices()[0]
    return dict(cpu=cpu, cores=cores, memory=mem, python=platform.python_version(), jax=jax.__version__,
                jaxlib=jaxlib.__version__, device=f"{dev.platform} ({dev.device_kind})",
                xla_flags=os.environ.get("XLA_FLAGS", ""))


def busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy (``/proc/stat``), or ``None`` off Linux."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def write_section(path: Path, key: str, body: str, tool: str = "bench_decode") -> None:
    """Replaces (or appends) the section ``key`` written by ``tool`` in a Markdown file."""
    begin, end = f"<!-- {tool} {key} -->", f"<!-- /{tool} {key} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n\nFigures written by the tools in `tools/`.\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text, encoding="utf-8")


def at_least(minimum: int):
    """An argparse type: an integer ``>= minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated distinct integers ``>= 1`` (``"1,8"``)."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected comma-separated distinct integers >= 1, got {text!r}")
    return out


def publish(text: str, args, key: str, tool: str) -> None:
    """Prints a tool's section and, unless ``args.no_write``, writes it to ``args.output``
    (:func:`write_section`)."""
    print(text)
    if not args.no_write:
        write_section(Path(args.output), key, text, tool=tool)
