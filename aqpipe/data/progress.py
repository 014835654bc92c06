"""Progress of data preparation (BPE training, tokenization) on stderr, so a large corpus never looks like a hang.

On a terminal: a tqdm bar in characters. Otherwise (a log, a CI job): one line when a step starts and one when it
ends, for steps over QUIET_BELOW characters (small corpora take a second and stay silent).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

QUIET_BELOW = 4_000_000  # characters


@contextmanager
def preparing(what: str, total_chars: int) -> Iterator[Callable[[int], None]]:
    """Report the progress of `what` over `total_chars` characters; yields `advance(n)` for every n characters done."""
    if total_chars < QUIET_BELOW:
        yield lambda n: None
        return
    size = f"{total_chars / 1e6:.1f} M characters"
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total_chars, desc=f"aqpipe: {what}", unit="char", unit_scale=True, file=sys.stderr,
                  leave=False) as bar:
            yield bar.update
        print(f"aqpipe: {what}: {size} done", file=sys.stderr, flush=True)
        return
    start = time.monotonic()
    print(f"aqpipe: {what}: {size} ...", file=sys.stderr, flush=True)
    yield lambda n: None
    print(f"aqpipe: {what}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
