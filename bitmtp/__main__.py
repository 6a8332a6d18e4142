import sys

from bitmtp.cli import main

sys.exit(main())
