"""`python -m m31.cli`: the `m31` command without the installed script."""

from m31.cli import main

main()
