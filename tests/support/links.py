"""The rig's links: rates in tc's notation, shaping one end of a link with a token bucket filter (tc tbf), and the
small programs that measure a path between two hosts (what one TCP connection carries, whether a host answers).

tbf rather than netem: netem is missing from some kernels, tbf is not. A link is shaped at both of its ends, so each
direction is.
"""

from __future__ import annotations

import re
import subprocess

#: The token bucket holds at least this many kbit, and at least BURST_S of the rate: a smaller bucket refills too
#: often for fast rates, where tbf then carries well below the rate.
BURST_KBIT, BURST_S = 256, 0.0025
LATENCY = "50ms"  # the longest a packet waits in the bucket's queue
UNSHAPED = "unshaped"
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.IGNORECASE)
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float | None:
    """A link rate in tc's notation ("20mbit", "1gbit") in bits per second; None for "unshaped"."""
    if rate == UNSHAPED:
        return None
    found = _RATE.fullmatch(rate)
    if found is None:
        raise ValueError(f"link rate {rate!r}: expected {UNSHAPED} or a number with bit, kbit, mbit or gbit (20mbit)")
    return float(found.group(1)) * _UNITS[found.group(2).lower()]


def shape(netns: str, dev: str, rate: str) -> None:
    """Shape what leaves dev (in namespace netns) to rate, or remove the shaping ("unshaped")."""
    bits = rate_bits(rate)
    if bits is not None:
        burst = f"{max(BURST_KBIT, round(bits * BURST_S / 1e3))}kbit"
        shaping = ["tbf", "rate", rate, "burst", burst, "latency", LATENCY]
        tc = ["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *shaping]
        subprocess.run(tc, capture_output=True, text=True, check=True)
    else:  # back to the device's default queue; there may be no shaping to remove
        subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)


def qdisc(netns: str, dev: str) -> str:
    """Dev's root queueing discipline, as tc shows it."""
    show = ["tc", "-n", netns, "qdisc", "show", "dev", dev]
    return subprocess.run(show, capture_output=True, text=True, check=False).stdout.strip()


def set_up(netns: str, dev: str, up: bool) -> None:
    subprocess.run(["ip", "-n", netns, "link", "set", "dev", dev, "up" if up else "down"], check=True)


# Counts the bytes of one TCP connection, from the first byte to the sender's close; prints them with the seconds.
RECEIVER = """
import json, socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
conn, _ = server.accept()
total, first = 0, None
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    first = time.perf_counter() if first is None else first
    total += len(data)
print(json.dumps({"bytes": total, "seconds": time.perf_counter() - (first or 0)}))
"""
# Sends zeros to HOST PORT for SECONDS (connecting once the receiver listens).
SENDER = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
chunk, stop = bytes(1 << 16), time.monotonic() + float(sys.argv[3])
while time.monotonic() < stop:
    conn.sendall(chunk)
conn.close()
"""
TRANSFER_PORT = 45678

# Prints "yes" if ADDRESS answers a TCP connection to PORT within SECONDS (a refusal is an answer too), else "no".
ANSWERS = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("yes")
except ConnectionRefusedError:
    print("yes")
except OSError:
    print("no")
"""
CLOSED_PORT = 9  # discard: nothing listens there, so a reachable host refuses at once
