"""The cost a token of a sample's stop strings: this tree's StopStringMatcher against the search it replaced
(``find_stop_string`` + ``partial_stop_length`` of kvserve/engine/output_processor.py at cdbd8b6, read from git).

    python run.py [--rev cdbd8b6]     # from a checkout of kvserve
"""

from __future__ import annotations

import argparse
import subprocess
import time

from kvserve.engine.stop_strings import StopStringMatcher

CASES = {
    # a 1,024-character stop string whose first half the text keeps matching: the old search's worst case
    "16 adversarial stops of 1,024": (["aaaa"] * 500, ["a" * 511 + "b" + "a" * 511 + str(i % 10) for i in range(16)]),
    "2 chat stops": (["hello", " wor", "ld", " and", " more"] * 400, ["\n\n", "User:"]),
    "1 stop": ([" the", " cat", " sat"] * 666, ["</s>"]),
}


def old_search(rev: str) -> dict:
    source = subprocess.run(["git", "show", f"{rev}:kvserve/engine/output_processor.py"], capture_output=True,
                            text=True, check=True).stdout
    namespace: dict = {}
    exec("from typing import Sequence\n" + source[source.index("def find_stop_string"):], namespace)
    return namespace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", default="cdbd8b6")
    old = old_search(parser.parse_args().rev)
    for name, (pieces, stops) in CASES.items():
        start = time.perf_counter()
        text = ""
        for piece in pieces:
            checked, text = len(text), text + piece
            old["find_stop_string"](text, checked, stops)
            old["partial_stop_length"](text, stops)
        before = (time.perf_counter() - start) / len(pieces)
        start = time.perf_counter()
        matcher = StopStringMatcher(stops)
        for piece in pieces:
            matcher.feed(piece)
            matcher.partial_length  # what the output processor reads each token
        after = (time.perf_counter() - start) / len(pieces)
        print(f"{name}: {after * 1e6:.1f} us a token, the old search {before * 1e6:.1f} ({before / after:.1f}x)")


if __name__ == "__main__":
    main()
