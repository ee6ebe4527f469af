from afd.cli import main

raise SystemExit(main())
