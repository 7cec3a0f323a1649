"""`python -m halo.cli`: the same as `halo-master`."""

from halo.cli.master import main

raise SystemExit(main())
