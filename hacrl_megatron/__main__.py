"""`python -m hacrl_megatron` is the `hacrl` command."""

import sys

from hacrl_megatron.cli import main

sys.exit(main())
