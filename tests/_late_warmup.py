"""``k3serve serve`` whose engine starts compiling its programs ``DELAY`` seconds late: a
process of a multi-host deployment that is slower than the others (a busy host, a cold
compile cache) without being broken. Used by ``test_multihost.py``.

    python _late_warmup.py DELAY serve ...
"""
from __future__ import annotations

import sys
import time

from k3serve.server.cli import main
from k3serve.server.engine.runner import Runner

delay = float(sys.argv[1])
_warmup = Runner.warmup


def late_warmup(self, *args, **kwargs):
    time.sleep(delay)
    return _warmup(self, *args, **kwargs)


Runner.warmup = late_warmup
sys.exit(main(sys.argv[2:]))
