"""``python -m palatine`` runs the CLI."""

from palatine.cli import main

raise SystemExit(main())
