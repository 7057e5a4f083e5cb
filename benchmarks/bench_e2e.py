"""End-to-end mini benchmark (same as `shoal bench`): see shoal/bench.py.

    PYTHONPATH=src python3 benchmarks/bench_e2e.py [--batches 1 16 64] [--prefill-len 2048]
"""

import sys

from shoal.bench import main

if __name__ == "__main__":
    sys.exit(main())
