from seawall.cli import main

raise SystemExit(main())
