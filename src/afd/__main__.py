from afd.cli.main import main

raise SystemExit(main())
