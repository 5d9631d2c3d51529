"""Shared helpers of the benchmark tools: machine description, CPU load, BENCHMARKS.md sections,
argument types, and starting and stopping servers (the serving benchmarks).

Importing it puts this checkout's root on ``sys.path`` after tools/, so the scripts measure the
package of the checkout they belong to.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"  # plots and raw results the benchmarks write (BENCHMARKS.md shows them)
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


def machine() -> dict:
    """CPU, cores, memory, Python, JAX and jaxlib versions, the first device and ``XLA_FLAGS``."""
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, argv: list[str], port: int, log: Path) -> subprocess.Popen:
    """Starts a server and waits (15 minutes at most) until it answers ``/health`` or ``/v1/models``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited early, see {log}")
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                pass
        time.sleep(1)
    raise SystemExit(f"{name} did not come up, see {log}")


def stop(srv: dict) -> None:
    """Stops every server of ``{name: {"proc", ...}}`` (SIGTERM, then a kill after 60 s)."""
    for s in srv.values():
        s["proc"].send_signal(signal.SIGTERM)
    for s in srv.values():
        try:
            s["proc"].wait(60)
        except subprocess.TimeoutExpired:
            s["proc"].kill()
