"""One screen of ``hpkv-top``: a :class:`~hpkv.monitor.sample.View` → lines of text.

Pure functions of (view, width, height): no curses, no clock, no I/O, so
``hpkv-top --once`` prints exactly what the full-screen monitor draws and tests
can check a frame without a terminal.

Layout, top to bottom: a title line (server, uptime, pool directory), the pool,
the storage tier, the traffic table with sparklines of the last minute, then the
namespace, worker, engine and ring tables. Width decides which table columns
are shown (each column has a priority; the lowest priorities go first when the
screen is narrow) and how long the sparklines are; height decides how many table
rows are shown (the rest are counted in a "+ N more" line).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hpkv.config import format_size
from hpkv.monitor.sample import HISTORY_S, View
from hpkv.monitor.status import remote_summary
from hpkv.protocol.stats import STORAGE_HEALTH_COUNTERS, TIERS

#: (text, style); style is one of "title", "head", "text", "warn", "dim".
Line = tuple[str, str]

SPARK_UNICODE = "▁▂▃▄▅▆▇█"
SPARK_ASCII = "_.-:=+*#"
MIN_WIDTH = 40


# ================================================================ formatting
def fmt_count(n: float, width: int = 0) -> str:
    """An integer as is when it fits ``width``, else with a k/M/G suffix."""
    text = str(int(n))
    if not width or len(text) <= width:
        return text
    for div, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        short = f"{n / div:.1f}{unit}"
        if len(short) <= width:
            return short
        short = f"{n / div:.0f}{unit}"
        if len(short) <= width:
            return short
    return text


def fmt_rate(x: float) -> str:
    """A per-second count: 3 significant digits."""
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def fmt_bps(x: float) -> str:
    """Bytes per second in decimal units (GB/s as storage and PCIe are quoted)."""
    for div, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B/s"


def fmt_seconds(s: float) -> str:
    """Prefill time saved: ms below a second, s below an hour, then h (negative: a loss)."""
    a = abs(s)
    if a < 1:
        return f"{s * 1000:.0f}ms"
    if a < 3600:
        return f"{s:.1f}s"
    return f"{s / 3600:.1f}h"


def fmt_duration(s: float) -> str:
    s = int(max(0, s))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s"


def cpu_list(cpus: Sequence[int]) -> str:
    """[0,1,2,3,8] → '0-3,8'."""
    out: list[str] = []
    cpus = sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out) or "-"


def clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…" if width > 0 else ""


def join_fit(parts: Sequence[str], width: int, sep: str = "  ") -> str:
    """Parts in priority order, as many as fit whole, in their given order."""
    out = ""
    for p in parts:
        cand = p if not out else out + sep + p
        if len(cand) > width:
            break
        out = cand
    return out or clip(parts[0], width) if parts else ""


def sparkline(points: Sequence[tuple[float, float]], width: int, chars: str) -> str:
    """``points`` = [(age in s, value)], oldest first → ``width`` cells spanning the last HISTORY_S.

    Each cell shows the mean of the samples that fall in it, scaled to the
    largest cell; cells with no sample yet are blank.
    """
    if width <= 0:
        return ""
    sums = [0.0] * width
    counts = [0] * width
    for age, value in points:
        if 0 <= age <= HISTORY_S:
            i = min(width - 1, int((HISTORY_S - age) / HISTORY_S * width))
            sums[i] += value
            counts[i] += 1
    means = [s / c if c else None for s, c in zip(sums, counts, strict=False)]
    top = max((m for m in means if m is not None), default=0.0)
    cells = []
    for m in means:
        if m is None:
            cells.append(" ")
        elif top <= 0 or m <= 0:
            cells.append(chars[0])
        else:
            cells.append(chars[max(1, min(len(chars) - 1, round(m / top * (len(chars) - 1))))])
    return "".join(cells)


# ================================================================ tables
@dataclass
class Col:
    head: str
    width: int
    prio: int  # lower is kept longer when the screen narrows
    get: Callable[[Any], str]
    align: str = ">"
    flex: int = 0  # a flexible column grows up to this width


def table(cols: Sequence[Col], rows: Sequence[Any], width: int) -> tuple[str, list[str]]:
    """Header and row lines with the columns that fit ``width`` (by priority), flex columns grown."""
    chosen: list[Col] = []
    used = 0
    for c in sorted(cols, key=lambda c: c.prio):
        need = c.width + (1 if chosen else 0)
        if used + need <= width:
            chosen.append(c)
            used += need
    chosen.sort(key=cols.index)
    widths = {id(c): c.width for c in chosen}
    spare = width - used
    for c in chosen:
        if c.flex and spare > 0:
            longest = max([len(c.head)] + [len(c.get(r)) for r in rows])
            grow = min(spare, max(0, min(c.flex, longest) - c.width))
            widths[id(c)] += grow
            spare -= grow

    def cell(c: Col, text: str) -> str:
        w = widths[id(c)]
        text = clip(text, w)
        return text.ljust(w) if c.align == "<" else text.rjust(w)

    head = " ".join(cell(c, c.head) for c in chosen).rstrip()
    body = [" ".join(cell(c, c.get(r)) for c in chosen).rstrip() for r in rows]
    return head, body


@dataclass
class Section:
    head: Line
    rows: list[Line]
    what: str  # "namespaces", "workers", ... for the "+ N more" line
    items: list[int] | None = None  # items per row where a row holds several (rings); else one each

    def hidden(self, shown_rows: int) -> int:
        return sum(self.items[shown_rows:]) if self.items else len(self.rows) - shown_rows


# ================================================================ the frame
def render(view: View, width: int, height: int | None = None, unicode: bool = True) -> list[Line]:
    """The frame for a ``width`` × ``height`` screen (``height`` None: as tall as needed)."""
    width = max(MIN_WIDTH, width)
    if view.status != "up":
        lines = _waiting(view, width)
    else:
        lines = _server(view, width, height, SPARK_UNICODE if unicode else SPARK_ASCII)
    lines = [(clip(t, width), s) for t, s in lines]
    if not unicode:
        lines = [(t.replace("…", "~"), s) for t, s in lines]
    return lines if height is None else lines[:height]


def render_text(view: View, width: int, height: int | None = None, unicode: bool = True) -> str:
    return "\n".join(t.rstrip() for t, _ in render(view, width, height, unicode))


def _title(view: View, width: int, left: str) -> Line:
    right = f"{time.strftime('%H:%M:%S', time.localtime(view.wall_time))}  every {view.interval:g}s  q quit"
    if len(left) + 2 + len(right) > width:
        right = time.strftime("%H:%M:%S", time.localtime(view.wall_time))
    gap = max(1, width - len(left) - len(right))
    return clip(left + " " * gap + right, width).ljust(width), "title"


def _waiting(view: View, width: int) -> list[Line]:
    lines = [_title(view, width, "hpkv-top"), ("", "text")]
    if view.status == "starting":
        lines.append((f"hpkv server pid {view.pid} holds the pool directory {view.pool_dir}", "warn"))
        if view.error:  # it never will: a server of another hpkv version
            lines += [(part.strip(), "warn") for part in view.error.split(": ", 1)]
        else:
            lines.append(("but has not published its stats segment yet: starting", "text"))
    else:
        lines.append((f"no hpkv server is running for the pool directory {view.pool_dir}", "warn"))
        if view.source:
            lines.append((f"(HPKV_SHARE_MEM_FILE_PATH from {view.source})", "dim"))
        if view.gone:
            pid, when = view.gone
            lines.append(
                (f"server pid {pid} went away at {time.strftime('%H:%M:%S', time.localtime(when))}", "text")
            )
    lines.append(("", "text"))
    lines.append(
        (f"waiting for a server (checking every {view.interval:g}s); start one with `hpkv serve`", "dim")
    )
    return lines


def _server(view: View, width: int, height: int | None, chars: str) -> list[Line]:
    s = view.snap or {}
    srv = s.get("server", {})
    left = (
        f"hpkv-top  server {view.pid}  up {fmt_duration(view.wall_time - srv.get('start_time', view.wall_time))}"
        f"  {srv.get('pool_dir') or view.pool_dir}"
    )
    top: list[Line] = [_title(view, width, left)]
    if view.heartbeat_stale:
        top.append((f"server not responding: last heartbeat {srv['heartbeat_age_s']:.0f}s ago", "warn"))
    if view.error:
        top.append((view.error, "warn"))
    top += _pool(s, width)
    top += _storage(s, width)
    top += _traffic(view, width, chars)
    sections = [_namespaces(s, width), _workers(view, width), _engines(s, width), _rings(view, width)]
    return top + _fit(sections, None if height is None else height - len(top))


def _pool(s: dict[str, Any], width: int) -> list[Line]:
    p = s.get("pool", {})
    cap, used = p.get("capacity_bytes", 0), p.get("used_bytes", 0)
    pct = 100.0 * used / cap if cap else 0.0
    bar_w = 10 if width < 100 else 20
    fill = round(pct / 100 * bar_w)
    parts = [
        f"POOL     {format_size(used)} / {format_size(cap)} used ({pct:.0f}%)",
        "[" + "#" * fill + "." * (bar_w - fill) + "]",
        f"pinned {format_size(p.get('pinned_bytes', 0))}",
        f"blocks {p.get('blocks', 0)}",
        f"engines {len(s.get('clients', []))}",
        f"requests {fmt_count(s.get('requests', 0))}",
        f"errors {s.get('errors', 0)}",
        f"worker restarts {s.get('worker_restarts', 0)}",
    ]
    warm = p.get("warm_bytes", cap)
    if cap and warm < cap:  # the pool's memory is still being allocated in the background
        parts.insert(4, f"warming {100.0 * warm / cap:.0f}%")
    # keep the bar next to its figure only if the pinned and block counts still fit after it
    line = join_fit(parts, width)
    if "blocks" not in line:
        line = join_fit([parts[0]] + parts[2:], width)
    return [(line, "text")]


def _storage(s: dict[str, Any], width: int) -> list[Line]:
    st = s.get("storage")
    path = (st or {}).get("path") or s.get("server", {}).get("storage")
    if not path:
        return [("STORAGE  disabled (HPKV_KV_STORAGE_PATH is empty)", "dim")]
    if not st:
        return [(f"STORAGE  {path}", "text"), ("         (this server publishes no storage figures)", "dim")]
    cap = st.get("capacity_bytes", 0)
    figures = "  ".join(
        [
            f"{st.get('files', 0)} files",
            format_size(st.get("bytes", 0)) + (f" of {format_size(cap)}" if cap else " (no limit)"),
            f"free {format_size(st.get('free_bytes', 0))}",
        ]
    )
    # a long path gives way to the figures (down to 16 characters of it)
    first = f"STORAGE  {clip(path, max(16, width - len(figures) - 11))}  {figures}"
    errors, quarantined = st.get("io_errors", 0), st.get("quarantined", 0)
    parts = [f"         io errors {errors}", f"quarantined {quarantined}"]
    if st.get("spill_paused"):
        parts.append("SPILL PAUSED (low free space)")
    if st.get("o_direct"):
        parts.append("O_DIRECT on")
    else:
        reason = st.get("o_direct_reason")
        odirect = "O_DIRECT off" + (f" ({reason})" if reason else "")
        used = len("  ".join(parts)) + 2
        if used + len(odirect) > width:  # the reason, cut to the room left, or just "off"
            odirect = clip(odirect, width - used) if width - used >= 20 else "O_DIRECT off"
        parts.append(odirect)
    parts += [
        f"spills {fmt_count(st.get('spills', 0))}",
        f"promotes {fmt_count(st.get('promotes', 0))}",
        f"evicted files {fmt_count(st.get('evicted_files', 0))}",
    ]
    second = join_fit(parts, width)
    bad = errors or quarantined or st.get("spill_paused") or not st.get("o_direct")
    lines: list[Line] = [(first, "text"), (second, "warn" if bad else "text")]
    if st.get("state") == "degraded":
        since = st.get("degraded_since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
        reason = st.get("degraded_reason") or "the file system answers late"
        lines.append((clip(f"         DEGRADED{when}: {reason}", width), "warn"))
    shown = [f"{label} {fmt_count(st[k])}" for k, label, _ in STORAGE_HEALTH_COUNTERS if st.get(k)]
    if shown:
        lines.append((join_fit(["        ", *shown], width), "text"))
    rt = st.get("remote")
    if rt:
        state, counters = remote_summary(rt)
        lines.append((clip(f"REMOTE   {state}", width), "warn" if rt.get("down") else "text"))
        lines.append((join_fit(["        ", *counters], width), "text"))
    return lines


# Traffic rows: (label, series of the rate, series of the token rate or None, is bytes)
_TRAFFIC = (
    ("hits DRAM", "hits_dram", "tokens_dram", False),
    ("hits storage", "hits_storage", "tokens_storage", False),
    ("misses", "misses", None, False),
    ("device->pool", "dev_save", None, True),
    ("pool->device", "dev_load", None, True),
    ("storage write", "io_write", None, True),
    ("storage read", "io_read", None, True),
)


def _traffic(view: View, width: int, chars: str) -> list[Line]:
    # label 14 | per s 10 | tokens/s 11 | total 11 | tokens 13 | sparkline
    fixed = 14 + 1 + 10 + 1 + 11 + 1 + 11 + 1 + 13 + 2
    spark_w = max(0, min(int(HISTORY_S / max(view.interval, 1e-3)), 60, width - fixed))
    show_tokens_total = spark_w >= 12 or width >= fixed + 12
    head = f"{'TRAFFIC':14} {'per s':>10} {'tokens/s':>11} {'total':>11}"
    if show_tokens_total:
        head += f" {'tokens':>13}"
    if spark_w:
        head += "  " + f"last {HISTORY_S:.0f}s".ljust(spark_w)
    lines: list[Line] = [(head, "head")]
    for label, series, tok_series, is_bytes in _TRAFFIC:
        rate = view.rates.get(series, 0.0)
        total = view.totals.get(series, 0)
        if is_bytes:
            row = f"{label:14} {fmt_bps(rate):>22} {format_size(total):>11}"
            if show_tokens_total:
                row += " " * 14
        else:
            tok_rate = fmt_rate(view.rates.get(tok_series, 0.0)) if tok_series else ""
            row = f"{label:14} {fmt_rate(rate):>10} {tok_rate:>11} {fmt_count(total, 11):>11}"
            if show_tokens_total:
                tok_total = fmt_count(view.totals.get(tok_series, 0), 13) if tok_series else ""
                row += f" {tok_total:>13}"
        if spark_w:
            row += "  " + sparkline(view.history.get(series, []), spark_w, chars)
        lines.append((row, "text"))
    return lines


def _namespaces(s: dict[str, Any], width: int) -> Section:
    cols = [
        Col("NAMESPACE", 12, 0, lambda n: n["name"], "<", flex=32),
        Col("TP", 3, 8, lambda n: str(n.get("world_size", ""))),
        Col("TOK/BLK", 7, 9, lambda n: str(n.get("block_tokens", "") or "-")),
        Col("DRAM BLK", 8, 1, lambda n: fmt_count(n.get("blocks_dram", 0), 8)),
        Col("DRAM", 9, 6, lambda n: format_size(n.get("bytes_dram", 0))),
        Col("STORED", 7, 4, lambda n: fmt_count(n.get("blocks_storage", 0), 7)),
        Col("PINNED", 6, 5, lambda n: fmt_count(n.get("blocks_pinned", 0), 6)),
        Col("RSVD", 5, 12, lambda n: fmt_count(n.get("blocks_reserved", 0), 5)),
        Col("HITS DRAM", 9, 2, lambda n: fmt_count(n.get("hits_dram", 0), 9)),
        Col("HITS STOR", 9, 3, lambda n: fmt_count(n.get("hits_storage", 0), 9)),
        Col("MISSES", 7, 3, lambda n: fmt_count(n.get("misses", 0), 7)),
        Col("LOOKUPS", 8, 10, lambda n: fmt_count(n.get("lookups", 0), 8)),
        Col("EVICT", 6, 7, lambda n: fmt_count(n.get("evictions", 0), 6)),
        Col("COMMITS", 8, 11, lambda n: fmt_count(n.get("commits", 0), 8)),
        Col("RSV FAIL", 8, 13, lambda n: fmt_count(n.get("reserve_failed", 0), 8)),
        # prefill time the hits saved (less the loads' time), both tiers, then each
        Col("TIME SAVED", 10, 7, lambda n: fmt_seconds(sum(_tier(n, t, "time_saved_s") for t in TIERS))),
        Col("SAVED DRAM", 10, 12, lambda n: fmt_seconds(_tier(n, "dram", "time_saved_s"))),
        Col("SAVED STOR", 10, 12, lambda n: fmt_seconds(_tier(n, "storage", "time_saved_s"))),
        Col("STORED B", 9, 13, lambda n: format_size(_tier(n, "storage", "bytes"))),
    ]
    nss = s.get("namespaces", [])
    head, rows = table(cols, nss, width)
    return Section(
        (head, "head"), [(r, "text") for r in rows] or [("(no namespace attached)", "dim")], "namespaces"
    )


def _tier(n: dict[str, Any], tier: str, key: str) -> Any:
    """A namespace's figure for one tier (0 from a server that does not publish it)."""
    return ((n.get("tiers") or {}).get(tier) or {}).get(key, 0)


