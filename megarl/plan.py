"""`python -m megarl.plan`: the layout planner (megarl/reshard/plan.py)."""

import sys

from megarl.reshard.plan import main

if __name__ == "__main__":
    sys.exit(main())
