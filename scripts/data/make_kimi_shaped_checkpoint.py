"""A random Kimi-K2.6-shaped checkpoint (INT4 routed experts): `ddtree selftest gpu` serves one, and this is
its writer on its own (ddtree.tools.selftest.kimi_checkpoint says what it writes and how).

    python -m scripts.data.make_kimi_shaped_checkpoint --out DIR [--layers 2] [--experts 384] [--hidden 7168] ...
"""

from __future__ import annotations

import sys

from ddtree.tools.selftest.kimi_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
