import sys

from roundalign.cli import main

sys.exit(main())
