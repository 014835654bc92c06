"""Link rates as people write them (`100mbit`, `1gbit`, `12.5mbps`) and read them (`100 Mbit/s`): the unit of
--bandwidth, read by the configuration, the capacity plan, the benchmarks and the throttled topologies."""

from __future__ import annotations

import re

MIN_RATE_BITS = 1_000_000
MAX_RATE_BITS = 100_000_000_000
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")



def parse_rate(text: str) -> int:
    """Bits per second of a tc-style rate such as `100mbit`, `1gbit` or `12.5mbps` (bytes per second)."""
    match = _RATE.match(str(text).lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"bad rate {text!r}: write a number and a unit, e.g. 100mbit, 1gbit, 500kbit or 10mbps (bytes/s)")
    bits = int(float(match.group(1)) * _UNITS[match.group(2)])
    if not MIN_RATE_BITS <= bits <= MAX_RATE_BITS:
        raise ValueError(f"rate {text!r} is outside the range tc tbf shapes reliably here (1mbit to 100gbit)")
    return bits


def format_rate(bits: float) -> str:
    """A rate in the units people read: `100 Mbit/s`, `1.5 Gbit/s`."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits:.0f} bit/s"