def _workers(view: View, width: int) -> Section:
    s = view.snap or {}

    def busy(w: dict[str, Any]) -> str:
        b = view.worker_busy.get(w["slot"])
        return "-" if b is None else f"{100 * b:.0f}%"

    def inflight(w: dict[str, Any]) -> str:
        # the batch being copied (INFLIGHT_SEQ) plus the batches queued in its request ring
        running = 1 if w.get("inflight_seq") else 0
        rings = w.get("rings") or []
        level = view.rings.get(rings[0]) if rings else None
        return str(running + (level.depth if level else 0))

    def node(w: dict[str, Any]) -> str:
        n = w.get("numa_node")
        return "-" if n is None or n < 0 else str(n)

    cols = [
        Col("SLOT", 4, 11, lambda w: str(w["slot"])),
        Col("KIND", 8, 1, lambda w: w.get("kind", "?"), "<"),
        Col("PID", 7, 0, lambda w: str(w.get("pid", ""))),
        Col("DEVICE", 6, 5, lambda w: str(w.get("device", "-")), "<", flex=12),
        Col("NODE", 4, 6, node),
        Col("CPUS", 6, 7, lambda w: cpu_list(w.get("cpus") or []), "<", flex=16),
        Col("BUSY", 5, 2, busy),
        Col("INFL", 4, 3, inflight),
        Col("JOBS", 8, 9, lambda w: fmt_count(w.get("jobs", 0), 8)),
        Col("FAILED", 6, 10, lambda w: fmt_count(w.get("jobs_failed", 0), 6)),
        Col("SAVED", 9, 12, lambda w: format_size(w.get("bytes_saved", 0))),
        Col("LOADED", 9, 13, lambda w: format_size(w.get("bytes_loaded", 0))),
        Col("RST", 3, 8, lambda w: str(w.get("restarts", 0))),
        Col("STATE", 8, 4, lambda w: w.get("state", "?"), "<"),
    ]
    workers = s.get("workers", [])
    head, rows = table(cols, workers, width)
    styled = [
        (r, "warn" if w.get("state") in ("dead", "backoff", "hung") else "text")
        for r, w in zip(rows, workers, strict=False)
    ]
    return Section((head, "head"), styled or [("(no worker: no device registered yet)", "dim")], "workers")


