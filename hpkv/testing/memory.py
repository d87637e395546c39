"""What the kernel says about this process's memory, for tests of how hpkv maps it."""

from __future__ import annotations


def resident_bytes_of_mapping(address: int) -> int:
    """Resident bytes of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")
