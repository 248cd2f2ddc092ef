import sys

from kvbench.report.app import main

sys.exit(main())
