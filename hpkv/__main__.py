import sys

from hpkv.cli import main

sys.exit(main())
