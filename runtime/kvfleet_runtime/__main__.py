import sys

from kvfleet_runtime.cli import main

sys.exit(main())
