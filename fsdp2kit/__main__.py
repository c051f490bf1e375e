from fsdp2kit.cli import main

raise SystemExit(main())
