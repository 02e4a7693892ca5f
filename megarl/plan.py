"""`python -m megarl.plan`: the layout planner (megarl/reshard/plan.py)."""

from megarl.reshard.plan import main

if __name__ == "__main__":
    main()
