import sys

from gonka_node.cli import main

sys.exit(main())
