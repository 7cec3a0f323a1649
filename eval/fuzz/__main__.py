import sys

from halo.eval.fuzz.run import main

sys.exit(main())
