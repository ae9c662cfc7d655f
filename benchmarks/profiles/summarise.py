"""Text summary of a py-spy profile written with ``--format raw`` (collapsed stacks).

    py-spy record -o prof.txt --format raw -r 200 -- python SCRIPT
    python benchmarks/profiles/summarise.py prof.txt [--top 25] [--under FUNCTION]

Prints the share of samples each function is on the stack for (inclusive) and at the top of
(self), the largest first.  ``--under``: only the stacks that pass through a frame whose text
contains FUNCTION (e.g. ``compute_block``), shares relative to those.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (file.py)``: lines dropped so one function is one entry."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    parts = path.replace("\\", "/").split("/")
    tail = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{m.group('fn')} ({tail})"


def summarise(lines: list[str], top: int, under: str | None) -> str:
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [
            short(f)
            for f in stack.split(";")
            if f and not f.startswith("process ") and not f.startswith("thread ")
        ]
        if under is not None:
            hit = [i for i, f in enumerate(frames) if under in f]
            if not hit:
                continue
            frames = frames[hit[0] :]
        n = int(count)
        total += n
        for f in set(frames):
            inclusive[f] += n
        if frames:
            own[frames[-1]] += n
    out = [f"{total} samples" + (f" under {under!r}" if under else "")]
    out.append(f"{'inclusive':>9} {'self':>6}  function")
    for f, n in inclusive.most_common(top):
        out.append(f"{100 * n / max(total, 1):8.1f}% {100 * own[f] / max(total, 1):5.1f}%  {f}")
    out.append("")
    out.append("top self time:")
    for f, n in own.most_common(top):
        out.append(f"{100 * n / max(total, 1):8.1f}%  {f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--under", default=None)
    a = ap.parse_args()
    with open(a.profile) as f:
        print(summarise(f.readlines(), a.top, a.under))


if __name__ == "__main__":
    main()
