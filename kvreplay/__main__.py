import sys

from kvreplay.cli import main

sys.exit(main())
