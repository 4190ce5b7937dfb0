"""`python -m agenticstate`: the `agenticstate` command (see `agenticstate.cli`)."""

from agenticstate.cli import main

if __name__ == "__main__":
    main()
