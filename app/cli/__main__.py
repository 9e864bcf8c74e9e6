"""`python -m app.cli` is the `guard` command (used where the console script is not on PATH)."""

from app.cli import main

main()
