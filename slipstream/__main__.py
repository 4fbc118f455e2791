"""`python -m slipstream ...` is the `slipstream` command."""

from slipstream.cli import main

raise SystemExit(main())