def _engines(s: dict[str, Any], width: int) -> Section:
    names = {n["id"]: n["name"] for n in s.get("namespaces", [])}
    cols = [
        Col("ENGINE", 6, 3, lambda c: str(c.get("id", ""))),
        Col("PID", 7, 0, lambda c: str(c.get("pid", ""))),
        Col(
            "NAMESPACE",
            12,
            1,
            lambda c: ",".join(names.get(i, str(i)) for i in c.get("namespaces", [])) or "-",
            "<",
            flex=40,
        ),
        Col("RANKS", 5, 2, lambda c: ",".join(map(str, c.get("ranks", []))) or "-", "<", flex=12),
        Col("NAME", 10, 4, lambda c: c.get("name") or "-", "<", flex=30),
    ]
    clients = s.get("clients", [])
    head, rows = table(cols, clients, width)
    return Section(
        (head, "head"), [(r, "text") for r in rows] or [("(no engine attached)", "dim")], "engines"
    )


def _rings(view: View, width: int) -> Section:
    items = []
    for name, level in view.rings.items():
        items.append(f"{name} {level.depth}/{level.capacity}" if level else f"{name} ?")
    rows: list[Line] = []
    counts: list[int] = []
    line, n = "", 0
    for it in items:
        cand = it if not line else line + "   " + it
        if line and len(cand) > width:
            rows.append((line, "text"))
            counts.append(n)
            line, n = it, 1
        else:
            line, n = cand, n + 1
    if line:
        rows.append((line, "text"))
        counts.append(n)
    if not rows:
        return Section(("RINGS (queued descriptors / capacity)", "head"), [("(no ring)", "dim")], "rings")
    return Section(("RINGS (queued descriptors / capacity)", "head"), rows, "rings", counts)


