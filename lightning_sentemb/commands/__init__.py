"""The `sentemb` subcommands beyond LightningCLI's, one module each where they are long (`evaluate`);
`cli` dispatches to them. Like `cli`, nothing heavy is imported at the top."""

from __future__ import annotations

import argparse

from ..errors import SentEmbUserError

TRUST_HELP = ("load the checkpoint with the full pickle loader, which can run code stored in the file: "
              "only for checkpoints you wrote or trust (default: tensors and plain values only)")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `sentemb: error:` line naming the command (no usage dump)."""

    def error(self, message: str) -> None:
        raise SentEmbUserError(f"{self.prog}: {message} (see `{self.prog} --help`)")
