import sys

from edge0.cli.main import main

sys.exit(main())
