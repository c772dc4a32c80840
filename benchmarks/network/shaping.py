"""Link rates and the tbf shaping of a leg: parse "100mbit", the token bucket for a rate.

Example::

    parse_rate("100mbit")                    # 100000000
    Shaping(parse_rate("1gbit")).tc_args()   # ["tbf", "rate", "1000000000bit", "burst", ...]
"""

from __future__ import annotations

import math
import re


_RATE_UNITS = {
    # bits per second (tc's names; SI units are powers of 1000, IEC ones of 1024)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024**2, "gibit": 1024**3, "tibit": 1024**4,
    # bytes per second
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 1024, "mibps": 8 * 1024**2, "gibps": 8 * 1024**3, "tibps": 8 * 1024**4,
}
_RATE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_rate(rate: str | int | float | None) -> int | None:
    """Parse a tc-style rate into bits per second; ``None``/"none"/"off" mean unshaped.

    Args:
        rate: e.g. "100mbit", "1gbit", "12.5mbps" (bytes/s), "500kbit"; a bare number or an
            int/float is bits per second, as in tc.
    Returns:
        bits per second (int > 0), or None for no shaping.
    Raises:
        ValueError: the string is not a rate.

    Example: ``parse_rate("100mbit") == 100_000_000``
    """
    if rate is None:
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
        text = repr(rate)
    elif isinstance(rate, str):
        text = rate
        if rate.strip().lower() in ("none", "off", "unlimited", "no"):
            return None
        m = _RATE_RE.match(rate)
        unit = m.group("unit").lower() if m else ""
        if not m or (unit and unit not in _RATE_UNITS):
            raise ValueError(
                f"rate must be a number with a tc unit ({', '.join(sorted(_RATE_UNITS))}) "
                f"or 'none', e.g. '100mbit'; got {rate!r}"
            )
        value = float(m.group("num")) * _RATE_UNITS[unit or "bit"]
    else:
        raise ValueError(f"rate must be a string like '100mbit', a number or None; got {rate!r}")
    bits = int(round(value))
    if not math.isfinite(value) or bits < 8000:
        raise ValueError(f"rate must be at least 8kbit (1000 bytes/s); got {text}")
    return bits


class Shaping:
    """The tbf parameters applied to each veth leg (both directions) for one rate.

    Attributes:
        rate_bit: the cap in bits/s.
        burst_bytes: token bucket size. Must be >= rate/HZ or the cap is not reached on kernels
            that refill per tick; we take 10 ms worth (rate/100, right even at HZ=100), but at
            least 16 KiB (>= 10 full-size frames) so small rates still pass whole frames.
        limit_bytes: queue length in bytes: burst + 100 ms at the rate (at least 64 KiB), so
            TCP can keep the link busy without building a huge queue.
    """

    def __init__(self, rate_bit: int) -> None:
        self.rate_bit = int(rate_bit)
        rate_bytes = self.rate_bit / 8.0
        self.burst_bytes = max(int(math.ceil(rate_bytes / 100.0)), 16 * 1024)
        self.limit_bytes = self.burst_bytes + max(int(rate_bytes * 0.1), 64 * 1024)

    def tc_args(self) -> list[str]:
        """Arguments after ``tc qdisc add dev X root``."""
        return [
            "tbf",
            "rate", f"{self.rate_bit}bit",
            "burst", str(self.burst_bytes),
            "limit", str(self.limit_bytes),
        ]

    def __repr__(self) -> str:
        return (
            f"Shaping(rate={format_rate(self.rate_bit)}, burst={self.burst_bytes}B, "
            f"limit={self.limit_bytes}B)"
        )


def format_rate(bits: int | None) -> str:
    """``100000000 -> "100mbit"``; None -> "unlimited"."""
    if bits is None:
        return "unlimited"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and (bits * 1000) % scale == 0:
            return f"{bits // scale if bits % scale == 0 else bits / scale}{unit}"
    return f"{bits}bit"


def shaping_for(rate: str | int | float | None) -> Shaping | None:
    """The :class:`Shaping` used for ``rate`` (None when unshaped)."""
    bits = parse_rate(rate)
    return None if bits is None else Shaping(bits)


_UNSHAPED_BIT = 10 * 10**9  # an uncapped veth carries a few Gbit/s here; size its buffers for 10
_MIN_TCP_BUFFER = 6 << 20  # the kernel's default tcp_rmem maximum


def tcp_buffer_bytes(rate_bit: int | None, delay_ms: float) -> int:
    """Socket buffer maximum for a link: twice its bandwidth-delay product, at least 6 MiB.

    The round trip is twice the one-way ``delay_ms``; an unshaped link (``rate_bit`` None) counts
    as 10 Gbit/s. TCP grows a connection's window only up to what its buffers allow, so a
    smaller maximum caps throughput on a long link (1 Gbit/s at 40 ms RTT keeps 5 MB in flight).

    Example: ``tcp_buffer_bytes(10**9, 20.0) == 10_000_000``
    """
    rtt_s = 2 * delay_ms / 1e3
    bdp = (rate_bit or _UNSHAPED_BIT) / 8 * rtt_s
    return max(_MIN_TCP_BUFFER, int(math.ceil(2 * bdp)))
