import sys

from fused_contrastive.bench.cli import main

sys.exit(main())
