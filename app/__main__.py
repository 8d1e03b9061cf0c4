"""`python -m app`: the desktop app."""
import sys

from .main import main

sys.exit(main())
