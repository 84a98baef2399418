import sys

from benchmarks.cli import main

sys.exit(main())
