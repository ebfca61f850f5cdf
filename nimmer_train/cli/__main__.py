"""``python -m nimmer_train.cli``: the ``nimmer`` command."""

import sys

from nimmer_train.cli import main

sys.exit(main())