def _fit(sections: list[Section], avail: int | None) -> list[Line]:
    """Headers and rows of every section in ``avail`` lines; blank lines between sections if room."""
    if avail is None:
        out: list[Line] = []
        for sec in sections:
            out += [("", "text"), sec.head, *sec.rows]
        return out
    # drop whole sections from the bottom until every kept one has its header and one row
    keep = list(sections)
    while keep and sum(1 + min(1, len(sec.rows)) for sec in keep) > avail:
        keep.pop()
    shown = {id(sec): min(1, len(sec.rows)) for sec in keep}
    budget = avail - sum(1 + shown[id(sec)] for sec in keep)

    def need_more(sec: Section) -> bool:
        return shown[id(sec)] < len(sec.rows)

    # round-robin one row at a time, so no table starves the others
    progress = True
    while budget > 0 and progress:
        progress = False
        for sec in keep:
            if budget > 0 and need_more(sec):
                shown[id(sec)] += 1
                budget -= 1
                progress = True
    blanks = min(budget, len(keep))
    out = []
    for i, sec in enumerate(keep):
        if i < blanks:
            out.append(("", "text"))
        n = shown[id(sec)]
        if n < len(sec.rows):
            # the last visible line says how many are hidden
            out += [sec.head, *sec.rows[: n - 1], (f"+ {sec.hidden(n - 1)} more {sec.what}", "dim")]
        else:
            out += [sec.head, *sec.rows[:n]]
    return out
