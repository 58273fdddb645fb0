""".nemo → HF (thin wrapper of `nemo-factuality convert nemo-to-hf`)."""

import sys

from nemo_factuality.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "nemo-to-hf", *sys.argv[1:]]))
