"""``python -m homepd.cli``."""
import sys

from homepd.cli.main import main

sys.exit(main())
