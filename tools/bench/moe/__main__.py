"""``python -m commlib.tools.bench.moe COMMAND`` runs the package's click group."""

from commlib.tools.bench.moe import main

if __name__ == "__main__":
    main()
