"""``python -m homepd``."""
import sys

from homepd.main import main

sys.exit(main())
