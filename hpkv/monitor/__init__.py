"""Read-only views of a running hpkv server, for people (``hpkv-top``) and scrapers (metrics).

Everything here reads the stats segment and the ring headers in the pool
directory, never the server's sockets: a monitor works while the server is
busy, stuck or gone, and cannot slow it down.

* :mod:`hpkv.monitor.rings`  fill level of a ring file without attaching an end;
* :mod:`hpkv.monitor.sample` follows the server of a pool directory, turns
  counters into rates and keeps a minute of history;
* :mod:`hpkv.monitor.frame`  a :class:`~hpkv.monitor.sample.View` → lines of
  text for a given width and height (shared by curses, ``--once`` and tests).
"""
