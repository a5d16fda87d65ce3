"""``lightning-sync``: the command line. ``fit`` / ``validate`` / ``test`` / ``predict`` are LightningCLI
subcommands (``lightning-sync fit --config examples/configs/selsync.yaml``); the model and data default to the
embedded demo (a small CNN on scikit-learn's handwritten digits, shipped inside scikit-learn: no download). They are
:mod:`lightning_sync.trainer_cli` (``SyncCLI``, ``cli_main``, re-exported here); ``compare``, ``demo``,
``lighthouse`` and ``search-switch`` are dispatched to their modules."""

from __future__ import annotations

import sys

from lightning_sync.trainer_cli import DEFAULT_DATA, DEFAULT_MODEL, SyncCLI, cli_main, with_default_classes

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "SyncCLI", "cli_main", "main", "with_default_classes"]


def main(argv: list[str] | None = None) -> None:
    """``lightning-sync [SUBCOMMAND] ...``: ``compare``, ``demo``, ``lighthouse`` and ``search-switch`` to their
    modules, anything else to the Trainer entry point (:func:`~lightning_sync.trainer_cli.cli_main`)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "compare":
        from lightning_sync.compare import main as compare_main

        compare_main(args[1:])
        return
    if args and args[0] == "demo":
        from lightning_sync.demo import main as demo_main

        demo_main(args[1:])
        return
    if args and args[0] == "lighthouse":
        from lightning_sync.comm.ft import lighthouse_main

        lighthouse_main(args[1:])
        return
    if args and args[0] == "search-switch":
        from lightning_sync.search import main as search_main

        search_main(args[1:])
        return
    cli_main(argv)


if __name__ == "__main__":
    main()
