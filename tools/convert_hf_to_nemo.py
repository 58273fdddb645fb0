"""HF → .nemo (thin wrapper of `nemo-factuality convert hf-to-nemo`)."""

import sys

from nemo_factuality.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-nemo", *sys.argv[1:]]))
