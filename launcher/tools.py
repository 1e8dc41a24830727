"""The `strata-dist` command: the single-process tools of strata_dist.tools.cli, plus `deploy` (systemd
units for several hosts), which belongs to the launcher layer (docs/DEVELOPING.md: launcher → strata_dist,
never back), so the dispatch lives here."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "deploy":
        from .deploy import main as deploy_main
        return deploy_main(argv[1:])
    from strata_dist.tools.cli import main as tools_main
    if argv[:1] in (["-h"], ["--help"]):
        try:
            tools_main(argv)      # argparse prints the tools' help and exits
        except SystemExit:
            pass
        print("\nalso:\n  deploy              systemd units for ranks on several hosts "
              "(strata-dist deploy systemd -h)")
        return 0
    return tools_main(argv)


if __name__ == "__main__":
    sys.exit(main())
